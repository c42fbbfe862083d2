#!/usr/bin/env bash
# What the commit-time check costs PostgreSQL, in instructions: a diagnostic behind the numbers in
# docs/BENCHMARKS.md ("What the check costs the database"). A benchmark, not a test.
#
# Throughput on the project's shared 2-core machines moves by 10-20% from one run to the next,
# more than the check costs. Instruction counts do not: this script runs PostgreSQL 15 under
# valgrind's callgrind and counts the instructions that the backend of one pgbench session
# executes per transaction, which repeats to within a fraction of a percent whatever else the
# machine does. It starts a throwaway cluster (as the `postgres` OS user when run as root) and
# fenceproxy on private ports, installs the fence schema, and runs pgbench's read-write script
# without branch updates (-N, one client, CHECK_TX transactions) through the proxy, for each
# protocol (simple, prepared) and each variant:
#
#   unfenced   a session without a token: no check
#   floor      fenced, fence.check replaced by a SQL function that does nothing: what any
#              statement the proxy adds at a commit costs (Bind/Execute or EXECUTE, portal,
#              executor start, a row back)
#   plpgsql    fenced, fence.check replaced by a PL/pgSQL function with the xid test only: what
#              the PL/pgSQL call itself costs
#   v2         fenced, fence.check as migration 2 left it (PL/pgSQL: resource-name regex,
#              current_setting, advisory lock, SELECT of the token row through SPI)
#   shipped    fenced, fence.check as the migrations leave it (migration 3)
#
# and, on request (CHECK_VARIANTS), parts of the shipped check's body, each as the inlined SQL
# function in place of fence.check:
#
#   xidonly    the first test alone (no transaction id assigned: nothing to check)
#   seqonly    the sequence read alone, the sequence named by a regclass constant
#   regconst   the shipped body with the sequence named by a regclass constant instead of
#              to_regclass() of 'fence_token.' || quote_ident(resource) (the resource is bench)
#
# and, on request, one run without the proxy:
#
#   bare       (simple protocol) pgbench's -N script straight against PostgreSQL, its END's Query
#              message carrying an empty SELECT as well (`SELECT \; END;`): what PostgreSQL charges
#              for the cheapest statement there is, against the same script without it (printed
#              as the row `direct`, the baseline of this variant)
#
# and prints instructions per transaction, and the difference from unfenced. Per transaction
# means marginal: each variant runs twice, CHECK_TX/4 and CHECK_TX/4 + CHECK_TX transactions, and
# the difference is divided by CHECK_TX, so that what a session costs once (connection, the raise
# of its token, the PREPARE of the check) is left out.
# Settings: CHECK_TX (2000 transactions); CHECK_PROTOCOLS ("simple prepared"); CHECK_VARIANTS
# ("floor plpgsql v2 shipped", from the lists above); CHECK_KEEP=1 keeps the temporary folder
# with each run's callgrind file (<protocol>-<variant>-<transactions>.callgrind), for
# `callgrind_annotate --inclusive=yes FILE` to show where the instructions go (compare the two
# runs of a variant for per-transaction figures).
# Needs valgrind (apt-get install valgrind).
set -euo pipefail
cd "$(dirname "$0")/.."
ntx=${CHECK_TX:-2000}
bin=${FENCEPROXY_PG_BINDIR:-/usr/lib/postgresql/15/bin}
command -v valgrind >/dev/null || { echo "check-cost: needs valgrind (apt-get install valgrind)" >&2; exit 1; }
go build -o bin/fenceproxy ./cmd/fenceproxy

