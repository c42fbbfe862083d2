#!/usr/bin/env bash
# Every fence.<name> the model names (model/fence.pml) must be a function or table of the current
# schema (migrations/functions/, migrations/baseline.sql): a rename in one shows in the other.
set -euo pipefail
cd "$(dirname "$0")/.."
model=model/fence.pml
names=$(grep -o 'fence\.[a-z_][a-z0-9_]*' "$model" | sort -u)
[ -n "$names" ] || { echo "model-names: no fence.<name> in $model" >&2; exit 1; }
bad=0
for n in $names; do
	# a function has its own file; a table is created by the baseline
	[ -f "migrations/functions/$n.sql" ] && continue
	grep -Eqi "^[[:space:]]*CREATE( UNLOGGED)? TABLE( IF NOT EXISTS)? ${n//./\\.}([[:space:](]|$)" migrations/baseline.sql && continue
	echo "model-names: $n is named in $model but is neither a function of migrations/functions/ nor a table of migrations/baseline.sql" >&2
	bad=1
done
[ $bad = 0 ] || exit 1
echo "model-names: $(echo "$names" | wc -l) names of $model exist in the current schema"
