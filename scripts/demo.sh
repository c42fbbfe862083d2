#!/usr/bin/env bash
# The billing-run demo, as real processes on loopback (`make demo` runs it).
#
# Three replicas of a billing scheduler (cmd/billing) elect a leader through a Consul lock
# (DEMO_STORE=consul, the default) or the PostgreSQL lease of the protected database itself
# (DEMO_STORE=postgres, `make demo STORE=postgres`: nothing but PostgreSQL, no Consul build),
# each under `fenceproxy lock`. The leader charges customers one transaction at a time. In the
# middle of a charge the demo freezes the leader (SIGSTOP to its process groups, like a GC
# pause or a VM freeze) for longer than its lease; the store hands the lease to another replica,
# which resumes the run; then the demo wakes the old leader (SIGCONT), which still believes it
# leads and tries to finish its charge.
#
#   1. through fenceproxy: the new leader's token is raised (by the proxy when Consul shows the
#      new holder, by the acquisition itself on the PostgreSQL lease), which ends the old
#      leader's session (its uncommitted charge rolls back); the old leader's next statement is
#      refused (SQLSTATE ZF001), every customer is charged exactly once;
#   2. the same scenario straight to PostgreSQL: the old leader's charge commits, a customer is
#      charged twice.
#
# It prints a timeline of each run, then a summary with the lines
#   customers charged: N
#   duplicates: N                (must be 0)
#   stale writes rejected: N     (at least 1)
# and exits non-zero if fencing let a duplicate through, rejected nothing, or the run did not
# complete. Every process and folder it starts is removed on exit, whatever happens.
#
# It runs on Debian 12 (bookworm); scripts/deps.sh installs what is missing. PostgreSQL runs as
# the `postgres` OS user when the demo runs as root.
#
# Settings (environment variables; the defaults are the demo's):
#   DEMO_STORE=consul          where the replicas win their lease: consul or postgres
#   DEMO_CUSTOMERS=30          customers to charge in each run
#   DEMO_TX_DELAY=300ms        pause inside each charge's transaction (BILLING_TX_DELAY)
#   DEMO_STEP_DELAY=200ms      pause between two charges (BILLING_STEP_DELAY)
#   DEMO_TTL=10s               lease TTL (Consul: 10 s is its minimum, and it may take up to
#                              2 x TTL before Consul hands the lock over; the PostgreSQL lease
#                              expires TTL after its last renewal, 1 s at least)
#   DEMO_CHARGES_BEFORE_FREEZE=3  charges by the first leader before it is frozen
#   DEMO_CHARGES_AFTER_TAKEOVER=3 charges by the new leader before the old one is thawed
#   DEMO_TIMEOUT=120           seconds allowed for each wait (takeover, end of the run)
#   DEMO_UNFENCED=1            0: skip the comparison run straight to PostgreSQL
#   DEMO_DEPS=1                0: do not run scripts/deps.sh (the caller did)
#   DEMO_BIN_DIR=bin           where fenceproxy and billing are built
#   DEMO_KEEP=0                1: keep the temporary folder (logs) and print its path
#   FENCEPROXY_CONSUL_BIN      Consul agent to use (default: scripts/build-consul.sh's; not
#                              used with DEMO_STORE=postgres)
#   FENCEPROXY_PG_BINDIR       PostgreSQL server binaries (default /usr/lib/postgresql/15/bin)
#
# Lines starting with "demo: service NAME:" show the exact command each service runs; the
# docker-compose.yml services run the same ones (internal/demo's test checks it).
set -euo pipefail
cd "$(dirname "$0")/.."

