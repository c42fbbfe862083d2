# fenceproxy: `make test` is what CI runs (.ci/run).
.PHONY: all deps build test fmt fmt-check vet proof-labels sqltest model model-quick fuzz gotest gen-long failover-matrix chaos demo bench bench-quick driver-suites psycopg-suite clean
# Prerequisites are steps in order (deps before tests), also under make -j.
.NOTPARALLEL:

GO        ?= go
# A count, not a duration: with a duration, Go 1.26's fuzz coordinator can fail a target
# with a bare "context deadline exceeded" when a loaded machine starves its workers at the
# deadline (Go issue 75804, fixed in 1.27). 200000 runs take 2-15 s per target here.
FUZZTIME  ?= 200000x
GOTESTFLAGS ?= -race -count=1 -timeout 15m

all: build

# The lease store of `make demo`: consul (default), postgres (`make demo STORE=postgres`:
# the PostgreSQL lease, nothing but PostgreSQL needed, no Consul build) or etcd (an etcd
# server inside the demo's process, no Consul build).
STORE ?= consul

deps:
	DEPS_CONSUL=$(if $(filter postgres etcd,$(STORE)),0,1) bash scripts/deps.sh

# The version `fenceproxy version` prints: the nearest tag and the commit, -dirty for a work
# tree with changes (without git: empty, and the binary falls back to Go's build information).
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null)
LDFLAGS  = -X main.version=$(VERSION)

build:
	$(GO) build -ldflags "$(LDFLAGS)" -o bin/fenceproxy ./cmd/fenceproxy
	if [ -d cmd/billing ]; then $(GO) build -o bin/billing ./cmd/billing; fi

# The checks run fastest first; `go test ./...` runs last so that its closing line
# (ok / FAIL) ends the output.
test: deps fmt-check vet proof-labels sqltest model-quick fuzz gotest

fmt:
	gofmt -w .

fmt-check:
	@files=$$(gofmt -l .); if [ -n "$$files" ]; then \
		echo "gofmt needed (run make fmt):"; echo "$$files"; exit 1; fi
	@echo "gofmt: ok"

vet:
	$(GO) vet ./...

# docs/proof.md against its citations: every obligation cited by a pgTAP test, every cited
# label defined (migrations/labels_test.go; gotest runs it again, this fails first).
proof-labels:
	$(GO) test -count=1 -run '^(TestProofLabels|TestCitations)$$' ./migrations/

sqltest:
	if [ -f scripts/test-sql.sh ]; then bash scripts/test-sql.sh; fi

# The Promela model of bind, raise and end with failover (model/fence.pml, model/README.md):
# Spin checks the real model (it must pass) and each negative control (it must fail with a
# trail), and every fence.<name> it names must exist in migrations/. model-quick is the
# bounded configuration `make test` runs (about 32 s); model runs every configuration.
model-quick:
	bash model/verify.sh quick

model:
	bash model/verify.sh full

