#!/usr/bin/env bash
# Throughput benchmark of fenceproxy (`make bench` runs it). A benchmark, not a test: it
# measures and prints, and fails only when a target cannot be benchmarked at all.
#
# In one run it starts its own throwaway PostgreSQL 15 (initdb as the `postgres` OS user when
# run as root; private port and socket folder in a temporary folder), loads `pgbench -i`,
# installs the fence schema with `fenceproxy migrate`, starts fenceproxy and pgbouncer
# (session mode), then runs pgbench against each target:
#
#   direct      PostgreSQL itself
#   fenceproxy  the proxy, session without a token (--unfenced allow)
#   pgbouncer   pgbouncer in session mode
#   fenced      the proxy, session with a token (PGOPTIONS='-c fence.resource=bench
#               -c fence.token=1'): a commit-time check per transaction
#   direct-check  (diagnostic, not in the default list) PostgreSQL itself, with the same
#               check added to pgbench's script (bench/*-check.sql): what the check costs the
#               database alone, without the proxy's hop; needs BENCH_PROTOCOL=simple
#   parsed      (diagnostic, not in the default list) a second proxy started with
#               --debug-parse-unfenced, session without a token: it parses every simple Query
#               as a fenced session does and injects nothing, so parsed/fenceproxy is what the
#               parse alone costs and fenced/parsed what the check adds to it
#
# for the workloads of BENCH_WORKLOADS (default: select-only, pgbench -S, and read-write,
# tpcb-like without branch and teller updates, pgbench -N; also available: tpcb-like, pgbench's
# default read-write script with the teller and branch updates), BENCH_RUNS times, interleaved (all
# targets of one round, then the next round; even rounds in reverse order) so that machine noise
# spreads over every target. Every target connects over
# TCP on 127.0.0.1, and the proxy and pgbouncer reach PostgreSQL over TCP too, so each hop
# costs the same kind of socket. Before every measured run the script does what pgbench does by
# default (VACUUM of branches and tellers, TRUNCATE of history), plus a CHECKPOINT, directly on
# PostgreSQL; pgbench itself runs with -n so that the preparation is identical for every target
# and outside the measurement.
#
# It prints the individual runs, then a table of median TPS and latency per target and
# workload; where each transaction's CPU time went (PostgreSQL's processes, the middleman, the
# rest of the machine, and idle time, from /proc); the ratios, of the medians and as the median
# of the per-round ratios; and the proxy's peak RSS and CPU time. Every process and folder it
# starts is removed on exit.
#
# Settings (environment variables):
#   BENCH_SECONDS=10      duration of each measured pgbench run (-T)
#   BENCH_RUNS=3          rounds of every target and workload
#   BENCH_CLIENTS=8       pgbench clients (-c)
#   BENCH_THREADS=2       pgbench threads (-j)
#   BENCH_SCALE=10        pgbench scale factor (-i -s)
#   BENCH_PROTOCOL=simple pgbench query protocol (-M): simple, extended or prepared
#   BENCH_WORKLOADS="select-only read-write"   workloads, from select-only, read-write (-N) and
#                         tpcb-like (pgbench's default script)
#   BENCH_WARMUP=2        seconds of unmeasured warm-up per target and workload (0: none)
#   BENCH_FSYNC=off       PostgreSQL fsync (off also sets synchronous_commit and
#                         full_page_writes off: the disk is not what is measured)
#   BENCH_TARGETS="direct fenceproxy pgbouncer fenced"   targets, in round order (add
#                         direct-check for the diagnostic target above)
#   BENCH_PROXY_ARGS=     extra flags for `fenceproxy serve`
#   BENCH_KEEP=0          1: keep the temporary folder (logs) and print its path
#   BENCH_BIN             a fenceproxy binary to benchmark as it is (default: bin/fenceproxy,
#                         built when missing or older than the sources)
#   FENCEPROXY_PG_BINDIR  PostgreSQL server binaries (default /usr/lib/postgresql/15/bin)
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${BENCH_SECONDS:-10}
runs=${BENCH_RUNS:-3}
clients=${BENCH_CLIENTS:-8}
threads=${BENCH_THREADS:-2}
scale=${BENCH_SCALE:-10}
protocol=${BENCH_PROTOCOL:-simple}
warmup=${BENCH_WARMUP:-2}
fsync=${BENCH_FSYNC:-off}
read -r -a targets <<<"${BENCH_TARGETS:-direct fenceproxy pgbouncer fenced}"
read -r -a proxy_extra <<<"${BENCH_PROXY_ARGS:-}"
bin=${BENCH_BIN:-bin/fenceproxy}
pg_bin=${FENCEPROXY_PG_BINDIR:-/usr/lib/postgresql/15/bin}
read -r -a workloads <<<"${BENCH_WORKLOADS:-select-only read-write}"
# Other work on the machine is the main source of noise: note how busy it was before we started.
load_start=$(cut -d' ' -f1-3 /proc/loadavg)
resource=bench
token=1