work=$(mktemp -d "${TMPDIR:-/tmp}/fenceproxy-cost.XXXXXX")
as_pg=()
if [[ $(id -u) == 0 ]]; then chown postgres "$work"; as_pg=(runuser -u postgres --); fi
"${as_pg[@]}" mkdir "$work/cg"
port=$((20000 + RANDOM % 6000)); proxy_port=$((port + 6000))
"${as_pg[@]}" "$bin/initdb" -D "$work/data" -U postgres -A trust >/dev/null
opts=(-c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c autovacuum=off)
proxy=
cleanup() {
	[[ -n $proxy ]] && kill "$proxy" 2>/dev/null
	"${as_pg[@]}" "$bin/pg_ctl" -D "$work/data" -w stop -m immediate >/dev/null 2>&1 || true
	if [[ ${CHECK_KEEP:-0} == 1 ]]; then echo "check-cost: kept $work" >&2; return; fi
	# Processes under valgrind write their callgrind files as they exit, after the postmaster.
	sleep 1
	rm -rf "$work" 2>/dev/null || { sleep 3; rm -rf "$work"; }
}
trap cleanup EXIT
export PGHOST=127.0.0.1 PGUSER=postgres
# Load the data without valgrind (it would take minutes under it), then restart under callgrind.
# autovacuum off: its workers would be traced too, and nothing here needs them.
"${as_pg[@]}" "$bin/pg_ctl" -D "$work/data" -l "$work/setup.log" -w -o "-p $port -k $work ${opts[*]}" start >/dev/null
PGPORT=$port "$bin/pgbench" -i -s 10 -q postgres 2>/dev/null
bin/fenceproxy migrate --database "postgres://postgres@127.0.0.1:$port/postgres?sslmode=disable" >/dev/null
PGPORT=$port "$bin/psql" -X -q -c "SELECT fence.raise('bench', 1)" -c CHECKPOINT postgres >/dev/null
"${as_pg[@]}" "$bin/pg_ctl" -D "$work/data" -w stop >/dev/null
"${as_pg[@]}" valgrind --tool=callgrind --callgrind-out-file="$work/cg/%p" \
	"$bin/postgres" -D "$work/data" -p "$port" -k "$work" "${opts[@]}" >"$work/server.log" 2>&1 &
for _ in $(seq 120); do PGPORT=$port "$bin/psql" -X -c 'SELECT 1' postgres >/dev/null 2>&1 && break; sleep 0.5; done
bin/fenceproxy serve --listen "127.0.0.1:$proxy_port" --upstream "postgres://127.0.0.1:$port" --resource bench \
	--unfenced allow --log-level warn 2>"$work/proxy.log" &
proxy=$!
psql_() { PGPORT=$port "$bin/psql" -X -q -v ON_ERROR_STOP=1 postgres "$@"; }

shipped=$(psql_ -At -c "SELECT pg_get_functiondef('fence.check(text,bigint)'::regprocedure)")
# Migration 2's fence.check: its first StatementBegin ... StatementEnd block.
v2=$(awk '/-- \+goose StatementBegin/ { n++; next } /-- \+goose StatementEnd/ { if (n == 1) exit } n == 1' \
	migrations/00002_hot_path_check.sql)
plpgsql='CREATE OR REPLACE FUNCTION fence.check(resource text, token bigint) RETURNS void LANGUAGE plpgsql VOLATILE SECURITY DEFINER
  AS $fn$BEGIN IF pg_catalog.pg_current_xact_id_if_assigned() IS NULL THEN RETURN; END IF; END$fn$'

