# fenceproxy: `make test` is what CI runs (.ci/run).
.PHONY: all deps build test fmt fmt-check vet sqltest fuzz gotest demo bench clean
# Prerequisites are steps in order (deps before tests), also under make -j.
.NOTPARALLEL:

GO        ?= go
# A count, not a duration: with a duration, Go 1.26's fuzz coordinator can fail a target
# with a bare "context deadline exceeded" when a loaded machine starves its workers at the
# deadline (Go issue 75804, fixed in 1.27). 200000 runs take 2-15 s per target here.
FUZZTIME  ?= 200000x
GOTESTFLAGS ?= -race -count=1 -timeout 15m

all: build

deps:
	bash scripts/deps.sh

build:
	$(GO) build -o bin/fenceproxy ./cmd/fenceproxy
	if [ -d cmd/billing ]; then $(GO) build -o bin/billing ./cmd/billing; fi

# The checks run fastest first; `go test ./...` runs last so that its closing line
# (ok / FAIL) ends the output.
test: deps fmt-check vet sqltest fuzz gotest

fmt:
	gofmt -w .

fmt-check:
	@files=$$(gofmt -l .); if [ -n "$$files" ]; then \
		echo "gofmt needed (run make fmt):"; echo "$$files"; exit 1; fi
	@echo "gofmt: ok"

vet:
	$(GO) vet ./...

sqltest:
	if [ -f scripts/test-sql.sh ]; then bash scripts/test-sql.sh; fi

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

demo: deps build
	bash scripts/demo.sh

bench: deps build
	bash bench/bench.sh

clean:
	rm -rf bin coverage.out coverage.html *.coverprofile
