#!/usr/bin/env bash
# Where a fenced session start's CPU goes in PostgreSQL: each probe below runs in N brand-new
# backends (pgbench -n -C -c 1 -t N, one connection per transaction), and the CPU of those
# backends is the postmaster's cutime + cstime (/proc/PID/stat) after minus before, divided by
# N. Rounds interleave the probes (in order, then reversed) so that the machine's drift spreads
# over all of them; it prints each probe's median and its rounds. CPU time per backend is a
# steadier measure than wall time on a shared machine. docs/BENCHMARKS.md (Session start)
# quotes a run.
#
# Usage: scripts/bind-cpu.sh DATABASE_URL [N] [ROUNDS]
# Run it on the database's host, as a user who may read the postmaster's /proc entry, against a
# throwaway database where `fenceproxy migrate` installed the fence schema with a key, as the
# schema's owner or a superuser (the probes call fence.proof). The bind probe binds its backends
# to resource bindcost, token 1 (its first run raises the token to 1).
set -euo pipefail

url=${1:?usage: scripts/bind-cpu.sh DATABASE_URL [N] [ROUNDS]}
n=${2:-300}
rounds=${3:-3}

dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

probe() { printf '%s\n' "$2" >"$dir/$1.sql"; names+=("$1"); }
names=()
probe select1 'SELECT 1;'
probe transaction 'BEGIN ISOLATION LEVEL READ COMMITTED READ WRITE \; SET LOCAL statement_timeout = 0 \; SET LOCAL lock_timeout = 0 \; COMMIT;'
probe plpgsql 'DO $$BEGIN END$$;'
probe activity 'SELECT backend_start FROM pg_stat_get_activity(pg_backend_pid());'
probe proof "SELECT fence.proof('bind', 'bindcost', 1, pg_backend_pid());"
probe tables 'SELECT (SELECT count(*) FROM fence.tokens), (SELECT count(*) FROM fence.bindings), (SELECT count(*) FROM fence.leases), (SELECT count(*) FROM fence.keys);'
probe bind "BEGIN ISOLATION LEVEL READ COMMITTED READ WRITE \\; SET LOCAL statement_timeout = 0 \\; SET LOCAL lock_timeout = 0 \\; SELECT fence.bind('bindcost', 1, fence.proof('bind', 'bindcost', 1, pg_backend_pid())) \\; COMMIT;"

datadir=$(psql "$url" -XAtc 'SHOW data_directory')
pm=$(head -1 "$datadir/postmaster.pid")
tick=$(getconf CLK_TCK)
children() { awk '{print $16 + $17}' "/proc/$pm/stat"; } # cutime + cstime: the exited backends

# The first bind raises the token (not what is measured).
pgbench -n -C -c 1 -t 1 -f "$dir/bind.sql" "$url" >/dev/null

declare -A cpu
for ((r = 1; r <= rounds; r++)); do
	order=("${names[@]}")
	if ((r % 2 == 0)); then
		for ((i = 0, j = ${#order[@]} - 1; i < j; i++, j--)); do
			t=${order[i]} order[i]=${order[j]} order[j]=$t
		done
	fi
	for p in "${order[@]}"; do
		before=$(children)
		pgbench -n -C -c 1 -t "$n" -f "$dir/$p.sql" "$url" >"$dir/$p.out" 2>&1 || {
			cat "$dir/$p.out" >&2
			exit 1
		}
		after=$(children)
		cpu[$p]+=" $(awk -v a="$before" -v b="$after" -v t="$tick" -v n="$n" 'BEGIN { printf "%.2f", (b - a) * 1000 / t / n }')"
	done
done

printf '%-12s %8s   %s\n' probe 'median' "CPU ms per backend, rounds (N=$n)"
for p in "${names[@]}"; do
	median=$(tr ' ' '\n' <<<"${cpu[$p]}" | sed '/^$/d' | sort -n | awk '{v[NR] = $1} END { printf "%.2f", (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }')
	printf '%-12s %8s  %s\n' "$p" "$median" "${cpu[$p]}"
done