# instructions of the busiest backend of one pgbench run of $4 transactions through the proxy
instructions() { # protocol variant pgoptions transactions [port script]
	"${as_pg[@]}" find "$work/cg" -type f -delete
	local script=(-N)
	[[ -n ${6:-} ]] && script=(-f "$6")
	PGPORT=${5:-$proxy_port} PGOPTIONS="$3" "$bin/pgbench" -n "${script[@]}" -c 1 -t "$4" -M "$1" postgres \
		>"$work/pgbench.out" 2>&1 ||
		{ cat "$work/pgbench.out" >&2; exit 1; }
	sleep 1 # the backend writes its file when it exits
	local best=0 bestf= n f
	for f in "$work"/cg/*; do
		n=$(awk '/^(summary|totals):/ { print $2; exit }' "$f")
		((${n:-0} > best)) && best=$n bestf=$f
	done
	[[ ${CHECK_KEEP:-0} == 1 && -n $bestf ]] && cp "$bestf" "$work/$1-$2-$4.callgrind"
	echo "$best"
}
# instructions per transaction, marginal (see the top of this file)
count() { # protocol variant pgoptions [port script]
	local short=$((ntx / 4 > 0 ? ntx / 4 : 1)) a b
	a=$(instructions "$1" "$2" "$3" "$short" "${@:4}")
	b=$(instructions "$1" "$2" "$3" $((short + ntx)) "${@:4}")
	echo $(((b - a) / ntx))
}
# body SQL: fence.check as an inlinable SQL function with that body
body() {
	psql_ -c "CREATE OR REPLACE FUNCTION fence.check(resource text, token bigint) RETURNS void LANGUAGE sql
  VOLATILE AS \$fn\$$1\$fn\$" >/dev/null
}
no_xid='pg_catalog.pg_current_xact_id_if_assigned() IS NULL'
seq_const="pg_catalog.pg_sequence_last_value('fence_token.bench'::pg_catalog.regclass)"
within='token OPERATOR(pg_catalog.>) 0::bigint AND pg_catalog.octet_length(resource) OPERATOR(pg_catalog.<) 64'
fenced="-c fence.resource=bench -c fence.token=1"
printf '%-9s %-9s %12s %10s %8s\n' protocol variant "instr/tx" "+instr" "+%"
for protocol in ${CHECK_PROTOCOLS:-simple prepared}; do
	base=$(count "$protocol" unfenced "")
	printf '%-9s %-9s %12d\n' "$protocol" unfenced "$base"
	for v in ${CHECK_VARIANTS:-floor plpgsql v2 shipped}; do
		if [[ $v == bare ]]; then
			[[ $protocol == simple ]] || continue
			# pgbench's -N script as `pgbench --show-script simple-update` prints it.
			"$bin/pgbench" --show-script simple-update 2>&1 | grep -v '^-- ' >"$work/direct.sql"
			sed 's/^END;$/SELECT \\; END;/' "$work/direct.sql" >"$work/bare.sql"
			grep -q '^SELECT \\; END;$' "$work/bare.sql" || { echo "check-cost: cannot build the bare script" >&2; exit 1; }
			direct=$(count "$protocol" direct "" "$port" "$work/direct.sql")
			printf '%-9s %-9s %12d\n' "$protocol" direct "$direct"
			n=$(count "$protocol" bare "" "$port" "$work/bare.sql")
			printf '%-9s %-9s %12d %10d %7.1f%%\n' "$protocol" bare "$n" $((n - direct)) "$(echo "100 * ($n - $direct) / $direct" | bc -l)"
			continue
		fi
		case $v in
		floor) body 'SELECT NULL::void' ;;
		plpgsql) psql_ -c "$plpgsql" >/dev/null ;;
		v2) psql_ -c "$v2" >/dev/null ;;
		shipped) psql_ -c "$shipped" >/dev/null ;;
		xidonly) body "SELECT CASE WHEN $no_xid THEN NULL::void ELSE NULL::void END" ;;
		seqonly) body "SELECT CASE WHEN ($seq_const OPERATOR(pg_catalog.<=) token) IS TRUE THEN NULL::void ELSE NULL::void END" ;;
		regconst) body "SELECT CASE WHEN $no_xid THEN NULL WHEN $within AND ($seq_const OPERATOR(pg_catalog.<=) token) IS TRUE
  THEN NULL ELSE fence.reject(resource, token) END" ;;
		*) echo "check-cost: unknown variant $v" >&2; exit 2 ;;
		esac
		n=$(count "$protocol" "$v" "$fenced")
		printf '%-9s %-9s %12d %10d %7.1f%%\n' "$protocol" "$v" "$n" $((n - base)) "$(echo "100 * ($n - $base) / $base" | bc -l)"
	done
done
echo "reproduce: CHECK_TX=$ntx CHECK_PROTOCOLS='${CHECK_PROTOCOLS:-simple prepared}'" \
	"CHECK_VARIANTS='${CHECK_VARIANTS:-floor plpgsql v2 shipped}' bash bench/check-cost.sh"
