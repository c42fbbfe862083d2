#!/usr/bin/env bash
# Benchmark of fenceproxy (`make bench` runs it). A benchmark, not a test: it measures and
# prints, and fails only when a target cannot be benchmarked at all or a raise lets a stale
# session live.
#
# In one run it starts its own throwaway PostgreSQL 15 (initdb as the `postgres` OS user when
# run as root; private port and socket folder in a temporary folder), loads `pgbench -i`,
# installs the fence schema with `fenceproxy migrate --key-file` (which creates the proxy key
# file), starts fenceproxy (`--key-file`, resources bench and raise) and pgbouncer (session
# mode), then runs pgbench against each target:
#
#   direct      PostgreSQL itself
#   fenceproxy  the proxy, session without a token (--unfenced allow): a plain relay
#   pgbouncer   pgbouncer in session mode
#   fenced      the proxy, session with a token (PGOPTIONS='-c fence.resource=bench
#               -c fence.token=1'): bound once at session start (fence.bind, one statement in
#               its own transaction before ReadyForQuery), then relayed as plainly as unfenced
#
# in these cells, every one in every round:
#
#   select-only/P, read-write/P  pgbench -S and -N (tpcb-like without the branch and teller
#               updates), for each query protocol P of BENCH_PROTOCOLS (pgbench -M simple and
#               -M prepared); also available: tpcb-like, pgbench's default script
#   connect/simple  pgbench -C -S: a new connection for every transaction, so that the session
#               start (for fenced: the bind) is in every transaction; BENCH_CONNECT_CLIENTS
#               clients (default 1: the time of one session start, not a queue of them), the
#               targets of BENCH_CONNECT_TARGETS (default: direct direct-bind fenceproxy fenced),
#               where direct-bind is PostgreSQL itself with the proxy's bind statement before
#               the SELECT (bench/bind.sql): the bind's cost in the database alone. It reports
#               the time per connection (pgbench's "average connection time", to
#               ReadyForQuery) and per transaction (connect, statements, disconnect) and their
#               differences: the microseconds the bind adds to a session start
#
# and, after the pgbench cells of every round, the raise latency (bench/raise, a Go program; run
# it on its own with `go run ./bench/raise -h`): for each N of BENCH_RAISE_STALE it opens N
# fenced sessions with token t of resource raise through the proxy (every other one idle in a
# transaction with an uncommitted INSERT), then times a new session connecting with t+1 until
# it is ready (its bind raises the token, which ends the N backends and waits for them to exit
# before it commits), then the same connect again (a bind with nothing to raise), and checks
# that every stale session is gone and none of their rows committed.
#
# Rounds are interleaved: all cells and targets of one round, then the next round, with the
# targets of even rounds in reverse order (A B C D, D C B A, ...) and the raise's N too, so that
# machine noise spreads over every target. Every target connects over TCP on 127.0.0.1, and the
# proxy and pgbouncer reach PostgreSQL over TCP too, so each hop costs the same kind of socket.
# Before every measured run the script does what pgbench does by default (VACUUM of branches
# and tellers, TRUNCATE of history), plus a CHECKPOINT, directly on PostgreSQL; pgbench itself
# runs with -n so that the preparation is identical for every target and outside the
# measurement.
#
# It prints the individual runs, then a table of median TPS and latency per cell and target;
# where each transaction's CPU time went (PostgreSQL's processes, the middleman, the rest of the
# machine, and idle time, from /proc); the ratios, of the medians and as the median of the
# per-round ratios (fenced/unfenced is the cost of fencing); the session start cost; the raise
# latency (median, min, max of all samples); and the proxy's peak RSS and CPU time. Every
# process and folder it starts is removed on exit.
#
# Settings (environment variables):
#   BENCH_SECONDS=10      duration of each measured pgbench run (-T)
#   BENCH_RUNS=3          rounds (BENCH_RUNS=5 or more for figures to quote: medians of >= 5)
#   BENCH_CLIENTS="1 8 64 256"   pgbench clients (-c) of the throughput cells: one cell per number
#                         (the curve shows how the cost grows with load); the cells of 1 client also
#                         log every transaction (pgbench -l) for the latency's mean and 99th percentile
#   BENCH_THREADS=2       pgbench threads (-j) of the throughput cells (fewer for fewer clients)
#   BENCH_SCALE=10        pgbench scale factor (-i -s)
#   BENCH_PROTOCOLS="simple prepared"   query protocols (-M) of the throughput cells, from
#                         simple, extended and prepared (BENCH_PROTOCOL, if set, is a single one)
#   BENCH_WORKLOADS="select-only read-write connect"   cells, from select-only, read-write (-N),
#                         tpcb-like (pgbench's default script) and connect (-C -S, simple protocol)
#   BENCH_CONNECT_CLIENTS=1  pgbench clients (-c, and -j) of the connect cell
#   BENCH_CONNECT_TARGETS="direct direct-bind fenceproxy pgbouncer fenced"   targets of the connect cell
#   BENCH_RAISE_STALE="0 1 10 100"   numbers of stale sessions the raise ends ("": no raise
#                         measurement); 0 is a raise that ends nobody
#   BENCH_RAISE_SAMPLES=1 raise samples per N in every round (BENCH_RUNS x this in all)
#   BENCH_IDLE_SESSIONS=1000  idle sessions bench/idle opens through each target of
#                         BENCH_IDLE_TARGETS after the rounds, to measure the memory (resident set)
#                         each one costs the middleman (0: no idle measurement)
#   BENCH_IDLE_TARGETS="fenceproxy fenced pgbouncer"   targets of the idle measurement
#   BENCH_PERF=1          0: count system calls from /proc even where perf works (see io_counts)
#   BENCH_WARMUP=2        seconds of unmeasured warm-up per cell and target (0: none)
#   BENCH_FSYNC=off       PostgreSQL fsync (off also sets synchronous_commit and
#                         full_page_writes off: the disk is not what is measured)
#   BENCH_TARGETS="direct fenceproxy pgbouncer fenced"   targets, in round order
#   BENCH_PROXY_ARGS=     extra flags for `fenceproxy serve`
#   BENCH_PROXY_ENV=      environment of `fenceproxy serve`, NAME=VALUE ... (GOMAXPROCS=1, GOGC=...)
#   BENCH_KEEP=0          1: keep the temporary folder (logs) and print its path
#   BENCH_BIN             a fenceproxy binary to benchmark as it is (default: bin/fenceproxy,
#                         built when missing or older than the sources)
#   FENCEPROXY_PG_BINDIR  PostgreSQL server binaries (default /usr/lib/postgresql/15/bin)
#
# Short runs for trying changes: BENCH_SECONDS=3 BENCH_RUNS=1 BENCH_WARMUP=0.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${BENCH_SECONDS:-10}
runs=${BENCH_RUNS:-3}
read -r -a client_counts <<<"${BENCH_CLIENTS:-1 8 64 256}"
((${#client_counts[@]} > 0)) || die "BENCH_CLIENTS is empty"
clients=0 # the largest of them
for c in "${client_counts[@]}"; do
	[[ $c =~ ^[1-9][0-9]*$ ]] || die "BENCH_CLIENTS must list positive whole numbers, not '$c'"
	((c > clients)) && clients=$c
done
threads=${BENCH_THREADS:-2}
scale=${BENCH_SCALE:-10}
read -r -a protocols <<<"${BENCH_PROTOCOL:-${BENCH_PROTOCOLS-simple prepared}}"
warmup=${BENCH_WARMUP:-2}
fsync=${BENCH_FSYNC:-off}
read -r -a targets <<<"${BENCH_TARGETS:-direct fenceproxy pgbouncer fenced}"
read -r -a proxy_extra <<<"${BENCH_PROXY_ARGS:-}"
read -r -a proxy_env <<<"${BENCH_PROXY_ENV:-}"
bin=${BENCH_BIN:-bin/fenceproxy}
pg_bin=${FENCEPROXY_PG_BINDIR:-/usr/lib/postgresql/15/bin}
read -r -a workloads <<<"${BENCH_WORKLOADS-select-only read-write connect}"
connect_clients=${BENCH_CONNECT_CLIENTS:-1}
read -r -a connect_targets <<<"${BENCH_CONNECT_TARGETS-direct direct-bind fenceproxy pgbouncer fenced}"
read -r -a raise_stale <<<"${BENCH_RAISE_STALE-0 1 10 100}"
raise_samples=${BENCH_RAISE_SAMPLES:-1}
idle_sessions=${BENCH_IDLE_SESSIONS:-1000}
read -r -a idle_targets <<<"${BENCH_IDLE_TARGETS-fenceproxy fenced pgbouncer}"
((idle_sessions > 0)) || idle_targets=()
# Other work on the machine is the main source of noise: note how busy it was before we started.
load_start=$(cut -d' ' -f1-3 /proc/loadavg)
resource=bench
token=1
# The raise measurement raises this resource's token over and over: a resource of its own, so
# that token 1 of resource bench stays admitted for the fenced target.
raise_resource=raise

prog=bench
# shellcheck source=scripts/lib.sh
. scripts/lib.sh

for v in seconds runs clients threads scale warmup connect_clients raise_samples idle_sessions; do
	[[ ${!v} =~ ^[0-9]+$ ]] || die "BENCH_${v^^} must be a whole number, not '${!v}'"
done
((seconds > 0 && runs > 0 && clients > 0 && threads > 0 && scale > 0 && connect_clients > 0 && raise_samples > 0)) ||
	die "BENCH_SECONDS, BENCH_RUNS, BENCH_CLIENTS, BENCH_THREADS, BENCH_SCALE, BENCH_CONNECT_CLIENTS and BENCH_RAISE_SAMPLES must be positive"
for c in "${client_counts[@]}"; do
	((c < threads || c % threads == 0)) || die "BENCH_CLIENTS: $c must be a multiple of BENCH_THREADS ($threads)"
done
max_stale=0
for n in "${raise_stale[@]}"; do
	[[ $n =~ ^[0-9]+$ ]] || die "BENCH_RAISE_STALE must list whole numbers, not '$n'"
	((n > max_stale)) && max_stale=$n
done
# The raise's stale sessions, the new one, the script's own, the proxy's control connection
# and autovacuum must fit next to the clients: max_connections is 100 unless more are needed.
max_connections=$((max_stale + 20 > 100 ? max_stale + 20 : 100))
((${#idle_targets[@]} > 0 && idle_sessions + 20 > max_connections)) && max_connections=$((idle_sessions + 20))
((clients + 20 > max_connections)) && max_connections=$((clients + 20))
((clients <= max_connections - 20 && connect_clients <= max_connections - 20)) ||
	die "BENCH_CLIENTS ($clients) or BENCH_CONNECT_CLIENTS above $((max_connections - 20)) does not fit max_connections=$max_connections"
[[ $fsync == on || $fsync == off ]] || die "BENCH_FSYNC must be on or off"
for p in "${protocols[@]}"; do
	case $p in simple | extended | prepared) ;; *) die "BENCH_PROTOCOLS: '$p' is not simple, extended or prepared" ;; esac
done
for t in "${targets[@]}"; do
	case $t in direct | fenceproxy | pgbouncer | fenced) ;; *) die "unknown target '$t' in BENCH_TARGETS" ;; esac
done
for t in "${connect_targets[@]}"; do
	case $t in direct | direct-bind | fenceproxy | pgbouncer | fenced) ;; *) die "unknown target '$t' in BENCH_CONNECT_TARGETS" ;; esac
