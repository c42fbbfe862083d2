#!/bin/sh
# libpq through fenceproxy: psql, one cell of TestTransparencyMatrix (the
# cell's settings, report and stale token's handshake are fencecell.py's).
# The token in PGOPTIONS; psql_client.sql runs the checks; this script is
# also its helper for what psql's \! runs (first argument). Run in a folder of
# its own (files are written there); PSQL names psql.
set -u
PSQL_CLIENT=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
export PSQL_CLIENT

# opts token session: the startup options that carry a token.
opts() {
	[ -n "$1" ] || return 0
	printf -- '-c fence.resource=%s -c fence.token=%s' "$FENCE_RESOURCE" "$1"
	[ -z "$2" ] || printf -- ' -c fence.session=%s' "$2"
}

report() { # check condition-status detail
	if [ "$2" = 0 ]; then echo "ok $1"; else echo "FAIL $1: $3"; fi
}

case "${1:-main}" in
main)
	PGOPTIONS=$(opts "${FENCE_TOKEN:-}" "${FENCE_SESSION:-}")
	export PGOPTIONS
	fenced=0
	[ -z "${FENCE_TOKEN:-}" ] || fenced=1
	# psql's SIGINT handler sends the CancelRequest, and a script stops after it: the
	# cancel runs in a psql of its own, before the stale token ends the cell's token.
	"$PSQL" -X -q -f "${PSQL_CLIENT%_client.sh}_cancel.sql" 2>cancel.err
	grep -q 57014 cancel.err
	report cancel $? "$(tr '\n' ' ' <cancel.err)"
	"$PSQL" -X -q -v FENCED=$fenced -v CHANNEL="$NOTIFY_CHANNEL" -f "${PSQL_CLIENT%.sh}.sql"
	;;
copy-out)
	[ "$(wc -l <"$2")" -eq 999 ] && [ "$(head -3 "$2" | tr '\t\n' ':,')" = "1:kept,3:kept,4:copied," ]
	report "copy out" $? "$(head -3 "$2" | tr '\n' ' ')"
	;;
notify)
	"$PSQL" -X -q -c "NOTIFY $NOTIFY_CHANNEL, 'hello from psql'"
	;;
notified)
	grep -q "notification \"$NOTIFY_CHANNEL\" with payload \"hello from psql\"" "$2"
	report "listen notify" $? "$(tr '\n' ' ' <"$2")"
	;;
stale)
	# The handshake, then the new holder connects.
	echo "stale?"
	read -r token session
	[ "$session" != - ] || session=
	PGOPTIONS=$(opts "$token" "$session") "$PSQL" -X -q -c "SELECT 1" >/dev/null
	;;
stale-state)
	[ "$STALE_SQLSTATE" = ZF001 ]
	report "stale token" $? "SQLSTATE $STALE_SQLSTATE"
	;;
cancel-when-running)
	# A CancelRequest for an idle backend cancels nothing: SIGINT once the sleep runs.
	i=0
	while [ $i -lt 1500 ]; do
		n=$("$PSQL" -X -q -A -t -c "SELECT count(*) FROM pg_stat_activity WHERE pid = $SLEEPER AND state = 'active' AND query LIKE '%pg_sleep%'")
		if [ "$n" = 1 ]; then
			kill -INT "$2"
			exit 0
		fi
		sleep 0.02
		i=$((i + 1))
	done
	;;
esac