store=${DEMO_STORE:-consul}
customers=${DEMO_CUSTOMERS:-30}
tx_delay=${DEMO_TX_DELAY:-300ms}
step_delay=${DEMO_STEP_DELAY:-200ms}
ttl=${DEMO_TTL:-10s}
before_freeze=${DEMO_CHARGES_BEFORE_FREEZE:-3}
after_takeover=${DEMO_CHARGES_AFTER_TAKEOVER:-3}
timeout=${DEMO_TIMEOUT:-120}
unfenced=${DEMO_UNFENCED:-1}
bin_dir=${DEMO_BIN_DIR:-bin}
pg_bin=${FENCEPROXY_PG_BINDIR:-/usr/lib/postgresql/15/bin}
replicas=(billing-1 billing-2 billing-3)

prog=demo
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
now() { date -u +%Y-%m-%dT%H:%M:%S.%6NZ; }

started=$SECONDS
[[ $store == consul || $store == postgres ]] || die "DEMO_STORE=$store: want consul or postgres"

# --- what the demo needs -----------------------------------------------------------------------

if [[ ${DEMO_DEPS:-1} == 1 && -f scripts/deps.sh ]]; then
	if [[ $store == consul ]]; then bash scripts/deps.sh; else DEPS_CONSUL=0 bash scripts/deps.sh; fi
fi
command -v go >/dev/null || die "go is not on PATH (run make deps)"
for p in initdb postgres pg_isready psql; do
	[[ -x $pg_bin/$p ]] || die "$pg_bin/$p not found: run make deps (or set FENCEPROXY_PG_BINDIR)"
done
if [[ $store == consul ]]; then
	consul=${FENCEPROXY_CONSUL_BIN:-$(bash scripts/build-consul.sh)}
	[[ -x $consul ]] || die "Consul agent $consul not found: run scripts/build-consul.sh"
fi

mkdir -p "$bin_dir"
bin_dir=$(cd "$bin_dir" && pwd)
say "building fenceproxy and billing into $bin_dir"
go build -o "$bin_dir/fenceproxy" ./cmd/fenceproxy
go build -o "$bin_dir/billing" ./cmd/billing
# The services below name the programs as the containers of docker-compose.yml do.
export PATH="$bin_dir:$PATH"
# Every timestamp in UTC: the timeline merges the logs of several programs.
export TZ=UTC

# --- processes and cleanup ---------------------------------------------------------------------

work=$(mktemp -d "${TMPDIR:-/tmp}/fenceproxy-demo.XXXXXX")
chmod 0711 "$work" # the postgres user must reach its own folder inside
services=()        # pids of the services we started, in start order; each leads its own group
declare -A service_pid=()

# The /proc/PID/stat fields after the command name: state ppid pgrp ...
proc_stat() {
	local s
	s=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
	read -ra stat_fields <<<"${s##*) }"
}
# ours PID: PID is a live child of this script. A pid that bash has reaped already may have
# been given to another process since: never signal it.
ours() { proc_stat "$1" && [[ ${stat_fields[1]} == "$$" && ${stat_fields[0]} != Z ]]; }
pgid() { proc_stat "$1" && echo "${stat_fields[2]}"; }
state() { proc_stat "$1" && echo "${stat_fields[0]}"; }

# stop_pid PID SIGNAL: sends SIGNAL to a service we started, waits up to 20 s for it, then
# SIGKILLs its process group.
stop_pid() {
	local pid=$1 sig=$2 i
	if ours "$pid"; then
		kill -CONT "$pid" 2>/dev/null || true
		kill "-$sig" "$pid" 2>/dev/null || true
		for ((i = 0; i < 200; i++)); do
			ours "$pid" || break
			sleep 0.1
		done
		if ours "$pid"; then
			say "pid $pid did not stop: SIGKILL"
			kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
		fi
	fi
	wait "$pid" 2>/dev/null || true
}