prog=bench
# shellcheck source=scripts/lib.sh
. scripts/lib.sh

for v in seconds runs clients threads scale warmup; do
	[[ ${!v} =~ ^[0-9]+$ ]] || die "BENCH_${v^^} must be a whole number, not '${!v}'"
done
((seconds > 0 && runs > 0 && clients > 0 && threads > 0 && scale > 0)) ||
	die "BENCH_SECONDS, BENCH_RUNS, BENCH_CLIENTS, BENCH_THREADS and BENCH_SCALE must be positive"
((clients % threads == 0)) || die "BENCH_CLIENTS ($clients) must be a multiple of BENCH_THREADS ($threads)"
((clients <= 80)) || die "BENCH_CLIENTS above 80 does not fit max_connections=100"
[[ $fsync == on || $fsync == off ]] || die "BENCH_FSYNC must be on or off"
case $protocol in simple | extended | prepared) ;; *) die "BENCH_PROTOCOL must be simple, extended or prepared" ;; esac
for t in "${targets[@]}"; do
	case $t in direct | fenceproxy | pgbouncer | fenced | parsed) ;;
	direct-check) [[ $protocol == simple ]] || die "target direct-check needs BENCH_PROTOCOL=simple" ;;
	*) die "unknown target '$t' in BENCH_TARGETS" ;;
	esac