# Each fuzz target, briefly: the committed corpus in testdata/fuzz/ runs in gotest anyway.
fuzz:
	@set -e; for file in $$(grep -rl --include='*_test.go' '^func Fuzz' . | sort); do \
		for target in $$(sed -n 's/^func \(Fuzz[A-Za-z0-9_]*\)(.*/\1/p' "$$file"); do \
			echo "fuzz: $$target in ./$$(dirname "$${file#./}") for $(FUZZTIME)"; \
			$(GO) test -run='^$$' -fuzz="^$$target$$" -fuzztime=$(FUZZTIME) "./$$(dirname "$${file#./}")"; \
		done; \
	done

gotest:
	$(GO) test $(GOTESTFLAGS) ./...

# The generated protocol sequences of internal/proxy/generated_test.go, long: `make test`
# runs 48 rounds; this runs GEN_ROUNDS from seed GEN_SEED (a failure names its seed:
# GEN_SEED=<seed> GEN_ROUNDS=1 replays it). About 0.25 s a round on 2 cores under -race.
GEN_ROUNDS ?= 5000
GEN_SEED   ?= 1
gen-long:
	FENCEPROXY_GEN_ROUNDS=$(GEN_ROUNDS) FENCEPROXY_GEN_SEED=$(GEN_SEED) \
		$(GO) test -race -count=1 -timeout 0 -v -run '^TestGeneratedSequences$$' ./internal/proxy/

# TestFailoverMatrix whole (docs/failover.md): every setup, lock service and number of proxies;
# `make test` runs a subset of it.
failover-matrix:
	FENCEPROXY_FAILOVER_MATRIX=1 $(GO) test -race -count=1 -timeout 30m -v -run '^TestFailoverMatrix$$' ./internal/proxy/

# The chaos campaign of internal/chaos, long: `make test` runs 20 rounds through fenceproxy
# and a 4-round negative control straight to PostgreSQL (TestCampaign); this runs
# CHAOS_ROUNDS and CHAOS_CONTROL_ROUNDS (CHAOS_SEED=<seed> replays a campaign's draws,
# CHAOS_TTL sets the replicas' session TTL, CHAOS_FAULTS=kind,kind limits the faults).
# About 3-5 s a round; the figures are printed at the end of each campaign. Then the
# failover campaign (TestCampaignFailover: a failover in every round, with an asynchronous
# and with a synchronous standby, CHAOS_FAILOVER_ROUNDS each; its negative control,
# CHAOS_FAILOVER_CONTROL_ROUNDS); `make test` runs one round of one variant and one of the
# control.
CHAOS_ROUNDS         ?= 1000
CHAOS_CONTROL_ROUNDS ?= 20
CHAOS_FAILOVER_ROUNDS         ?= 100
CHAOS_FAILOVER_CONTROL_ROUNDS ?= 10
chaos: deps
	CHAOS_ROUNDS=$(CHAOS_ROUNDS) CHAOS_CONTROL_ROUNDS=$(CHAOS_CONTROL_ROUNDS) \
	CHAOS_FAILOVER_ROUNDS=$(CHAOS_FAILOVER_ROUNDS) CHAOS_FAILOVER_CONTROL_ROUNDS=$(CHAOS_FAILOVER_CONTROL_ROUNDS) \
	CHAOS_FAILOVER_STANDBY=both \
		$(GO) test -count=1 -timeout 0 -v -run '^TestCampaign(Failover)?$$' ./internal/chaos/

# cmd/demo: the servers come from internal/testenv; `go run ./cmd/demo --help` lists its settings.
demo: deps build
	$(GO) run ./cmd/demo --store $(STORE)

# cmd/bench: PostgreSQL, PgBouncer and fenceproxy from internal/testenv, pgbench as the load,
# one table of medians with the ratios; `go run ./cmd/bench --help` lists its settings
# (BENCH_FLAGS passes them, e.g. BENCH_FLAGS='--rounds=9 --workloads=connect'). About 50
# minutes on 2 cores; bench-quick is the smoke test's size (every row, figures meaningless; 256
# clients included: 15 minutes at load 25-35 on 2 cores, its run measured here).
BENCH_FLAGS ?=
bench: deps
	$(GO) run ./cmd/bench $(BENCH_FLAGS)

bench-quick: deps
	$(GO) run ./cmd/bench --quick $(BENCH_FLAGS)

# The drivers' own test suites (node-postgres's integration tests, psycopg 3's pytest suite,
# pgx's tests) straight to PostgreSQL and through the proxy by each admission path
# (SUITE_MODES, default direct,unfenced,bare,consul,lease); fails if a test passes only
# directly (scripts/driver-suites.sh, cmd/driversuites). psycopg-suite: psycopg's alone.
driver-suites:
	bash scripts/driver-suites.sh

psycopg-suite:
	SUITES=psycopg bash scripts/driver-suites.sh

clean:
	rm -rf bin coverage.out coverage.html *.coverprofile
