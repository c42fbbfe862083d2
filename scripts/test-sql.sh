#!/usr/bin/env bash
# Runs the pgTAP tests of the fence schema (test/sql/*.sql) with pg_prove against a throwaway
# PostgreSQL 15 cluster: a temporary folder, a private port on 127.0.0.1, trust
# authentication. The schema is installed exactly as the product installs it
# (`fenceproxy migrate`). The cluster is stopped and its folder removed on exit, whatever
# happens.
#
# initdb and postgres refuse to run as root: as root, the cluster runs as the `postgres` OS
# user. On a machine without PostgreSQL 15, pgTAP or pg_prove, running as root with apt-get
# installs them.
#
# Environment: FENCEPROXY_PG_BINDIR (server binaries; default /usr/lib/postgresql/15/bin),
# PG_PROVE_FLAGS (extra pg_prove flags, e.g. --verbose).
set -euo pipefail

cd "$(dirname "$0")/.."

bindir=${FENCEPROXY_PG_BINDIR:-/usr/lib/postgresql/15/bin}

# Client settings of the caller must not point psql or pg_prove elsewhere.
unset PGHOST PGHOSTADDR PGPORT PGDATABASE PGUSER PGPASSWORD PGSERVICE PGOPTIONS PGSSLMODE

have_deps() {
	[[ -x $bindir/initdb && -x $bindir/pg_ctl && -x $bindir/pg_config ]] || return 1
	command -v pg_prove >/dev/null || return 1
	command -v psql >/dev/null || return 1
	local ext
	ext=$("$bindir/pg_config" --sharedir)/extension
	[[ -f $ext/pgtap.control && -f $ext/dblink.control ]]
}

if ! have_deps; then
	if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
		echo "test-sql: installing PostgreSQL 15, pgTAP and pg_prove" >&2
		export DEBIAN_FRONTEND=noninteractive
		apt-get update -qq
		apt-get install -y -qq postgresql-15 postgresql-client-15 postgresql-15-pgtap \
			libtap-parser-sourcehandler-pgtap-perl >/dev/null
	fi
	if ! have_deps; then
		echo "test-sql: need PostgreSQL 15 server binaries in $bindir (with contrib: dblink)," \
			"pgTAP (postgresql-15-pgtap) and pg_prove (libtap-parser-sourcehandler-pgtap-perl)" >&2
		exit 1
	fi
fi

# Who runs the cluster: ourselves, or the postgres OS user when we are root.
as_owner=()
if [[ $EUID -eq 0 ]]; then
	as_owner=(runuser -u postgres --)
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/fenceproxy-sqltest.XXXXXX")
data=$tmp/data
sock=$tmp/sock
log=$tmp/postgres.log
mkdir -p "$sock"
if [[ $EUID -eq 0 ]]; then
	chown -R postgres: "$tmp"
fi

cleanup() {
	local rc=$?
	if [[ -f $data/postmaster.pid ]]; then
		"${as_owner[@]}" "$bindir/pg_ctl" -D "$data" -m immediate -w stop >/dev/null 2>&1 || true
	fi
	if [[ $rc -ne 0 && -f $log ]]; then
		echo "test-sql: server log (last lines):" >&2
		tail -n 30 "$log" >&2 || true
	fi
	rm -rf "$tmp"
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

"${as_owner[@]}" "$bindir/initdb" -D "$data" -U postgres -A trust -E UTF8 --locale=C --no-sync >"$tmp/initdb.log" 2>&1 ||
	{ cat "$tmp/initdb.log" >&2; exit 1; }

# A private port below the usual ephemeral range; another process may take it between the
# choice and the bind, so try a few.
port=
for _ in 1 2 3 4 5 6 7 8 9 10; do
	candidate=$((20000 + RANDOM % 12000))
	if "${as_owner[@]}" "$bindir/pg_ctl" -D "$data" -l "$log" -w -t 60 start -o \
		"-p $candidate -k $sock -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c statement_timeout=120s -c max_prepared_transactions=4" \
		>/dev/null 2>&1; then
		port=$candidate
		break
	fi
	if ! grep -q "could not bind\|could not create lock file\|Address already in use" "$log" 2>/dev/null; then
		cat "$log" >&2 || true
		echo "test-sql: PostgreSQL did not start" >&2
		exit 1
	fi
	: >"$log"
done
if [[ -z $port ]]; then
	echo "test-sql: no free port for PostgreSQL" >&2
	exit 1
fi

db=fenceproxy_test
url="postgres://postgres@127.0.0.1:$port/$db?sslmode=disable"
psql -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$port" -U postgres -d postgres -c "CREATE DATABASE $db"

# Install the schema the way the product does.
go run ./cmd/fenceproxy migrate --database "$url"

psql -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$port" -U postgres -d "$db" \
	-c "CREATE EXTENSION pgtap" -c "CREATE EXTENSION dblink"

# shellcheck disable=SC2086 # PG_PROVE_FLAGS is a list of flags
# SQL_TESTS: the files to run (default: every one).
timeout 600 pg_prove -h 127.0.0.1 -p "$port" -U postgres -d "$db" ${PG_PROVE_FLAGS:-} ${SQL_TESTS:-test/sql/*.sql}