done
((${#workloads[@]} > 0)) || die "BENCH_WORKLOADS is empty"
for w in "${workloads[@]}"; do
	case $w in select-only | read-write | tpcb-like) ;; *) die "unknown workload '$w' in BENCH_WORKLOADS" ;; esac
	[[ $w == tpcb-like && " ${targets[*]} " == *" direct-check "* ]] &&
		die "target direct-check has no tpcb-like script (bench/*-check.sql): leave one of them out"
done
for p in initdb postgres pg_isready psql pgbench; do
	[[ -x $pg_bin/$p ]] || die "$pg_bin/$p not found: run make deps (or set FENCEPROXY_PG_BINDIR)"
done
use_bouncer=0
[[ " ${targets[*]} " == *" pgbouncer "* ]] && use_bouncer=1
use_parsed=0
[[ " ${targets[*]} " == *" parsed "* ]] && use_parsed=1
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
# status_kb PID FIELD: a kB field of /proc/PID/status (VmHWM, VmRSS).
status_kb() { awk -v f="$2:" '$1 == f { print $2 }' "/proc/$1/status" 2>/dev/null || echo 0; }

# --- PostgreSQL --------------------------------------------------------------------------------

for p in pg_port proxy_port bouncer_port parsed_port; do free_port "$p"; done
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
	-c max_connections=100 -c shared_buffers=256MB -c max_wal_size=2GB -c checkpoint_timeout=30min
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
"$bin" migrate --database "$db_url" >"$work/migrate.log" 2>&1 ||
	die "fenceproxy migrate failed: $(cat "$work/migrate.log")"
# Fenced sessions raise their token at startup; direct-check needs it stored before it runs.
psql_direct -d bench -c "SELECT fence.raise('$resource', $token)" >/dev/null

# --- fenceproxy and pgbouncer ------------------------------------------------------------------

proxy_cmd=("$bin" serve --listen "127.0.0.1:$proxy_port" --upstream "postgres://127.0.0.1:$pg_port"
	--unfenced allow --resource "$resource" --log-level warn "${proxy_extra[@]}")
start fenceproxy "$work/fenceproxy.log" "${proxy_cmd[@]}"
proxy_ready() { alive fenceproxy "$work/fenceproxy.log" && listening "$proxy_port"; }
wait_for fenceproxy 30 proxy_ready
if ((use_parsed)); then
	start parsed "$work/parsed.log" "$bin" serve --listen "127.0.0.1:$parsed_port" \
		--upstream "postgres://127.0.0.1:$pg_port" --unfenced allow --resource "$resource" \
		--log-level warn --debug-parse-unfenced "${proxy_extra[@]}"
	parsed_ready() { alive parsed "$work/parsed.log" && listening "$parsed_port"; }
	wait_for "fenceproxy --debug-parse-unfenced" 30 parsed_ready
fi

bouncer_dir=$work/pgbouncer
pool=$((clients > 20 ? clients : 20))
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
max_client_conn = 200
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
((use_parsed)) && program[parsed]=$(readlink -f "$bin")
for name in "${!program[@]}"; do
	exe=$(readlink -f "/proc/${service_pid[$name]}/exe" 2>/dev/null || true)
	[[ $exe == "${program[$name]}" ]] ||
		die "pid ${service_pid[$name]} runs '$exe', not ${program[$name]}: cannot read its CPU and memory"
done

# --- measuring ---------------------------------------------------------------------------------

target_port() {
	case $1 in
	direct | direct-check) echo "$pg_port" ;;
	fenceproxy | fenced) echo "$proxy_port" ;;
	pgbouncer) echo "$bouncer_port" ;;
	parsed) echo "$parsed_port" ;;
	esac
}
target_options() { [[ $1 == fenced ]] && echo "-c fence.resource=$resource -c fence.token=$token" || true; }
target_pid() {
	case $1 in
	fenceproxy | fenced) echo "${service_pid[fenceproxy]}" ;;
	pgbouncer) echo "${service_pid[pgbouncer]}" ;;
	parsed) echo "${service_pid[parsed]}" ;;
	*) echo "" ;;
	esac
}
# workload_flag TARGET WORKLOAD: pgbench's built-in script, or ours with the check.
workload_flag() {
	if [[ $1 == direct-check ]]; then
		echo "-f bench/$2-check.sql -s $scale"
	else
		case $2 in
		select-only) echo -S ;;
		read-write) echo -N ;;
		tpcb-like) echo "-b tpcb-like" ;;
		esac
	fi
}

