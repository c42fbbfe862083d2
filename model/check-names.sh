#!/usr/bin/env bash
# Every fence.<name> the model names (model/fence.pml) must be a function or table that the Up
# sections of migrations/ create and do not drop later: a rename in one shows in the other.
set -euo pipefail
cd "$(dirname "$0")/.."
model=model/fence.pml
names=$(grep -o 'fence\.[a-z_][a-z0-9_]*' "$model" | sort -u)
[ -n "$names" ] || { echo "model-names: no fence.<name> in $model" >&2; exit 1; }
# The Up sections, in migration order.
up=$(for f in migrations/[0-9]*.sql; do
	awk '/^-- \+goose Up/ {up=1; next} /^-- \+goose Down/ {up=0} up' "$f"
done)
bad=0
for n in $names; do
	re="${n//./\\.}"
	# the last line of the Up sections that creates or drops it
	last=$(printf '%s\n' "$up" | grep -Ei "^[[:space:]]*(CREATE( OR REPLACE)?( UNLOGGED)? (FUNCTION|TABLE)( IF NOT EXISTS)?|DROP (FUNCTION|TABLE)( IF EXISTS)?) $re([[:space:](]|$)" | tail -1 || true)
	case "$last" in
	'') echo "model-names: $n is named in $model but no migration creates it" >&2; bad=1 ;;
	*DROP*|*drop*) echo "model-names: $n is named in $model but a migration drops it" >&2; bad=1 ;;
	esac
done
[ $bad = 0 ] || exit 1
echo "model-names: $(echo "$names" | wc -l) names of $model exist in migrations/"
