#!/usr/bin/env bash
# What the commit-time check costs, and which part of it: a diagnostic behind the numbers in
# docs/BENCHMARKS.md ("Where the cost goes"). A benchmark, not a test.
#
# It starts a throwaway PostgreSQL 15 (as the `postgres` OS user when run as root) and
# fenceproxy on private ports, installs the fence schema, and runs pgbench's read-write script
# without branch updates (-N, 8 clients) in interleaved rounds:
#
#   PostgreSQL alone, the check added before END in the script itself:
#     none      no check
#     set-share version 1's check: SET search_path clause, FOR SHARE on the token row
#     share     no SET clause, FOR SHARE
#     shipped   the shipped fence.check (no SET clause, shared advisory lock)
#     empty     a PL/pgSQL function with the xid test only
#   Through fenceproxy, sessions unfenced and fenced (fence.check replaced by the variant):
#     proxy-unfenced, proxy-share, proxy-shipped, proxy-empty
#
# and prints each run and the median TPS of each variant with its ratio to its baseline.
# Settings: CHECK_SECONDS (6), CHECK_ROUNDS (4).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${CHECK_SECONDS:-6}
rounds=${CHECK_ROUNDS:-4}
bin=${FENCEPROXY_PG_BINDIR:-/usr/lib/postgresql/15/bin}
[[ -x bin/fenceproxy ]] || go build -o bin/fenceproxy ./cmd/fenceproxy

work=$(mktemp -d "${TMPDIR:-/tmp}/fenceproxy-check.XXXXXX")
as_pg=()
if [[ $(id -u) == 0 ]]; then chown postgres "$work"; as_pg=(runuser -u postgres --); fi
port=$((20000 + RANDOM % 6000)); proxy_port=$((port + 6000))
"${as_pg[@]}" "$bin/initdb" -D "$work/data" -U postgres -A trust >/dev/null
"${as_pg[@]}" "$bin/pg_ctl" -D "$work/data" -l "$work/log" -w -o "-p $port -k $work -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c shared_buffers=256MB" start >/dev/null
bin/fenceproxy serve --listen "127.0.0.1:$proxy_port" --upstream "postgres://127.0.0.1:$port" --resource bench --unfenced allow --log-level warn 2>"$work/proxy.log" &
proxy=$!
trap 'kill $proxy 2>/dev/null; "${as_pg[@]}" "$bin/pg_ctl" -D "$work/data" stop -m immediate >/dev/null; rm -rf "$work"' EXIT
export PGHOST=127.0.0.1 PGUSER=postgres
PGPORT=$port "$bin/pgbench" -i -s 10 -q postgres 2>/dev/null
bin/fenceproxy migrate --database "postgres://postgres@127.0.0.1:$port/postgres?sslmode=disable" >/dev/null
psql_() { PGPORT=$port "$bin/psql" -X -q -v ON_ERROR_STOP=1 postgres "$@"; }
psql_ -c "SELECT fence.raise('bench', 1)" >/dev/null
# The shipped check, kept to restore it between proxy variants.
shipped=$(psql_ -At -c "SELECT pg_get_functiondef('fence.check(text,bigint)'::regprocedure)")
body_share='DECLARE stored bigint; BEGIN IF pg_catalog.pg_current_xact_id_if_assigned() IS NULL THEN RETURN; END IF;
  SELECT t.token INTO stored FROM fence.tokens t WHERE t.resource OPERATOR(pg_catalog.=) $1 FOR SHARE;
  IF stored OPERATOR(pg_catalog.>) $2 THEN RAISE EXCEPTION '"'stale'"' USING ERRCODE = '"'ZF001'"'; END IF; END'
body_empty='BEGIN IF pg_catalog.pg_current_xact_id_if_assigned() IS NULL THEN RETURN; END IF; END'
define() { # name body [SET clause]
	psql_ -c "CREATE OR REPLACE FUNCTION fence.$1(resource text, token bigint) RETURNS void LANGUAGE plpgsql VOLATILE SECURITY DEFINER ${3:-} AS \$fn\$$2\$fn\$"
}
define v_set_share "$body_share" "SET search_path = pg_catalog, pg_temp"
define v_share "$body_share"
define v_empty "$body_empty"

# The variants of bench/read-write-check.sql (pgbench's -N script with the check before END).
script() { # file function ("" for no check)
	if [[ -z $2 ]]; then
		sed 's/^SELECT fence\.check(.*\\; END;$/END;/' bench/read-write-check.sql >"$work/$1.sql"
	else
		sed "s/fence\.check(/fence.$2(/" bench/read-write-check.sql >"$work/$1.sql"
	fi
}
script none ""
script set-share v_set_share
script share v_share
script shipped check
script empty v_empty

tps() { awk '/^tps/ { printf "%d", $3 }'; }
direct() { PGPORT=$port "$bin/pgbench" -n -c 8 -j 2 -T "$seconds" -f "$work/$1.sql" postgres 2>&1 | tps; }
proxied() { # options
	PGPORT=$proxy_port PGOPTIONS="$1" "$bin/pgbench" -n -N -c 8 -j 2 -T "$seconds" postgres 2>&1 | tps
}
as_check() { # body-or-empty: replace fence.check for the proxy variants
	if [[ -z $1 ]]; then psql_ -c "$shipped" >/dev/null; else
		psql_ -c "CREATE OR REPLACE FUNCTION fence.check(resource text, token bigint) RETURNS void LANGUAGE plpgsql VOLATILE SECURITY DEFINER AS \$fn\$$1\$fn\$" >/dev/null; fi
}
fenced="-c fence.resource=bench -c fence.token=1"
declare -A runs=()
for r in $(seq "$rounds"); do
	for v in none set-share share shipped empty; do runs[$v]+=" $(direct "$v")"; done
	runs[proxy-unfenced]+=" $(proxied '')"
	as_check "$body_share"; runs[proxy-share]+=" $(proxied "$fenced")"
	as_check ""; runs[proxy-shipped]+=" $(proxied "$fenced")"
	as_check "$body_empty"; runs[proxy-empty]+=" $(proxied "$fenced")"
	as_check ""
	echo "check-variants: round $r done" >&2
done
median() { tr ' ' '\n' | grep . | sort -n | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
printf '%-15s %10s %8s   %s\n' variant "median TPS" ratio runs
for v in none set-share share shipped empty proxy-unfenced proxy-share proxy-shipped proxy-empty; do
	base=none; [[ $v == proxy-* ]] && base=proxy-unfenced
	m=$(median <<<"${runs[$v]}"); b=$(median <<<"${runs[$base]}")
	printf '%-15s %10s %8.3f  %s\n' "$v" "$m" "$(echo "$m / $b" | bc -l)" "${runs[$v]}"
done
echo "reproduce: CHECK_SECONDS=$seconds CHECK_ROUNDS=$rounds bash bench/check-variants.sh"