# pgbench_cmd TARGET WORKLOAD SECONDS: the pgbench command line (into the array `cmd`).
pgbench_cmd() {
	cmd=(env)
	[[ $1 == fenced ]] && cmd+=("PGOPTIONS=$(target_options "$1")")
	local flags
	read -r -a flags <<<"$(workload_flag "$1" "$2")"
	cmd+=("$pg_bin/pgbench" -n "${flags[@]}" -M "$protocol" -c "$clients" -j "$threads" -T "$3"
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

results=$work/results.tsv # workload target run tps latency_ms transactions failed cpu_ticks status pg_ticks idle_ticks busy_ticks
: >"$results"
failures=0

# run TARGET WORKLOAD RUN SECONDS: one pgbench run; RUN 0 is a warm-up (not recorded).
run() {
	local target=$1 workload=$2 n=$3 secs=$4 out pid before after rc=0 tps lat ntx failed status=ok
	local pg_before pg_after idle_before idle_after busy_before busy_after
	out=$work/pgbench-$workload-$target-$n.log
	pgbench_cmd "$target" "$workload" "$secs"
	prepare
	pid=$(target_pid "$target")
	before=0
	[[ -n $pid ]] && before=$(cpu_ticks "$pid")
	pg_before=$(pg_cpu_ticks) idle_before=$(idle_ticks) busy_before=$(busy_ticks)
	# A hang of a target must not hang the benchmark.
	timeout -k 5 $((secs + 60)) "${cmd[@]}" >"$out" 2>&1 || rc=$?
	after=0
	[[ -n $pid ]] && after=$(cpu_ticks "$pid")
	idle_after=$(idle_ticks) busy_after=$(busy_ticks)
	pg_after=$(pg_cpu_ticks)
	tps=$(sed -n 's/^tps = \([0-9.]*\) (without initial connection time)$/\1/p' "$out")
	lat=$(sed -n 's/^latency average = \([0-9.]*\) ms$/\1/p' "$out")
	ntx=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' "$out")
	failed=$(sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p' "$out")
	if ((rc == 124 || rc == 137)); then
		status="TIMEOUT"
	elif ((rc != 0)) || [[ -z $tps ]] || grep -qiE 'aborted|error' "$out"; then
		status="FAILED(rc=$rc)"
	fi
	if [[ $status != ok ]]; then
		failures=$((failures + 1))
		say "$workload $target run $n: $status; pgbench output ($out):"
		sed 's/^/    | /' "$out" | head -n 40
		say "  command: $(printf '%q ' "${cmd[@]}")"
	fi
	((n == 0)) && return 0
	printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$workload" "$target" "$n" "${tps:-0}" "${lat:-0}" \
		"${ntx:-0}" "${failed:-0}" "$((after - before))" "$status" "$((pg_after - pg_before))" \
		"$((idle_after - idle_before))" "$((busy_after - busy_before))" >>"$results"
	printf 'bench: round %d  %-11s %-12s %10.0f tps  %7.3f ms  %s\n' "$n" "$workload" "$target" \
		"${tps:-0}" "${lat:-0}" "$status"
}

repro="BENCH_SECONDS=$seconds BENCH_RUNS=$runs BENCH_CLIENTS=$clients BENCH_THREADS=$threads BENCH_SCALE=$scale BENCH_PROTOCOL=$protocol BENCH_WORKLOADS='${workloads[*]}' BENCH_WARMUP=$warmup BENCH_FSYNC=$fsync BENCH_TARGETS='${targets[*]}'"
[[ ${#proxy_extra[@]} -gt 0 ]] && repro+=" BENCH_PROXY_ARGS='${proxy_extra[*]}'"
[[ -n ${BENCH_BIN:-} ]] && repro+=" BENCH_BIN=$BENCH_BIN"
repro+=" bash bench/bench.sh"

say "fenceproxy: $(printf '%q ' "${proxy_cmd[@]}")"
((use_bouncer)) && say "pgbouncer:  $(pgbouncer --version | head -n1), session mode, pool $pool, 127.0.0.1:$bouncer_port"
say "pgbench, one line per target (read-write shown; select-only uses -S instead of -N):"
for t in "${targets[@]}"; do
	pgbench_cmd "$t" read-write "$seconds"
	say "  $(printf '%-12s' "$t") $(printf '%q ' "${cmd[@]}")"
done

started=$SECONDS
if ((warmup > 0)); then
	say "warm-up: ${warmup}s per target and workload (not recorded)"
	for w in "${workloads[@]}"; do for t in "${targets[@]}"; do run "$t" "$w" 0 "$warmup"; done; done
fi
say "measuring: $runs round(s) x ${#workloads[@]} workloads x ${#targets[@]} targets x ${seconds}s"
# Odd rounds run the targets in the listed order, even rounds in reverse (A B, B A, ...): no
# target always runs first or right after another one.
reversed=()
for ((i = ${#targets[@]} - 1; i >= 0; i--)); do reversed+=("${targets[i]}"); done
for ((r = 1; r <= runs; r++)); do
	order=("${targets[@]}")
	((r % 2 == 0)) && order=("${reversed[@]}")
	for w in "${workloads[@]}"; do for t in "${order[@]}"; do run "$t" "$w" "$r" "$seconds"; done; done
done
measured=$((SECONDS - started))
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

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

commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
[[ -n $(git status --porcelain 2>/dev/null | head -n1) ]] && commit+=" (with uncommitted changes)"
cpu_model=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n1)

echo
echo "==================================================================================="
echo "fenceproxy benchmark  $(date -u +%Y-%m-%dT%H:%M:%SZ)  commit $commit"
echo "machine: $(nproc) CPU(s), ${cpu_model:-unknown CPU}, Linux $(uname -r)"
echo "PostgreSQL $("$pg_bin/postgres" --version | awk '{ print $3 }'), fsync=$fsync, max_connections=100," \
	"shared_buffers=256MB;$( ((use_bouncer)) && echo " $(pgbouncer --version | head -n1) session mode;") pgbench -M $protocol" \
	"-c $clients -j $threads -T $seconds, scale $scale, $runs run(s) per cell, interleaved"
echo "targets over TCP 127.0.0.1; fenced = the proxy with PGOPTIONS='$(target_options fenced)'"
echo "reproduce (from the repository root): $repro"
echo

awk -F'\t' -v order="${targets[*]}" -v hz="$clk_tck" -v wl="${workloads[*]}" -v runs_n="$runs" '
function median(list,   a, n, i, j, t) {
	n = split(list, a, " ")
	for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] + 0 > t + 0; j--) a[j + 1] = a[j]; a[j + 1] = t }
	if (n == 0) return 0
	return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
}
{
	k = $1 SUBSEP $2
	if ($9 == "ok") {
		tps[k] = tps[k] " " $4; lat[k] = lat[k] " " $5; round[k, $3] = $4 + 0
		if ($6 > 0) {
			per = 1e6 / hz / $6
			busy_us[k] = busy_us[k] " " $12 * per; pg_us[k] = pg_us[k] " " $10 * per
			mid_us[k] = mid_us[k] " " $8 * per; idle_us[k] = idle_us[k] " " $11 * per
			rest_us[k] = rest_us[k] " " ($12 - $10 - $8) * per
		}
		if (!(k in lo) || $4 + 0 < lo[k]) lo[k] = $4 + 0
		if (!(k in hi) || $4 + 0 > hi[k]) hi[k] = $4 + 0
	}
	else bad[k]++
	runs[k] = runs[k] sprintf(" %7.0f%s", $4, $9 == "ok" ? "" : "!")
	ntx[k] += $6; nfail[k] += $7; ticks[k] += $8
}
END {
	nt = split(order, T, " "); nw = split(wl, W, " ")
	printf "%-11s %-12s %10s %11s %9s %7s   %s\n", "workload", "target", "median TPS", "latency ms", "CPU us/tx", "max/min", "individual runs (TPS)"
	for (w = 1; w <= nw; w++) for (t = 1; t <= nt; t++) {
		k = W[w] SUBSEP T[t]
		if (!(k in runs)) continue
		m[k] = median(tps[k])
		cpu = (T[t] ~ /^direct/ || ntx[k] == 0) ? "-" : sprintf("%.1f", ticks[k] / hz * 1e6 / ntx[k])
		spread = (lo[k] > 0) ? hi[k] / lo[k] : 0
		if (spread > 1.3) noisy++
		printf "%-11s %-12s %10.0f %11.3f %9s %7.2f  %s%s\n", W[w], T[t], m[k], median(lat[k]), cpu, spread, runs[k],
			(bad[k] ? sprintf("  (%d failed run(s), marked !)", bad[k]) : "") (nfail[k] ? sprintf("  (%d failed transactions)", nfail[k]) : "")
	}
	print ""
	print "latency ms: median of the runs\x27 average latency; CPU us/tx: CPU time of the proxy or pgbouncer process"
	print "during the runs, per transaction (includes the proxy\x27s background work, if any);"
	print "max/min: fastest run over slowest run of the cell"
	if (noisy) printf "WARNING: in %d cell(s) the runs differ by more than 30%%: the machine was busy (see the load\naverage below); rerun on a quiet machine, or with more BENCH_RUNS, before trusting the ratios\n", noisy
	print ""
	print "CPU time per transaction, us (median of the runs): the machine\x27s busy time split into PostgreSQL"
	print "(postmaster and all its processes), the middleman (proxy or pgbouncer) and the rest (pgbench,"
	print "the kernel\x27s own threads, anything else running); idle: time no CPU had work"
	printf "%-11s %-12s %9s %11s %10s %9s %9s\n", "workload", "target", "busy", "PostgreSQL", "middleman", "rest", "idle"
	for (w = 1; w <= nw; w++) for (t = 1; t <= nt; t++) {
		k = W[w] SUBSEP T[t]
		if (!(k in busy_us)) continue
		printf "%-11s %-12s %9.1f %11.1f %10s %9.1f %9.1f\n", W[w], T[t], median(busy_us[k]), median(pg_us[k]),
			(T[t] ~ /^direct/) ? "-" : sprintf("%.1f", median(mid_us[k])), median(rest_us[k]), median(idle_us[k])
	}
	print ""
	printf "%-34s", "ratio of median TPS"
	for (w = 1; w <= nw; w++) printf " %12s", W[w]
	print ""
	nr = split("fenceproxy/direct pgbouncer/direct fenceproxy/pgbouncer fenced/fenceproxy direct-check/direct parsed/fenceproxy fenced/parsed", R, " ")
	label["fenced/fenceproxy"] = "fenced/unfenced (both via proxy)"
	label["direct-check/direct"] = "direct-check/direct (check in DB)"
	label["parsed/fenceproxy"] = "parsed/unfenced (the parse alone)"
	label["fenced/parsed"] = "fenced/parsed (the check on top)"
	for (r = 1; r <= nr; r++) {
		split(R[r], ab, "/")
		# only the ratios whose two targets ran
		if (!(W[1] SUBSEP ab[1] in runs) || !(W[1] SUBSEP ab[2] in runs)) continue
		shown++
		printf "%-34s", (R[r] in label) ? label[R[r]] : R[r]
		for (w = 1; w <= nw; w++) {
			a = W[w] SUBSEP ab[1]; b = W[w] SUBSEP ab[2]
			if (m[a] > 0 && m[b] > 0) printf " %12.3f", m[a] / m[b]; else printf " %12s", "n/a"
		}
		print ""
	}
	if (!shown) { print "(none: BENCH_TARGETS has no pair of targets that these ratios compare)"; exit }
	# The same ratios taken round by round: the two runs of a round are minutes apart at most, so
	# a slow drift of the machine (other tenants) cancels out of each ratio.
	print ""
	printf "%-34s", "median of per-round ratios"
	for (w = 1; w <= nw; w++) printf " %19s", W[w] " (min-max)"
	print ""
	for (r = 1; r <= nr; r++) {
		split(R[r], ab, "/")
		if (!(W[1] SUBSEP ab[1] in runs) || !(W[1] SUBSEP ab[2] in runs)) continue
		printf "%-34s", (R[r] in label) ? label[R[r]] : R[r]
		for (w = 1; w <= nw; w++) {
			list = ""; lo_r = 0; hi_r = 0
			for (i = 1; i <= runs_n; i++) {
				a = W[w] SUBSEP ab[1]; b = W[w] SUBSEP ab[2]
				if (!((a, i) in round) || !((b, i) in round) || round[b, i] <= 0) continue
				q = round[a, i] / round[b, i]; list = list " " q
				if (lo_r == 0 || q < lo_r) lo_r = q
				if (q > hi_r) hi_r = q
			}
			if (list == "") printf " %19s", "n/a"; else printf " %7.3f (%.2f-%.2f)", median(list), lo_r, hi_r
		}
		print ""
	}
}' "$results"

echo
printf 'fenceproxy: peak RSS (VmHWM) %.1f MiB, RSS at end %.1f MiB, %s threads, CPU time %.1f s (user+sys, whole run)\n' \
	"$(echo "$proxy_hwm / 1024" | bc -l)" "$(echo "$proxy_rss / 1024" | bc -l)" "$proxy_threads" "$(echo "$proxy_cpu / $clk_tck" | bc -l)"
if ((use_bouncer)); then
	printf 'pgbouncer:  peak RSS (VmHWM) %.1f MiB, CPU time %.1f s\n' \
		"$(echo "$bouncer_hwm / 1024" | bc -l)" "$(echo "$bouncer_cpu / $clk_tck" | bc -l)"
fi
problems=$(grep -ciE '"level":"(warn|error|dpanic|panic|fatal)"|\b(WARN|ERROR|PANIC|FATAL)\b' "$work/fenceproxy.log" || true)
echo "fenceproxy log: $problems line(s) at warn or above$([[ $problems -gt 0 ]] && echo ', first ones:')"
if [[ $problems -gt 0 ]]; then head -n 10 "$work/fenceproxy.log" | cut -c1-300 | sed 's/^/    | /'; fi
echo "load average (1, 5, 15 min) when the script started: $load_start; at the end: $load_after" \
	"($(nproc) CPU(s); the benchmark itself keeps about $((clients + threads)) tasks busy)"
echo "measured in ${measured}s (warm-up included); whole run $((SECONDS))s"
echo "reproduce (from the repository root): $repro"
echo "==================================================================================="
if ((failures > 0)); then
	say "$failures pgbench run(s) failed: see the output above"
	exit 1
fi