# billing_pids: the billing processes still running (fenceproxy lock starts them in their own
# process groups; their pids come from their "started" events, checked against the binary).
billing_pids() {
	local pid
	for pid in $(cat "$work"/*/billing-*.events 2>/dev/null | sed -n 's/.* event=started pid=\([0-9]*\).*/\1/p'); do
		[[ $(readlink "/proc/$pid/exe" 2>/dev/null) == "$bin_dir/billing" ]] && echo "$pid"
	done
	return 0
}

cleanup() {
	local rc=$? i pid
	trap - EXIT INT TERM
	# A frozen billing process would sit on its SIGTERM: wake them all first.
	for pid in $(billing_pids); do kill -CONT "$pid" 2>/dev/null || true; done
	for ((i = ${#services[@]} - 1; i >= 0; i--)); do
		pid=${services[i]}
		if [[ $pid == "${service_pid[postgres]:-}" ]]; then
			# SIGINT is PostgreSQL's fast shutdown; only the postmaster gets it.
			stop_pid "$pid" INT
		else
			# fenceproxy lock stops its billing child (SIGTERM) and releases the lock.
			stop_pid "$pid" TERM
		fi
	done
	for pid in $(billing_pids); do kill -KILL "$pid" 2>/dev/null || true; done
	if [[ ${DEMO_KEEP:-0} == 1 ]]; then
		say "kept $work"
	else
		rm -rf "$work"
	fi
	exit "$rc"
}
trap cleanup EXIT
trap 'say interrupted; exit 130' INT
trap 'say terminated; exit 143' TERM

# start NAME STDOUT STDERR [VAR=VALUE...] PROGRAM ARGS...: starts a service in its own session
# and process group (so that the demo can signal it and everything it started as one, and a ^C
# in the terminal reaches only the demo), and prints its command line. The array `wrap`, when
# set, goes before it (to run it as another user); it is not printed.
wrap=()
start() {
	local name=$1 out=$2 err=$3
	shift 3
	say "service $name: $*"
	# setsid, the wrapper and env all exec: $! is the service's own pid.
	setsid "${wrap[@]}" env "$@" >"$out" 2>"$err" &
	services+=("$!")
	service_pid[$name]=$!
}

# free_port VAR: sets VAR to a random port below the usual ephemeral range that nobody listened
# on a moment ago and that this demo has not picked yet.

# http_get PORT PATH: the status line and body of an HTTP GET on 127.0.0.1 (no curl needed).
http_get() {
	timeout 5 bash -c 'exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 1
		printf "GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n" "$2" >&3
		sed -n "1p; 1,/^\r\{0,1\}$/d; p" <&3' _ "$1" "$2"
}


alive() { ours "${service_pid[$1]}" || die "$1 exited; its log: $(tail -n 20 "$2" 2>/dev/null)"; }

# --- PostgreSQL, Consul, fenceproxy ------------------------------------------------------------

for p in pg_port consul_port serf_lan_port serf_wan_port server_port proxy_port; do free_port "$p"; done
pg_dir=$work/postgres
mkdir -p "$pg_dir"
as_pg=()
if [[ $(id -u) == 0 ]]; then
	# initdb and postgres refuse to run as root.
	id postgres >/dev/null 2>&1 || die "no postgres OS user: run make deps"
	chown postgres: "$pg_dir"
	as_pg=(setpriv --reuid=postgres --regid=postgres --clear-groups --)
fi
printf 'postgres\n' >"$pg_dir/pwfile"
if [[ $(id -u) == 0 ]]; then chown postgres: "$pg_dir/pwfile"; fi
say "PostgreSQL on 127.0.0.1:$pg_port, folder $work"
"${as_pg[@]}" env -i PATH="$PATH" LC_ALL=C "$pg_bin/initdb" -D "$pg_dir/data" -U postgres \
	--pwfile="$pg_dir/pwfile" --auth=scram-sha-256 -E UTF8 --locale=C >"$pg_dir/initdb.log" 2>&1 ||
	die "initdb failed: $(tail -n 20 "$pg_dir/initdb.log")"
wrap=("${as_pg[@]}" env -i PATH="$PATH" LC_ALL=C)
start postgres "$pg_dir/postgres.log" "$pg_dir/postgres.log" \
	"$pg_bin/postgres" -D "$pg_dir/data" -c listen_addresses=127.0.0.1 -c port="$pg_port" \
	-c unix_socket_directories="$pg_dir" -c fsync=off -c synchronous_commit=off -c full_page_writes=off
wrap=()
pg_ready() { alive postgres "$pg_dir/postgres.log" && "$pg_bin/pg_isready" -q -h 127.0.0.1 -p "$pg_port"; }
wait_for PostgreSQL 60 pg_ready

# sql DB ARGS...: psql as the superuser.
sql() {
	local db=$1
	shift
	PGPASSWORD=postgres "$pg_bin/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$pg_port" -U postgres -d "$db" "$@"
}

if [[ $store == consul ]]; then
	say "Consul $("$consul" version | head -n1 | cut -d' ' -f2) on 127.0.0.1:$consul_port"
	start consul "$work/consul.log" "$work/consul.log" "$consul" agent -dev -node=fenceproxy-demo \
		-bind=127.0.0.1 -client=127.0.0.1 -http-port="$consul_port" -dns-port=-1 -grpc-port=-1 \
		-grpc-tls-port=-1 -serf-lan-port="$serf_lan_port" -serf-wan-port="$serf_wan_port" \
		-server-port="$server_port" -log-level=warn -hcl 'disable_update_check = true'
	# Ready: it knows a leader, and a consistent read answers (404: no such key) rather than 500.
	consul_ready() {
		alive consul "$work/consul.log" &&
			[[ $(http_get "$consul_port" /v1/status/leader 2>/dev/null) == *'"127.0.0.1:'* ]] &&
			[[ $(http_get "$consul_port" '/v1/kv/fenceproxy-demo?consistent' 2>/dev/null | head -n1) == *" 404 "* ]]
	}
	wait_for Consul 60 consul_ready
else
	say "no Consul: the replicas lead through the PostgreSQL lease (fence.leases in the protected database)"
fi

admin_url="postgres://postgres:postgres@127.0.0.1:$pg_port/billing?sslmode=disable"
sql postgres -c 'CREATE DATABASE billing'
# The proxy key: `fenceproxy migrate --key-file` creates the file (a random key) and stores the
# key in the database; the proxy proves its binds and raises with it (`serve --key-file`). In
# docker-compose.yml the file sits on a volume that the migrate and fenceproxy services share.
# The schema's owner is the superuser postgres here, which may end the billing role's backends
# at a raise (a non-superuser owner would need pg_signal_backend and pg_read_all_stats).
mkdir -p "$work/keys"
key_file=$work/keys/fenceproxy.key
say "proxy key file $key_file"
start migrate "$work/migrate.log" "$work/migrate.log" \
	fenceproxy migrate --database "$admin_url" --key-file "$key_file"
wait "${service_pid[migrate]}" || die "fenceproxy migrate failed: $(cat "$work/migrate.log")"
[[ -s $key_file ]] || die "fenceproxy migrate created no key file $key_file: $(cat "$work/migrate.log")"

# With Consul the proxy validates each token against the lock (and raises a new holder's token
# itself); with the PostgreSQL lease it needs no other service: the acquisition raises the
# token, and fence.bind checks every token against the lease row.
if [[ $store == consul ]]; then
	proxy_resource=(--resource billing=locks/billing --key-file "$key_file" --consul-addr "127.0.0.1:$consul_port")
else
	proxy_resource=(--resource billing --key-file "$key_file")
fi
start fenceproxy "$work/fenceproxy.log" "$work/fenceproxy.log" \
	fenceproxy serve --listen "127.0.0.1:$proxy_port" --upstream "postgres://127.0.0.1:$pg_port" \
	"${proxy_resource[@]}" --control-database "$admin_url" --log-format console
proxy_ready() { alive fenceproxy "$work/fenceproxy.log" && listening "$proxy_port"; }
wait_for fenceproxy 30 proxy_ready
say "fenceproxy on 127.0.0.1:$proxy_port"

# --- one run of the scenario -------------------------------------------------------------------

# event RUN NAME KV...: a line of the demo's own in the run's timeline.
event() {
	local run=$1 name=$2
	shift 2
	printf 'time=%s replica=demo token=- event=%s %s\n' "$(now)" "$name" "$*" >>"$work/$run/demo.events"
}

# field KEY LINE: the value of KEY (unquoted values only).
field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$2"; }

count_events() { cat "$@" 2>/dev/null | grep -c " event=charged " || true; }

all_stopped() {
	local p
	for p in "$@"; do [[ $(state "$p") == T ]] || return 1; done
}

# scenario RUN DB DATABASE_URL KEY: runs the replicas to the end, freezing the leader on the way.
# KEY is the Consul lock key; on the PostgreSQL lease, the lease row is in database DB.
scenario() {
	local run=$1 db=$2 url=$3 key=$4 dir=$work/$1 r i
	mkdir -p "$dir"
	: >"$dir/demo.events"
	[[ $db == billing ]] || sql postgres -c "CREATE DATABASE $db"
	sql "$db" -v customers="$customers" -f demo/schema.sql
	say "$run: $customers customers pending in database $db"
	# The arguments of fenceproxy lock between --resource and --on-lost (with Consul, as
	# docker-compose.yml has them).
	local lease_args
	if [[ $store == consul ]]; then
		lease_args=(--key "$key" --consul-addr "127.0.0.1:$consul_port" --database-url "$url" --ttl "$ttl" --lock-delay 0s)
	else
		# The lease row lives in the database the replicas write to, reached directly (as the
		# schema's owner here; any role with EXECUTE on the lease functions will do).
		local lease_url="postgres://postgres:postgres@127.0.0.1:$pg_port/$db?sslmode=disable"
		if [[ $db != billing ]]; then
			fenceproxy migrate --database "$lease_url" >"$dir/migrate.log" 2>&1 ||
				die "fenceproxy migrate of $db failed: $(cat "$dir/migrate.log")"
		fi
		lease_args=(--store postgres --database "$lease_url" --database-url "$url" --ttl "$ttl")
	fi

	local -A lock_pid=()
	for r in "${replicas[@]}"; do
		start "$run/$r" "$dir/$r.events" "$dir/$r.lock.log" \
			BILLING_REPLICA="$r" BILLING_TX_DELAY="$tx_delay" BILLING_STEP_DELAY="$step_delay" \
			fenceproxy lock --resource billing "${lease_args[@]}" --on-lost retry --log-format console \
			-- billing
		lock_pid[$r]=${service_pid[$run/$r]}
	done

	# Fails the demo when every replica has exited before the run's end.
	some_alive() {
		for r in "${replicas[@]}"; do ours "${lock_pid[$r]}" && return 0; done
		for r in "${replicas[@]}"; do printf '%s: %s\n' "$r" "$(tail -n 5 "$dir/$r.lock.log")" >&2; done
		die "$run: every replica exited"
	}
	# The leader: the first replica to start billing.
	leader_line() { cat "$dir"/billing-*.events 2>/dev/null | grep ' event=started ' | sort | head -n1; }
	wait_for "a leader" "$timeout" eval 'some_alive && [[ -n $(leader_line) ]]'
	local line leader child
	line=$(leader_line)
	leader=$(field replica "$line")
	child=$(field pid "$line")
	say "$run: $leader leads with token $(field token "$line")"
	wait_for "$before_freeze charges" "$timeout" eval \
		'(($(count_events "$dir/$leader.events") >= before_freeze))'

	# Freeze the leader in the middle of a charge: right after it logged "charging" (its charge
	# row inserted, not committed). Then make sure the charge really is uncommitted: the
	# process may have been stopped between its COMMIT and the "charged" line. Otherwise
	# thaw it and try again with its next charge.
	local groups=() customer frozen_at attempt committed
	for attempt in 1 2 3 4 5 6 7 8 9 10; do
		wait_for "$leader to start a charge" "$timeout" eval \
			'[[ $(tail -n1 "$dir/$leader.events") == *" event=charging "* ]]'
		groups=("$(pgid "$child")" "$(pgid "${lock_pid[$leader]}")")
		kill -STOP -- "-${groups[0]}" "-${groups[1]}"
		frozen_at=$SECONDS
		wait_for "$leader to stop" 10 all_stopped "$child" "${lock_pid[$leader]}"
		sleep 0.2 # a COMMIT sent just before the stop has landed by now
		line=$(tail -n1 "$dir/$leader.events")
		customer=$(field customer "$line")
		committed=$(sql "$db" -A -t -c "SELECT charged FROM customers WHERE id = ${customer:-0}")
		if [[ $line == *" event=charging "* && $committed == f ]]; then
			break
		fi
		kill -CONT -- "-${groups[0]}" "-${groups[1]}"
		((attempt < 10)) || die "could not freeze $leader in the middle of a charge"
	done
	event "$run" froze "who=$leader customer=$customer pids=$child,${lock_pid[$leader]}"
	say "$run: froze $leader (SIGSTOP to process groups ${groups[*]}) with customer $customer's charge uncommitted"

	# Consul invalidates the frozen leader's session after TTL to 2 x TTL (the PostgreSQL lease
	# expires TTL after its last renewal); another replica takes the lock and resumes the run.
	new_leader_line() {
		cat "$dir"/billing-*.events 2>/dev/null | grep ' event=started ' | grep -v " replica=$leader " | sort | head -n1
	}
	wait_for "another replica to take over" "$timeout" eval '[[ -n $(new_leader_line) ]]'
	line=$(new_leader_line)
	local successor
	successor=$(field replica "$line")
	say "$run: $successor took over with token $(field token "$line") after $((SECONDS - frozen_at))s"
	wait_for "$after_takeover charges by $successor" "$timeout" eval \
		'(($(grep -c " event=charged " "$dir/$successor.events" || true) >= after_takeover))'

	event "$run" thawed "who=$leader frozen_s=$((SECONDS - frozen_at))"
	kill -CONT -- "-${groups[0]}" "-${groups[1]}"
	say "$run: thawed $leader after $((SECONDS - frozen_at))s"

	# The run ends when every replica has exited: the leader when nothing is pending, the
	# others after taking the lock in turn and finding nothing to do.
	local deadline=$((SECONDS + timeout)) codes=()
	for r in "${replicas[@]}"; do
		while ours "${lock_pid[$r]}"; do
			((SECONDS < deadline)) || die "$run: $r still running after ${timeout}s"
			sleep 0.1
		done
		local rc=0
		wait "${lock_pid[$r]}" || rc=$?
		codes+=("$r=$rc")
	done
	say "$run: all replicas exited (${codes[*]})"
}

# report RUN DB: prints the run's timeline and sets charged, duplicates, rejected, pending.
report() {
	local run=$1 db=$2 dir=$work/$1 name value
	declare -gA result=()
	while read -r name value; do
		[[ -n $name && $name != duplicate ]] && result[$name]=$value
	done < <(sql "$db" -A -t -F ' ' -f demo/report.sql)
	result[rejected]=$(cat "$dir"/billing-*.events | grep -c ' event=rejected ' || true)

	# fenceproxy lock's own "lost leadership" lines join the timeline.
	for r in "${replicas[@]}"; do
		awk -F '\t' -v r="$r" '$4 ~ /^lost leadership/ {
			t = $1; sub(/Z$/, "000Z", t)
			token = $5; sub(/.*"token": */, "", token); sub(/[,}].*/, "", token)
			print "time=" t " replica=" r " token=" token " event=lost"
		}' "$dir/$r.lock.log"
	done >"$dir/locks.events"
	# And fenceproxy's, in the run that goes through it.
	if [[ $run == fenced ]]; then
		awk -F '\t' '$4 ~ /^raised token|^ending stale session/ {
			t = $1; sub(/Z$/, "000Z", t)
			token = $5; sub(/.*"token": */, "", token); sub(/[,}].*/, "", token)
			admitted = $5; sub(/.*"admitted": */, "", admitted); sub(/[,}].*/, "", admitted)
			print "time=" t " replica=fenceproxy token=" token " event=" ($4 ~ /^raised/ ? "raised" : "stale admitted=" admitted)
		}' "$work/fenceproxy.log" >"$dir/fenceproxy.events"
	fi

	printf '\n== timeline: %s ==\n' "$run"
	cat "$dir"/*.events | LC_ALL=C sort | awk -f demo/timeline.awk
	local dups
	dups=$(sql "$db" -A -t -F ' ' -f demo/report.sql | sed -n 's/^duplicate \([0-9]*\) /customer \1 charged by /p')
	if [[ -n $dups ]]; then
		printf 'charged more than once:\n'
		sed 's/^/  /' <<<"$dups"
	fi
}

# --- the two runs ------------------------------------------------------------------------------

proxy_url="postgres://billing:billing@127.0.0.1:$proxy_port/billing?sslmode=disable"
direct_url="postgres://billing:billing@127.0.0.1:$pg_port/billing_direct?sslmode=disable"

say "run 1: the replicas reach PostgreSQL through fenceproxy"
scenario fenced billing "$proxy_url" locks/billing
report fenced billing
declare -A fenced=()
for k in "${!result[@]}"; do fenced[$k]=${result[$k]}; done

if [[ $unfenced == 1 ]]; then
	printf '\n'
	say "run 2: the same scenario, the replicas connected straight to PostgreSQL (no fencing)"
	scenario direct billing_direct "$direct_url" locks/billing-direct
	report direct billing_direct
	declare -A direct=()
	for k in "${!result[@]}"; do direct[$k]=${result[$k]}; done
fi

printf '\n== summary ==\n'
printf 'lease store: %s\n' "$store"
printf 'with fenceproxy (%s customers):\n' "${fenced[customers]}"
printf 'customers charged: %s\n' "${fenced[charged]}"
printf 'duplicates: %s\n' "${fenced[duplicates]}"
printf 'stale writes rejected: %s\n' "${fenced[rejected]}"
if [[ $unfenced == 1 ]]; then
	printf 'straight to PostgreSQL, without fencing (%s customers):\n' "${direct[customers]}"
	printf 'customers charged without fencing: %s\n' "${direct[charged]}"
	printf 'duplicates without fencing: %s\n' "${direct[duplicates]}"
	printf 'stale writes rejected without fencing: %s\n' "${direct[rejected]}"
fi
printf 'wall time: %ss\n' "$((SECONDS - started))"

failed=()
((fenced[duplicates] == 0)) || failed+=("fenceproxy let ${fenced[duplicates]} duplicate charge(s) through")
((fenced[rejected] >= 1)) || failed+=("no stale write was rejected")
((fenced[pending] == 0)) || failed+=("the fenced run did not complete: ${fenced[pending]} customers pending")
if [[ $unfenced == 1 ]]; then
	((direct[pending] == 0)) || failed+=("the run without fencing did not complete: ${direct[pending]} customers pending")
	if ((direct[duplicates] == 0)); then
		say "note: this time the run without fencing charged nobody twice (the old leader's charge did not commit)"
	fi
fi
if ((${#failed[@]} > 0)); then
	for f in "${failed[@]}"; do printf 'demo: FAILED: %s\n' "$f"; done
	exit 1
fi
say "ok: every customer charged exactly once through fenceproxy; the stale leader's write was refused"