done
for t in "${idle_targets[@]}"; do
	case $t in fenceproxy | pgbouncer | fenced) ;; *) die "unknown target '$t' in BENCH_IDLE_TARGETS (fenceproxy, fenced, pgbouncer)" ;; esac
done
# The cells, in round order: each throughput workload under each protocol, then connect.
cells=()
for w in "${workloads[@]}"; do
	case $w in
	select-only | read-write | tpcb-like)
		((${#protocols[@]} > 0)) || die "BENCH_PROTOCOLS is empty"
		for p in "${protocols[@]}"; do for c in "${client_counts[@]}"; do cells+=("$w/$p/c$c"); done; done
		;;
	connect) if ((${#connect_targets[@]} > 0)); then cells+=(connect/simple); fi ;;
	*) die "unknown workload '$w' in BENCH_WORKLOADS" ;;
	esac
done
[[ " ${idle_targets[*]} " == *" pgbouncer "* ]] && use_bouncer_idle=1 || use_bouncer_idle=0
((${#cells[@]} > 0 || ${#raise_stale[@]} > 0 || ${#idle_targets[@]} > 0)) || die "nothing to measure: BENCH_WORKLOADS and BENCH_RAISE_STALE are empty"
for p in initdb postgres pg_isready psql pgbench; do
	[[ -x $pg_bin/$p ]] || die "$pg_bin/$p not found: run make deps (or set FENCEPROXY_PG_BINDIR)"
done
# pgbouncer runs when a cell has it among its targets.
use_bouncer=$use_bouncer_idle
for c in "${cells[@]}"; do
	if [[ $c == connect/* ]]; then t=" ${connect_targets[*]} "; else t=" ${targets[*]} "; fi
	[[ $t == *" pgbouncer "* ]] && use_bouncer=1
done
((use_bouncer == 0)) || command -v pgbouncer >/dev/null || die "pgbouncer not found: run make deps"

# --- the proxy binary --------------------------------------------------------------------------

# The default binary is rebuilt when missing or older than the sources; one named by BENCH_BIN is
# used as it is (to benchmark a given build).
if [[ -n ${BENCH_BIN:-} ]]; then
	[[ -x $bin ]] || die "BENCH_BIN=$bin is not an executable"
elif [[ ! -x $bin ]] || [[ -n $(find cmd internal migrations go.mod go.sum -newer "$bin" -print -quit 2>/dev/null) ]]; then
	command -v go >/dev/null || die "$bin is missing or stale and go is not on PATH"
	say "building $bin"
	mkdir -p "$(dirname "$bin")"
	go build -o "$bin" ./cmd/fenceproxy || die "go build failed"
fi
bin=$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")
# The commit the report names: the sources' as the run starts (the binary was built from them,
# unless BENCH_BIN names another one).
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
[[ -n $(git status --porcelain 2>/dev/null | head -n1) ]] && commit+=" (with uncommitted changes)"
if ((${#raise_stale[@]} > 0)); then
	command -v go >/dev/null || die "the raise measurement (bench/raise) needs go on PATH; BENCH_RAISE_STALE= skips it"
fi

# --- processes and cleanup ---------------------------------------------------------------------

work=$(mktemp -d "${TMPDIR:-/tmp}/fenceproxy-bench.XXXXXX")
chmod 0711 "$work" # the postgres user must reach its folders inside
declare -A service_pid=()
services=() # start order

stop_service() {
	local name=$1 pid=${service_pid[$1]} sig=TERM i
	# PostgreSQL: SIGINT is its fast shutdown (SIGTERM would wait for the sessions).
	[[ $name == postgres ]] && sig=INT
	if kill -0 "$pid" 2>/dev/null; then
		kill "-$sig" "$pid" 2>/dev/null || true
		for ((i = 0; i < 200; i++)); do
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.1
		done
		if kill -0 "$pid" 2>/dev/null; then
			say "$name (pid $pid) did not stop within 20 s: SIGKILL"
			kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
		fi
	fi
	wait "$pid" 2>/dev/null || true
}

cleanup() {
	local rc=$? i
	trap - EXIT INT TERM
	for ((i = ${#services[@]} - 1; i >= 0; i--)); do stop_service "${services[i]}"; done
	if [[ ${BENCH_KEEP:-0} == 1 ]]; then
		say "kept $work"
	else
		rm -rf "$work"
	fi
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

as_pg=()
if [[ $(id -u) == 0 ]]; then
	# initdb, postgres and pgbouncer refuse to run as root.
	id postgres >/dev/null 2>&1 || die "no postgres OS user: run make deps"
	as_pg=(setpriv --reuid=postgres --regid=postgres --clear-groups --)
fi
# mine DIR...: creates folders owned by the user the servers run as.
mine() {
	mkdir -p "$@"
	if [[ $(id -u) == 0 ]]; then chown postgres: "$@"; fi
}

# start NAME LOG [as_pg] PROGRAM ARGS...: starts a service in its own session (a ^C reaches only
# this script, which stops everything in order); setsid and env exec, so $! is the service.
start() {
	local name=$1 log=$2 wrap=()
	shift 2
	if [[ $1 == as_pg ]]; then
		wrap=("${as_pg[@]}")
		shift
	fi
	setsid "${wrap[@]}" env -i PATH="$PATH" LC_ALL=C "$@" >"$log" 2>&1 &
	service_pid[$name]=$!
	services+=("$name")
}

alive() { kill -0 "${service_pid[$1]}" 2>/dev/null || die "$1 exited; its log: $(tail -n 20 "$2" 2>/dev/null)"; }


# cpu_ticks PID [reaped]: user + system CPU time of PID, in clock ticks; with a second argument,
# plus that of its children it has reaped (cutime, cstime).
clk_tck=$(getconf CLK_TCK)
cpu_ticks() {
	awk -v reaped="${2:+1}" '{ sub(/^.*\) /, ""); print $12 + $13 + (reaped ? $14 + $15 : 0) }' "/proc/$1/stat" 2>/dev/null ||
		echo 0
}
# The middleman's system calls and context switches per transaction: counts, which the machine's
# load moves little, where CPU time and throughput move a lot. With perf (BENCH_PERF=1, the default
# when `perf stat` can count the raw_syscalls tracepoint): every system call of the process's
# threads (perf stat -p: epoll_wait, futex, recvfrom, sendto, read, write... all of them) and its
# context switches. Without it, from /proc: read(2)/write(2)-family calls (/proc/PID/io syscr,
# syscw, which count neither recv nor send, nor epoll or futex) and context switches summed over
# /proc/PID/task/*.
perf_ok=0
if [[ ${BENCH_PERF:-1} == 1 ]] && command -v perf >/dev/null &&
	perf stat -x, -e raw_syscalls:sys_enter,context-switches -p $$ -- sleep 0.1 >/dev/null 2>&1; then
	perf_ok=1
fi
# io_counts PID: "SYSCALLS SWITCHES" from /proc (see above), or "0 0".
io_counts() {
	local r w
	r=$(awk '$1 == "syscr:" { print $2 }' "/proc/$1/io" 2>/dev/null || echo 0)
	w=$(awk '$1 == "syscw:" { print $2 }' "/proc/$1/io" 2>/dev/null || echo 0)
	echo "$((${r:-0} + ${w:-0})) $(cat /proc/"$1"/task/*/status 2>/dev/null | awk '/^(non)?voluntary_ctxt_switches:/ { n += $2 } END { print n + 0 }')"
}
# status_kb PID FIELD: a kB field of /proc/PID/status (VmHWM, VmRSS).
status_kb() { awk -v f="$2:" '$1 == f { print $2 }' "/proc/$1/status" 2>/dev/null || echo 0; }

# --- PostgreSQL --------------------------------------------------------------------------------

for p in pg_port proxy_port bouncer_port; do free_port "$p"; done
pg_dir=$work/postgres
mine "$pg_dir"
if [[ $fsync == off ]]; then
	durability=(-c fsync=off -c synchronous_commit=off -c full_page_writes=off)
else
	durability=(-c fsync=on -c synchronous_commit=on -c full_page_writes=on)
fi
say "PostgreSQL 15 on 127.0.0.1:$pg_port (fsync=$fsync), temporary folder $work"
"${as_pg[@]}" env -i PATH="$PATH" LC_ALL=C "$pg_bin/initdb" -D "$pg_dir/data" -U postgres \
	--auth=trust -E UTF8 --locale=C >"$pg_dir/initdb.log" 2>&1 ||
	die "initdb failed: $(tail -n 20 "$pg_dir/initdb.log")"
pg_settings=(-c listen_addresses=127.0.0.1 -c port="$pg_port" -c unix_socket_directories="$pg_dir"
	-c max_connections="$max_connections" -c shared_buffers=256MB -c max_wal_size=2GB -c checkpoint_timeout=30min
	"${durability[@]}")
start postgres "$pg_dir/postgres.log" as_pg "$pg_bin/postgres" -D "$pg_dir/data" "${pg_settings[@]}"
pg_ready() { alive postgres "$pg_dir/postgres.log" && "$pg_bin/pg_isready" -q -h 127.0.0.1 -p "$pg_port"; }
wait_for PostgreSQL 60 pg_ready

psql_direct() { "$pg_bin/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$pg_port" -U postgres "$@"; }
psql_direct -d postgres -c 'CREATE DATABASE bench'
say "pgbench -i -s $scale"
"$pg_bin/pgbench" -i -q -s "$scale" -h 127.0.0.1 -p "$pg_port" -U postgres bench >"$work/pgbench-init.log" 2>&1 ||
	die "pgbench -i failed: $(tail -n 20 "$work/pgbench-init.log")"
db_url="postgres://postgres@127.0.0.1:$pg_port/bench?sslmode=disable"
# migrate creates the key file (a random key) and stores the key in the database; the proxy
# proves its binds and raises with it. The schema's owner is the superuser postgres, which may
# end any backend at a raise.
key_file=$work/fenceproxy.key
"$bin" migrate --database "$db_url" --key-file "$key_file" >"$work/migrate.log" 2>&1 ||
	die "fenceproxy migrate failed: $(cat "$work/migrate.log")"

# --- fenceproxy and pgbouncer ------------------------------------------------------------------

# --control-database as in production: the proxy LISTENs for raises there (one connection, idle
# during the pgbench runs).
proxy_cmd=("$bin" serve --listen "127.0.0.1:$proxy_port" --upstream "postgres://127.0.0.1:$pg_port"
	--unfenced allow --resource "$resource,$raise_resource" --key-file "$key_file"
	--control-database "$db_url" --log-level warn "${proxy_extra[@]}")
start fenceproxy "$work/fenceproxy.log" env "${proxy_env[@]}" "${proxy_cmd[@]}"
proxy_ready() { alive fenceproxy "$work/fenceproxy.log" && listening "$proxy_port"; }
wait_for fenceproxy 30 proxy_ready

raise_bin=$work/raise
if ((${#raise_stale[@]} > 0)); then
	go build -o "$raise_bin" ./bench/raise || die "go build ./bench/raise failed"
fi
idle_bin=$work/idle
if ((${#idle_targets[@]} > 0)); then
	go build -o "$idle_bin" ./bench/idle || die "go build ./bench/idle failed"
fi

bouncer_dir=$work/pgbouncer
pool=$((clients > 20 ? clients : 20))
((${#idle_targets[@]} > 0 && idle_sessions > pool)) && pool=$idle_sessions
if ((use_bouncer)); then
	mine "$bouncer_dir"
	cat >"$bouncer_dir/pgbouncer.ini" <<EOF
[databases]
bench = host=127.0.0.1 port=$pg_port dbname=bench

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $bouncer_port
unix_socket_dir = $bouncer_dir
pidfile = $bouncer_dir/pgbouncer.pid
auth_type = trust
auth_file = $bouncer_dir/userlist.txt
pool_mode = session
max_client_conn = $((pool + 100))
default_pool_size = $pool
log_connections = 0
log_disconnections = 0
EOF
	printf '"postgres" ""\n' >"$bouncer_dir/userlist.txt"
	if [[ $(id -u) == 0 ]]; then chown postgres: "$bouncer_dir"/*; fi
	start pgbouncer "$bouncer_dir/pgbouncer.log" as_pg pgbouncer "$bouncer_dir/pgbouncer.ini"
	bouncer_ready() { alive pgbouncer "$bouncer_dir/pgbouncer.log" && listening "$bouncer_port"; }
	wait_for pgbouncer 30 bouncer_ready
fi

# The CPU and memory figures are read from /proc/PID: PID must be the program itself.
declare -A program=([fenceproxy]=$(readlink -f "$bin"))
((use_bouncer)) && program[pgbouncer]=$(readlink -f "$(command -v pgbouncer)")
for name in "${!program[@]}"; do
	exe=$(readlink -f "/proc/${service_pid[$name]}/exe" 2>/dev/null || true)
	[[ $exe == "${program[$name]}" ]] ||
		die "pid ${service_pid[$name]} runs '$exe', not ${program[$name]}: cannot read its CPU and memory"
done

# --- measuring ---------------------------------------------------------------------------------

target_port() {
	case $1 in
	direct | direct-bind) echo "$pg_port" ;;
	fenceproxy | fenced) echo "$proxy_port" ;;
	pgbouncer) echo "$bouncer_port" ;;
	esac
}
target_options() { [[ $1 == fenced ]] && echo "-c fence.resource=$resource -c fence.token=$token" || true; }
target_pid() {
	case $1 in
	fenceproxy | fenced) echo "${service_pid[fenceproxy]}" ;;
	pgbouncer) echo "${service_pid[pgbouncer]}" ;;
	*) echo "" ;;
	esac
}
# cell_targets CELL: the targets of CELL, in round order (into the array `cell_order`).
cell_targets() {
	if [[ $1 == connect/* ]]; then cell_order=("${connect_targets[@]}"); else cell_order=("${targets[@]}"); fi
}

# pgbench_cmd TARGET CELL SECONDS [LOG_PREFIX]: the pgbench command line (into the array `cmd`).
pgbench_cmd() {
	local w p c j=$threads flags
	IFS=/ read -r w p c <<<"$2"
	c=${c#c}
	((c < j)) && j=$c
	case $w in
	select-only) flags=(-S) ;;
	read-write) flags=(-N) ;;
	tpcb-like) flags=(-b tpcb-like) ;;
	connect) flags=(-C -S) c=$connect_clients j=$((connect_clients < threads ? connect_clients : threads)) ;;
	esac
	[[ $1 == direct-bind ]] && flags=(-C -f bench/bind.sql -s "$scale")
	cmd=(env)
	[[ $1 == fenced ]] && cmd+=("PGOPTIONS=$(target_options "$1")")
	# One client: every transaction's latency in a log, for its mean and 99th percentile.
	[[ $w != connect && $c == 1 && -n ${4:-} ]] && flags+=(-l --log-prefix="$4")
	cmd+=("$pg_bin/pgbench" -n "${flags[@]}" -M "$p" -c "$c" -j "$j" -T "$3"
		-h 127.0.0.1 -p "$(target_port "$1")" -U postgres bench)
}

prepare() {
	psql_direct -d bench -c 'VACUUM pgbench_branches' -c 'VACUUM pgbench_tellers' \
		-c 'TRUNCATE pgbench_history' -c 'CHECKPOINT' >/dev/null
}

# PostgreSQL's CPU: the postmaster's own and its reaped children's (cutime, cstime), plus every
# live child's. A backend reaped while the children are read would be counted twice, or not at
# all; its time then moves into the postmaster's cutime, so the reads repeat until that stays put.
pg_cpu_ticks() {
	local pm first total child
	pm=$(head -n1 "$pg_dir/data/postmaster.pid")
	while :; do
		first=$(cpu_ticks "$pm" reaped) total=0
		for child in $(pgrep -P "$pm"); do total=$((total + $(cpu_ticks "$child"))); done
		[[ $(cpu_ticks "$pm" reaped) == "$first" ]] && break
	done
	echo $((first + total))
}
# idle_ticks, busy_ticks: the machine's idle (with iowait) and other time, all CPUs (/proc/stat).
idle_ticks() { awk '$1 == "cpu" { print $5 + $6; exit }' /proc/stat; }
busy_ticks() { awk '$1 == "cpu" { print $2 + $3 + $4 + $7 + $8 + $9; exit }' /proc/stat; }

results=$work/results.tsv # cell target run tps latency_ms transactions failed cpu_ticks status pg_ticks idle_ticks busy_ticks conn_ms syscalls ctxsw lat_mean_us lat_p99_us
: >"$results"
raises=$work/raises.tsv # run stale sample raise_ms plain_ms ended_zf001 ended_other survived committed alive
: >"$raises"
failures=0

# run TARGET CELL RUN SECONDS: one pgbench run; RUN 0 is a warm-up (not recorded).
run() {
	local target=$1 cell=$2 n=$3 secs=$4 out pid before after rc=0 tps lat ntx failed conn status=ok
	local pg_before pg_after idle_before idle_after busy_before busy_after io_before io_after perf_pid= perf_out
	out=$work/pgbench-${cell//\//-}-$target-$n.log
	local txlog=$work/txlog-${cell//\//-}-$target-$n lat_stats
	pgbench_cmd "$target" "$cell" "$secs" "$txlog"
	prepare
	pid=$(target_pid "$target")
	before=0
	[[ -n $pid ]] && before=$(cpu_ticks "$pid")
	io_before=(0 0)
	[[ -n $pid ]] && read -r -a io_before <<<"$(io_counts "$pid")"
	perf_out=$work/perf-${cell//\//-}-$target-$n.csv
	if [[ -n $pid ]] && ((perf_ok)); then
		perf stat -x, -o "$perf_out" -e raw_syscalls:sys_enter,context-switches -p "$pid" &
		perf_pid=$!
	fi
	pg_before=$(pg_cpu_ticks) idle_before=$(idle_ticks) busy_before=$(busy_ticks)
	# A hang of a target must not hang the benchmark.
	timeout -k 5 $((secs + 60)) "${cmd[@]}" >"$out" 2>&1 || rc=$?
	after=0
	[[ -n $pid ]] && after=$(cpu_ticks "$pid")
	io_after=(0 0)
	[[ -n $pid ]] && read -r -a io_after <<<"$(io_counts "$pid")"
	if [[ -n $perf_pid ]]; then
		kill -INT "$perf_pid" 2>/dev/null || true
		wait "$perf_pid" 2>/dev/null || true
		io_before=(0 0)
		io_after=("$(awk -F, '$3 == "raw_syscalls:sys_enter" { print $1 + 0 }' "$perf_out")"
			"$(awk -F, '$3 == "context-switches" { print $1 + 0 }' "$perf_out")")
	fi
	idle_after=$(idle_ticks) busy_after=$(busy_ticks)
	pg_after=$(pg_cpu_ticks)
	tps=$(sed -n 's/^tps = \([0-9.]*\) (without initial connection time)$/\1/p; s/^tps = \([0-9.]*\) (including reconnection times)$/\1/p' "$out")
	lat=$(sed -n 's/^latency average = \([0-9.]*\) ms$/\1/p' "$out")
	conn=$(sed -n 's/^average connection time = \([0-9.]*\) ms$/\1/p' "$out")
	ntx=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' "$out")
	failed=$(sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p' "$out")
	# pgbench -l: one line per transaction, its latency in us the third field.
	lat_stats="- -"
	if compgen -G "$txlog.*" >/dev/null; then
		lat_stats=$(cat "$txlog".* | awk '{ print $3 }' | sort -n | awk '{ v[NR] = $1; s += $1 }
			END { if (NR) { i = int(NR * 0.99 + 0.999999); printf "%.1f %d", s / NR, v[i < 1 ? 1 : i] } else print "- -" }')
		rm -f "$txlog".*
	fi
	if ((rc == 124 || rc == 137)); then
		status="TIMEOUT"
	elif ((rc != 0)) || [[ -z $tps ]] || grep -qiE 'aborted|error' "$out"; then
		status="FAILED(rc=$rc)"
	fi
	if [[ $status != ok ]]; then
		failures=$((failures + 1))
		say "$cell $target run $n: $status; pgbench output ($out):"
		sed 's/^/    | /' "$out" | head -n 40
		say "  command: $(printf '%q ' "${cmd[@]}")"
	fi
	((n == 0)) && return 0
	printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$cell" "$target" "$n" "${tps:-0}" "${lat:-0}" \
		"${ntx:-0}" "${failed:-0}" "$((after - before))" "$status" "$((pg_after - pg_before))" \
		"$((idle_after - idle_before))" "$((busy_after - busy_before))" "${conn:--}" \
		"$((${io_after[0]:-0} - io_before[0]))" "$((${io_after[1]:-0} - io_before[1]))" "${lat_stats% *}" "${lat_stats#* }" >>"$results"
	printf 'bench: round %d  %-26s %-11s %10.0f tps  %7.3f ms%s  %s\n' "$n" "$cell" "$target" \
		"${tps:-0}" "${lat:-0}" "${conn:+  (connection ${conn} ms)}" "$status"
}

raise_cmd=("$raise_bin" -proxy "postgres://postgres@127.0.0.1:$proxy_port/bench?sslmode=disable"
	-direct "$db_url" -resource "$raise_resource")

# raise_run RUN STALE_LIST: the raise measurement (bench/raise) for the comma-separated numbers of
# stale sessions; RUN 0 is a warm-up (not recorded).
raise_run() {
	local n=$1 list=$2 out rc=0 line
	out=$work/raise-$n.log
	timeout -k 5 300 "${raise_cmd[@]}" -stale "$list" -samples "$raise_samples" >"$out" 2>&1 || rc=$?
	if ((rc != 0)); then
		failures=$((failures + 1))
		say "raise run $n: FAILED(rc=$rc); its output ($out):"
		sed 's/^/    | /' "$out" | head -n 40
		say "  command: $(printf '%q ' "${raise_cmd[@]}") -stale $list -samples $raise_samples"
	fi
	((n == 0)) && return 0
	while read -r line; do
		printf 'bench: round %d  %s\n' "$n" "$line"
		[[ $line == "raise stale="* ]] || continue
		# raise stale=N sample=I token=T raise_ms=X plain_ms=Y ended_zf001=A ended_other=B survived=C committed=D alive=E
		awk -v r="$n" '{ for (i = 2; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
			printf "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r, v["stale"], v["sample"], v["raise_ms"], v["plain_ms"],
				v["ended_zf001"], v["ended_other"], v["survived"], v["committed"], v["alive"] }' <<<"$line" >>"$raises"
	done < <(grep '^raise' "$out")
}

join_comma() { local IFS=,; echo "$*"; }

repro="BENCH_IDLE_SESSIONS=$idle_sessions BENCH_IDLE_TARGETS='${idle_targets[*]}' BENCH_SECONDS=$seconds BENCH_RUNS=$runs BENCH_CLIENTS='${client_counts[*]}' BENCH_THREADS=$threads BENCH_SCALE=$scale BENCH_PROTOCOLS='${protocols[*]}' BENCH_WORKLOADS='${workloads[*]}' BENCH_CONNECT_CLIENTS=$connect_clients BENCH_CONNECT_TARGETS='${connect_targets[*]}' BENCH_RAISE_STALE='${raise_stale[*]}' BENCH_RAISE_SAMPLES=$raise_samples BENCH_WARMUP=$warmup BENCH_FSYNC=$fsync BENCH_TARGETS='${targets[*]}'"
[[ ${#proxy_extra[@]} -gt 0 ]] && repro+=" BENCH_PROXY_ARGS='${proxy_extra[*]}'"
[[ ${#proxy_env[@]} -gt 0 ]] && repro+=" BENCH_PROXY_ENV='${proxy_env[*]}'"
[[ -n ${BENCH_BIN:-} ]] && repro+=" BENCH_BIN=$BENCH_BIN"
repro+=" bash bench/bench.sh"

say "fenceproxy: $(printf '%q ' "${proxy_cmd[@]}")"
((use_bouncer)) && say "pgbouncer:  $(pgbouncer --version | head -n1), session mode, pool $pool, 127.0.0.1:$bouncer_port"
say "pgbench, one line per cell (first target shown; the others differ in -p and, for fenced, PGOPTIONS):"
for c in "${cells[@]}"; do
	cell_targets "$c"
	pgbench_cmd "${cell_order[0]}" "$c" "$seconds"
	say "  $(printf '%-26s' "$c") $(printf '%q ' "${cmd[@]}")"
done
say "  (fenced: the same as fenceproxy, with PGOPTIONS='$(target_options fenced)')"
((${#raise_stale[@]} > 0)) && say "raise: $(printf '%q ' "${raise_cmd[@]}") -stale $(join_comma "${raise_stale[@]}") -samples $raise_samples"

started=$SECONDS
if ((warmup > 0)); then
	say "warm-up: ${warmup}s per cell and target (not recorded)"
	for c in "${cells[@]}"; do
		cell_targets "$c"
		for t in "${cell_order[@]}"; do run "$t" "$c" 0 "$warmup"; done
	done
	if ((${#raise_stale[@]} > 0)); then raise_run 0 1; fi
fi
say "measuring: $runs round(s) x (${#cells[@]} cell(s) x their targets x ${seconds}s$( ((${#raise_stale[@]} > 0)) && echo ", then the raise with $(join_comma "${raise_stale[@]}") stale sessions x $raise_samples"))"
# Odd rounds run the targets (and the raise's numbers of stale sessions) in the listed order,
# even rounds in reverse (A B, B A, ...): no target always runs first or right after another one.
for ((r = 1; r <= runs; r++)); do
	for c in "${cells[@]}"; do
		cell_targets "$c"
		order=("${cell_order[@]}")
		if ((r % 2 == 0)); then
			order=()
			for ((i = ${#cell_order[@]} - 1; i >= 0; i--)); do order+=("${cell_order[i]}"); done
		fi
		for t in "${order[@]}"; do run "$t" "$c" "$r" "$seconds"; done
	done
	if ((${#raise_stale[@]} > 0)); then
		stale_order=("${raise_stale[@]}")
		if ((r % 2 == 0)); then
			stale_order=()
			for ((i = ${#raise_stale[@]} - 1; i >= 0; i--)); do stale_order+=("${raise_stale[i]}"); done
		fi
		raise_run "$r" "$(join_comma "${stale_order[@]}")"
	fi
done
idle_out=$work/idle.tsv # target sessions rss_before_kib rss_after_kib per_session_kib
: >"$idle_out"
for t in "${idle_targets[@]}"; do
	out=$work/idle-$t.log
	url="postgres://postgres@127.0.0.1:$(target_port "$t")/bench?sslmode=disable"
	[[ $t == fenced ]] && url+="&options=$(target_options fenced | sed 's/ /%20/g; s/=/%3D/g')"
	if timeout -k 5 600 "$idle_bin" -url "$url" -pid "$(target_pid "$t")" -n "$idle_sessions" >"$out" 2>&1; then
		line=$(grep '^idle sessions=' "$out")
		say "$t: $line"
		awk -v t="$t" '{ for (i = 2; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
			printf "%s\t%s\t%s\t%s\t%s\n", t, v["sessions"], v["rss_before_kib"], v["rss_after_kib"], v["per_session_kib"] }' <<<"$line" >>"$idle_out"
	else
		failures=$((failures + 1))
		say "idle sessions through $t: FAILED; its output ($out):"
		sed 's/^/    | /' "$out" | head -n 20
	fi
done
measured=$((SECONDS - started))
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
bindings=$(psql_direct -d bench -At -c "SELECT count(*) FROM fence.bindings WHERE resource = '$resource'")

proxy_pid=${service_pid[fenceproxy]}
alive fenceproxy "$work/fenceproxy.log"
proxy_hwm=$(status_kb "$proxy_pid" VmHWM)
proxy_rss=$(status_kb "$proxy_pid" VmRSS)
proxy_cpu=$(cpu_ticks "$proxy_pid")
proxy_threads=$(awk '$1 == "Threads:" { print $2 }' "/proc/$proxy_pid/status")
if ((use_bouncer)); then
	bouncer_pid=${service_pid[pgbouncer]}
	bouncer_hwm=$(status_kb "$bouncer_pid" VmHWM)
	bouncer_cpu=$(cpu_ticks "$bouncer_pid")
fi

# --- report ------------------------------------------------------------------------------------

cpu_model=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n1)

echo
echo "==================================================================================="
echo "fenceproxy benchmark  $(date -u +%Y-%m-%dT%H:%M:%SZ)  commit $commit"
echo "machine: $(nproc) CPU(s), ${cpu_model:-unknown CPU}, Linux $(uname -r)"
echo "PostgreSQL $("$pg_bin/postgres" --version | awk '{ print $3 }'), fsync=$fsync, max_connections=$max_connections," \
	"shared_buffers=256MB;$( ((use_bouncer)) && echo " $(pgbouncer --version | head -n1) session mode;") pgbench -c ${client_counts[*]} -j $threads" \
	"-T $seconds (connect: -C -S -c $connect_clients), scale $scale, $runs round(s), interleaved"
echo "targets over TCP 127.0.0.1; fenced = the proxy with PGOPTIONS='$(target_options fenced)'"
echo "reproduce (from the repository root): $repro"
echo

awk -F'\t' -v perf="$perf_ok" -v order="${targets[*]}" -v corder="${connect_targets[*]}" -v hz="$clk_tck" -v cl="${cells[*]}" -v runs_n="$runs" '
function median(list,   a, n, i, j, t) {
	n = split(list, a, " ")
	for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] + 0 > t + 0; j--) a[j + 1] = a[j]; a[j + 1] = t }
	if (n == 0) return 0
	return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
}
# targets(CELL): the targets of CELL, in order, into TT[1..return value]
function targets(c) { return split(c ~ /^connect\// ? corder : order, TT, " ") }
# perround(CELL, A, B, FIELD): the per-round ratios (FIELD "tps") or differences in us (FIELD
# "conn": connection time, "lat": latency) of A and B: their median, min and max into PR_med,
# PR_lo, PR_hi; returns how many rounds had both (0: none)
function perround(c, a, b, f,   list, i, q, n) {
	list = ""; n = 0
	for (i = 1; i <= runs_n; i++) {
		if (!((c, a, i) in round) || !((c, b, i) in round)) continue
		if (f == "tps") { if (round[c, b, i] <= 0) continue; q = round[c, a, i] / round[c, b, i] }
		else if (f == "lat") q = (rlat[c, a, i] - rlat[c, b, i]) * 1000
		else { if (rconn[c, a, i] == "-" || rconn[c, b, i] == "-") continue; q = (rconn[c, a, i] - rconn[c, b, i]) * 1000 }
		list = list " " q; n++
		if (n == 1 || q < PR_lo) PR_lo = q
		if (n == 1 || q > PR_hi) PR_hi = q
	}
	if (n == 0) return 0
	PR_med = median(list)
	return n
}
{
	k = $1 SUBSEP $2
	if ($9 == "ok") {
		tps[k] = tps[k] " " $4; lat[k] = lat[k] " " $5; round[$1, $2, $3] = $4 + 0; rconn[$1, $2, $3] = $13; rlat[$1, $2, $3] = $5 + 0
		if ($13 != "-") conn[k] = conn[k] " " $13
		if ($16 != "-" && $16 != "") { lmean[k] = lmean[k] " " $16; lp99[k] = lp99[k] " " $17; rlm[$1, $2, $3] = $16; rlp[$1, $2, $3] = $17 }
		if ($6 > 0) {
			per = 1e6 / hz / $6
			busy_us[k] = busy_us[k] " " $12 * per; pg_us[k] = pg_us[k] " " $10 * per
			mid_us[k] = mid_us[k] " " $8 * per; idle_us[k] = idle_us[k] " " $11 * per
			rest_us[k] = rest_us[k] " " ($12 - $10 - $8) * per
			sc[k] = sc[k] " " $14 / $6; cs[k] = cs[k] " " $15 / $6
		}
		if (!(k in lo) || $4 + 0 < lo[k]) lo[k] = $4 + 0
		if (!(k in hi) || $4 + 0 > hi[k]) hi[k] = $4 + 0
	}
	else bad[k]++
	runs[k] = runs[k] sprintf(" %7.0f%s", $4, $9 == "ok" ? "" : "!")
	ntx[k] += $6; nfail[k] += $7; ticks[k] += $8
}
END {
	nc = split(cl, C, " ")
	printf "%-26s %-11s %10s %11s %9s %7s   %s\n", "cell", "target", "median TPS", "latency ms", "CPU us/tx", "max/min", "individual runs (TPS)"
	for (c = 1; c <= nc; c++) { nt = targets(C[c]); for (t = 1; t <= nt; t++) {
		k = C[c] SUBSEP TT[t]
		if (!(k in runs)) continue
		m[k] = median(tps[k])
		cpu = (TT[t] ~ /^direct/ || ntx[k] == 0) ? "-" : sprintf("%.1f", ticks[k] / hz * 1e6 / ntx[k])
		spread = (lo[k] > 0) ? hi[k] / lo[k] : 0
		if (spread > 1.3) noisy++
		printf "%-26s %-11s %10.0f %11.3f %9s %7.2f  %s%s\n", C[c], TT[t], m[k], median(lat[k]), cpu, spread, runs[k],
			(bad[k] ? sprintf("  (%d failed run(s), marked !)", bad[k]) : "") (nfail[k] ? sprintf("  (%d failed transactions)", nfail[k]) : "")
	} }
	print ""
	print "latency ms: median of the runs\x27 average latency (connect: connection, SELECT and disconnection);"
	print "CPU us/tx: CPU time of the proxy or pgbouncer process during the runs, per transaction (includes"
	print "the proxy\x27s background work, if any); max/min: fastest run over slowest run of the cell"
	if (noisy) printf "WARNING: in %d cell(s) the runs differ by more than 30%%: the machine was busy (see the load\naverage below); rerun on a quiet machine, or with more BENCH_RUNS, before trusting the ratios\n", noisy
	print ""
	print "CPU time per transaction, us (median of the runs): the machine\x27s busy time split into PostgreSQL"
	print "(postmaster and all its processes), the middleman (proxy or pgbouncer) and the rest (pgbench,"
	print "the kernel\x27s own threads, anything else running); idle: time no CPU had work"
	printf "%-26s %-11s %9s %11s %10s %9s %9s\n", "cell", "target", "busy", "PostgreSQL", "middleman", "rest", "idle"
	for (c = 1; c <= nc; c++) { nt = targets(C[c]); for (t = 1; t <= nt; t++) {
		k = C[c] SUBSEP TT[t]
		if (!(k in busy_us)) continue
		printf "%-26s %-11s %9.1f %11.1f %10s %9.1f %9.1f\n", C[c], TT[t], median(busy_us[k]), median(pg_us[k]),
			(TT[t] ~ /^direct/) ? "-" : sprintf("%.1f", median(mid_us[k])), median(rest_us[k]), median(idle_us[k])
	} }

	print ""
	print "system calls and context switches of the middleman per transaction (median of the runs; " (perf ? "perf stat" : "/proc")
	print (perf ? "-e raw_syscalls:sys_enter,context-switches -p PID: all its system calls" : "/proc/PID/io syscr+syscw: read/write-family calls only, no recv/send/epoll/futex") "):"
	print "counts, not times: the machine\x27s load moves them little"
	printf "%-26s %-11s %9s %9s\n", "cell", "target", "syscalls", "switches"
	for (c = 1; c <= nc; c++) { nt = targets(C[c]); for (t = 1; t <= nt; t++) {
		k = C[c] SUBSEP TT[t]
		if (!(k in sc) || TT[t] ~ /^direct/) continue
		printf "%-26s %-11s %9.2f %9.2f\n", C[c], TT[t], median(sc[k]), median(cs[k])
	} }

	# The ratios: one row per cell, the pairs whose two targets ran in it.
	np = split("fenced/fenceproxy fenceproxy/direct pgbouncer/direct fenceproxy/pgbouncer fenced/direct", P, " ")
	label["fenced/fenceproxy"] = "fenced/unfenced"
	label["fenceproxy/direct"] = "unfenced/direct"
	label["fenceproxy/pgbouncer"] = "unfenced/pgbouncer"
	for (p = 1; p <= np; p++) {
		split(P[p], ab, "/")
		for (c = 1; c <= nc; c++) if ((C[c] SUBSEP ab[1]) in runs && (C[c] SUBSEP ab[2]) in runs) { use[p] = 1; shown++ }
	}
	print ""
	if (!shown) { print "ratios: none (no cell ran two of the targets these ratios compare)" }
	else {
		print "ratio of median TPS (fenced/unfenced: both through the proxy, the cost of fencing)"
		printf "%-26s", "cell"
		for (p = 1; p <= np; p++) if (use[p]) printf " %19s", (P[p] in label) ? label[P[p]] : P[p]
		print ""
		for (c = 1; c <= nc; c++) {
			printf "%-26s", C[c]
			for (p = 1; p <= np; p++) if (use[p]) {
				split(P[p], ab, "/"); a = C[c] SUBSEP ab[1]; b = C[c] SUBSEP ab[2]
				if (m[a] > 0 && m[b] > 0) printf " %19.3f", m[a] / m[b]; else printf " %19s", "-"
			}
			print ""
		}
		# The same ratios taken round by round: the two runs of a round are minutes apart at most,
		# so a slow drift of the machine (other tenants) cancels out of each ratio.
		print ""
		print "median of the per-round ratios (min-max)"
		printf "%-26s", "cell"
		for (p = 1; p <= np; p++) if (use[p]) printf " %19s", (P[p] in label) ? label[P[p]] : P[p]
		print ""
		for (c = 1; c <= nc; c++) {
			printf "%-26s", C[c]
			for (p = 1; p <= np; p++) if (use[p]) {
				split(P[p], ab, "/")
				if (perround(C[c], ab[1], ab[2], "tps")) printf " %7.3f (%.2f-%.2f)", PR_med, PR_lo, PR_hi
				else printf " %19s", "-"
			}
			print ""
		}
	}

	# Latency at one client: what the middleman adds to each transaction, from pgbench -l (each
	# transaction by itself), against direct; per round, the two runs are minutes apart.
	for (c = 1; c <= nc; c++) if (C[c] ~ /\/c1$/) {
		if (!hdr1++) {
			print ""
			print "latency at 1 client, us (pgbench -l: every transaction; medians of the runs\x27 mean and 99th"
			print "percentile); added: minus direct\x27s, as medians and as the median of the per-round differences"
			printf "%-26s %-11s %9s %9s %12s %12s %16s\n", "cell", "target", "mean", "p99", "added mean", "added p99", "per round mean"
		}
		nt = targets(C[c])
		d = C[c] SUBSEP "direct"
		for (t = 1; t <= nt; t++) {
			k = C[c] SUBSEP TT[t]
			if (!(k in lmean)) continue
			mm = median(lmean[k]); mp = median(lp99[k])
			am = "-"; ap = "-"; pr = "-"
			if (TT[t] != "direct" && (d in lmean)) {
				am = sprintf("%+.1f", mm - median(lmean[d])); ap = sprintf("%+.1f", mp - median(lp99[d]))
				list = ""; nr = 0
				for (r = 1; r <= runs_n; r++) if ((C[c], TT[t], r) in rlm && (C[c], "direct", r) in rlm) { list = list " " (rlm[C[c], TT[t], r] - rlm[C[c], "direct", r]); nr++ }
				if (nr) pr = sprintf("%+.1f", median(list))
			}
			printf "%-26s %-11s %9.1f %9.1f %12s %12s %16s\n", C[c], TT[t], mm, mp, am, ap, pr
		}
	}

	# The session start: pgbench -C reports the average time of a connection (to ReadyForQuery: a
	# fenced session with its bind); its latency is connection, statements and disconnection.
	for (c = 1; c <= nc; c++) if (C[c] ~ /^connect\//) {
		print ""
		print "session start (" C[c] ", pgbench -C): medians of the runs\x27 average connection time (to"
		print "ReadyForQuery) and latency (connect, transaction, disconnect), ms"
		nt = targets(C[c])
		for (t = 1; t <= nt; t++) {
			k = C[c] SUBSEP TT[t]
			if (!(k in tps)) continue
			cm[TT[t]] = (k in conn) ? median(conn[k]) : "-"; lm[TT[t]] = median(lat[k])
			printf "  %-11s connection %8s   transaction %8.3f\n", TT[t], cm[TT[t]] == "-" ? "-" : sprintf("%.3f", cm[TT[t]]), lm[TT[t]]
		}
		np = split("fenced/fenceproxy/the bind through the proxy:direct-bind/direct/the bind\x27s SQL in the database alone:fenceproxy/direct/the proxy\x27s hop (unfenced)", D, ":")
		for (p = 1; p <= np; p++) {
			split(D[p], ab, "/")
			if (!(ab[1] in lm) || !(ab[2] in lm)) continue
			printf "  %s, %s - %s:\n", ab[3], ab[1] == "fenceproxy" ? "unfenced" : ab[1], ab[2] == "fenceproxy" ? "unfenced" : ab[2]
			if (cm[ab[1]] != "-" && cm[ab[2]] != "-" && ab[1] != "direct-bind") {
				printf "    connection  %+6.0f us (medians)", (cm[ab[1]] - cm[ab[2]]) * 1000
				if (perround(C[c], ab[1], ab[2], "conn")) printf "; per round %+.0f us (%+.0f to %+.0f)", PR_med, PR_lo, PR_hi
				print ""
			}
			printf "    transaction %+6.0f us (medians)", (lm[ab[1]] - lm[ab[2]]) * 1000
			if (perround(C[c], ab[1], ab[2], "lat")) printf "; per round %+.0f us (%+.0f to %+.0f)", PR_med, PR_lo, PR_hi
			print ""
		}
	}
}' "$results"

if [[ -s $raises ]]; then
	echo
	echo "raise latency (bench/raise): connect through the proxy with token t+1 until ReadyForQuery while N"
	echo "sessions with token t are open (half of them idle in a transaction with an uncommitted INSERT);"
	echo "its bind raises the token, ends the N backends and waits for them before it commits. plain: the"
	echo "same connect again (a bind, nothing to raise). ms, over every sample of every round:"
	awk -F'\t' '
	function sorted(list, a,   n, i, j, t) {
		n = split(list, a, " ")
		for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] + 0 > t + 0; j--) a[j + 1] = a[j]; a[j + 1] = t }
		return n
	}
	function stat(list,   a, n) {
		n = sorted(list, a)
		return sprintf("%8.2f %8.2f %8.2f", (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2, a[1], a[n])
	}
	{ if (!($2 in cnt)) ns[++nn] = $2; cnt[$2]++; rl[$2] = rl[$2] " " $4; pl[$2] = pl[$2] " " $5
	  zf[$2] += $6; ot[$2] += $7; bad[$2] += $8 + $9 + $10 }
	END {
		# by N, ascending
		for (i = 2; i <= nn; i++) { t = ns[i]; for (j = i - 1; j >= 1 && ns[j] + 0 > t + 0; j--) ns[j + 1] = ns[j]; ns[j + 1] = t }
		printf "%7s %8s %8s %8s %8s   %8s %8s %8s   %s\n", "stale", "median", "min", "max", "samples", "plain", "min", "max", "the stale sessions"
		for (i = 1; i <= nn; i++) {
			n = ns[i]
			printf "%7d %s %8d   %s   %d ended with ZF001, %d otherwise%s\n", n, stat(rl[n]), cnt[n], stat(pl[n]), zf[n], ot[n],
				bad[n] ? sprintf(", %d FAILED (survived, committed or alive)", bad[n]) : ""
		}
	}' "$raises"
fi

echo
printf 'fenceproxy: peak RSS (VmHWM) %.1f MiB, RSS at end %.1f MiB, %s threads, CPU time %.1f s (user+sys, whole run)\n' \
	"$(echo "$proxy_hwm / 1024" | bc -l)" "$(echo "$proxy_rss / 1024" | bc -l)" "$proxy_threads" "$(echo "$proxy_cpu / $clk_tck" | bc -l)"
if ((use_bouncer)); then
	printf 'pgbouncer:  peak RSS (VmHWM) %.1f MiB, CPU time %.1f s\n' \
		"$(echo "$bouncer_hwm / 1024" | bc -l)" "$(echo "$bouncer_cpu / $clk_tck" | bc -l)"
fi
if [[ -s $idle_out ]]; then
	echo "memory per idle session (bench/idle: VmRSS of the middleman before and after opening $idle_sessions sessions through it):"
	awk -F'\t' '{ printf "  %-11s %6.1f KiB per session (%d sessions: %.1f MiB -> %.1f MiB)\n", $1, $5, $2, $3 / 1024, $4 / 1024 }' "$idle_out"
fi
echo "fence.bindings: $bindings row(s) of resource $resource at the end (one per fenced backend started; a row leaves when its pid is bound again, at the next raise of the resource, or when one bind in 64 sweeps the rows of exited backends)"
problems=$(grep -ciE '"level":"(warn|error|dpanic|panic|fatal)"|\b(WARN|ERROR|PANIC|FATAL)\b' "$work/fenceproxy.log" || true)
echo "fenceproxy log: $problems line(s) at warn or above$([[ $problems -gt 0 ]] && echo ', first ones:')"
if [[ $problems -gt 0 ]]; then head -n 10 "$work/fenceproxy.log" | cut -c1-300 | sed 's/^/    | /'; fi
echo "load average (1, 5, 15 min) when the script started: $load_start; at the end: $load_after" \
	"($(nproc) CPU(s); the benchmark itself keeps about $((clients + threads)) tasks busy)"
echo "measured in ${measured}s (warm-up included); whole run $((SECONDS))s"
echo "reproduce (from the repository root): $repro"
echo "==================================================================================="
if ((failures > 0)); then
	say "$failures run(s) failed (pgbench, or the raise measurement): see the output above"
	exit 1
fi
