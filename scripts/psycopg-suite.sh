#!/usr/bin/env bash
# psycopg 3's own test suite, three times: straight to PostgreSQL, through fenceproxy unfenced,
# through fenceproxy fenced (`make psycopg-suite` runs it; issue 10). A fenced session is bound
# at startup and then relayed plainly, so it must be as transparent as an unfenced one: the
# script prints each run's counts and the tests that pass directly but fail through the proxy,
# and exits non-zero if there is any.
#
# What it does, on Debian 12 as root:
#   1. installs what it needs with apt-get: scripts/deps.sh (PostgreSQL 15, Go modules), then
#      python3-psycopg and python3-psycopg-pool (the driver under test), python3-pytest and
#      the plugins and optional modules psycopg's tests use;
#   2. gets psycopg's test suite for the installed python3-psycopg version (tests/ and
#      pyproject.toml of the source tree) into ~/.cache/fenceproxy/psycopg-suite/VERSION,
#      from the first of: $PSYCOPG_SUITE_SRC (a psycopg source tree, a tarball of one, or a git
#      repository with the upstream tag, e.g. 3.1.7); that cache; `apt-get source` of the
#      Debian source package, with a deb-src list of its own made from the machine's deb
#      sources (the machine's apt configuration is not changed);
#   3. starts a throwaway PostgreSQL 15 (as the postgres OS user, on a private port, in a
#      folder under /tmp) with one database per run, installs the fence schema and a proxy key
#      in each (fenceproxy migrate --key-file), and starts
#      fenceproxy serve --resource suite --key-file KEY --unfenced allow --control-database
#      (the fenced run's database: the proxy asks it whether a raise ended a backend);
#   4. runs pytest on the suite with PSYCOPG_TEST_DSN pointing at the server (direct), at the
#      proxy (unfenced), and at the proxy with options='-c fence.resource=suite
#      -c fence.token=1' (fenced); junit XML (xunit1) of each run is what is compared;
#   5. reruns each test that passed directly and failed through the proxy, alone, through the
#      proxy and directly (SUITE_RECHECK times each): one that passes through the proxy at least
#      once, or fails directly at least once, is reported as flaky (timing tests on a busy
#      machine), not as a difference.
#
# Tests that replace the connection's `options` (psycopg.connect(dsn, options=...)) carry no
# token: with --unfenced allow they run unfenced even in the fenced run. A small pytest plugin
# (written to the temporary folder) records, per test, the libpq connections it opened: to the
# test DSN's host and port with fence.token, without it, or elsewhere; the script lists the
# tests of the fenced run that opened any without a token.
#
# Left out (-m): tests marked `proxy` (they need pproxy, which Debian does not package) and
# `mypy` (static typing checks of psycopg's API, no database involved, minutes each run).
#
# It takes 40 to 70 minutes on 2 cores: each run 12 to 26 minutes (psycopg's pool tests sleep a
# lot), then the rechecks. Many of psycopg's tests are timed (pool, scheduler, notifications,
# Ctrl-C) and fail now and then on a loaded machine, on any side: the rechecks sort them out.
#
# Settings (environment variables):
#   PSYCOPG_SUITE_SRC=         where to get the suite from when it is not cached (see 2.)
#   SUITE_TEST_TIMEOUT=120     per-test timeout in seconds (pytest-timeout)
#   SUITE_RUNS="direct unfenced fenced"   the runs to do (direct is the reference)
#   SUITE_PYTEST_ARGS=         more pytest arguments, e.g. tests/test_copy.py to run a part
#   SUITE_MARKERS="not proxy and not mypy"   the -m expression
#   SUITE_RECHECK=3            reruns of each differing test on each side (0: none)
#   SUITE_DEPS=1               0: do not install anything (the caller did)
#   SUITE_KEEP=0               1: keep the temporary folder (logs, junit files) and print it
#   SUITE_CACHE=~/.cache/fenceproxy/psycopg-suite
#   FENCEPROXY_PG_BINDIR       PostgreSQL server binaries (default /usr/lib/postgresql/15/bin)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

prog=psycopg-suite
# shellcheck source=scripts/lib.sh
. scripts/lib.sh

started=$SECONDS
test_timeout=${SUITE_TEST_TIMEOUT:-120}
runs=(${SUITE_RUNS:-direct unfenced fenced})
markers=${SUITE_MARKERS:-not proxy and not mypy}
recheck=${SUITE_RECHECK:-3}
cache=${SUITE_CACHE:-$HOME/.cache/fenceproxy/psycopg-suite}
pg_bin=${FENCEPROXY_PG_BINDIR:-/usr/lib/postgresql/15/bin}
python=/usr/bin/python3 # Debian's: python3-psycopg is installed for it, whatever PATH says
token=1
fence_options="-c fence.resource=suite -c fence.token=$token"
[[ ${runs[0]} == direct ]] || die "SUITE_RUNS must start with direct (the reference run)"

# Expected differences: tests that cannot pass through any proxy (they need the server itself:
# its Unix socket, its own port), with the reason. Each line is "NODEID<TAB>reason". None so far:
# every test of psycopg 3.1.7 that passes directly here passes through the proxy unfenced.
expected_differences=''

# --- what the suite needs ----------------------------------------------------------------------

packages=(
	python3-psycopg python3-psycopg-pool      # the driver and its pool, under test
	python3-pytest python3-pytest-asyncio     # the runner; asyncio_mode=auto in pyproject.toml
	python3-pytest-timeout                    # per-test timeout
	python3-anyio                             # the pool's tests without asyncio
	python3-dnspython python3-shapely         # optional modules some tests use (dns, postgis)
)
if [[ ${SUITE_DEPS:-1} == 1 ]]; then
	bash scripts/deps.sh
	missing=()
	for p in "${packages[@]}"; do
		[[ $(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null) == installed ]] || missing+=("$p")
	done
	if ((${#missing[@]} > 0)); then
		say "installing: ${missing[*]}"
		as_root apt-get update -qq
		as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o Dpkg::Use-Pty=0 \
			--no-install-recommends "${missing[@]}"
	fi
fi
command -v go >/dev/null || die "go is not on PATH (run make deps)"
for p in initdb postgres pg_isready psql; do
	[[ -x $pg_bin/$p ]] || die "$pg_bin/$p not found: run make deps (or set FENCEPROXY_PG_BINDIR)"
done
"$python" -c 'import psycopg, psycopg_pool, pytest, pytest_asyncio, pytest_timeout' 2>/dev/null ||
	die "$python cannot import psycopg, psycopg_pool, pytest and its plugins: install ${packages[*]}"

# --- psycopg's test suite, matching the installed version --------------------------------------

deb_version=$(dpkg-query -W -f='${Version}' python3-psycopg)
src_package=$(dpkg-query -W -f='${source:Package}' python3-psycopg)
src_version=$(dpkg-query -W -f='${source:Version}' python3-psycopg)
upstream=${src_version#*:}
upstream=${upstream%-*}
py_version=$("$python" -c 'import psycopg; print(psycopg.__version__)')
[[ $py_version == "$upstream" ]] || die "python3-psycopg $deb_version imports as psycopg $py_version, not $upstream"
suite_src=$cache/$src_version

# have_suite DIR: DIR holds a psycopg source tree's tests/ and pyproject.toml.
have_suite() { [[ -f $1/tests/conftest.py && -f $1/tests/fix_db.py && -f $1/pyproject.toml ]]; }

# store_suite TREE ORIGIN: copies TREE's tests/ and pyproject.toml into the cache.
store_suite() {
	local tree=$1 origin=$2
	have_suite "$tree" || die "$origin has no psycopg test suite (tests/conftest.py, pyproject.toml)"
	local v=$tree/psycopg/psycopg/version.py
	if [[ -f $v ]] && ! grep -q "^__version__ = \"$upstream\"" "$v"; then
		die "$origin is not psycopg $upstream: its $(grep -h '^__version__' "$v")"
	fi
	rm -rf "$suite_src.new"
	mkdir -p "$suite_src.new"
	cp -a "$tree/tests" "$tree/pyproject.toml" "$suite_src.new/"
	printf '%s\n' "$origin" >"$suite_src.new/ORIGIN"
	rm -rf "$suite_src"
	mv "$suite_src.new" "$suite_src"
	say "psycopg $upstream test suite cached in $suite_src (from $origin)"
}

# suite_from_src PATH: a source tree, a tarball of one, or a git repository (tag $upstream).
suite_from_src() {
	local src=$1 tmp
	tmp=$(mktemp -d "${TMPDIR:-/tmp}/fenceproxy-psycopg-src.XXXXXX")
	if [[ -d $src ]] && have_suite "$src"; then
		store_suite "$src" "$src"
	elif [[ -d $src ]] && git -C "$src" rev-parse --git-dir >/dev/null 2>&1; then
		git -C "$src" rev-parse -q --verify "refs/tags/$upstream^{commit}" >/dev/null ||
			die "git repository $src has no tag $upstream"
		git -C "$src" archive --format=tar "refs/tags/$upstream" tests pyproject.toml psycopg/psycopg/version.py |
			tar -x -C "$tmp"
		store_suite "$tmp" "git $src tag $upstream ($(git -C "$src" rev-parse "refs/tags/$upstream^{commit}"))"
	elif [[ -f $src ]]; then
		tar -x -f "$src" -C "$tmp"
		local tree
		tree=$(dirname "$(find "$tmp" -path '*/tests/conftest.py' -print -quit)")
		store_suite "$(dirname "$tree")" "$src"
	else
		die "PSYCOPG_SUITE_SRC=$src is neither a psycopg source tree, a tarball nor a git repository"
	fi
	rm -rf "$tmp"
}

# suite_from_apt: `apt-get source`, with a deb-src list of our own (Types: deb-src for every deb
# source this machine has), its own package lists under the cache, and dpkg-source to unpack.
suite_from_apt() {
	local aptdir=$cache/apt dl
	rm -rf "$aptdir"
	mkdir -p "$aptdir/sources.list.d" "$aptdir/lists/partial"
	local f n=0
	for f in /etc/apt/sources.list.d/*.sources; do
		[[ -f $f ]] || continue
		sed 's/^Types:.*/Types: deb-src/' "$f" >"$aptdir/sources.list.d/$(basename "$f")"
		n=$((n + 1))
	done
	for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
		[[ -f $f ]] || continue
		sed -n 's/^deb \(.*\)/deb-src \1/p' "$f" >"$aptdir/sources.list.d/$(basename "$f")"
		n=$((n + 1))
	done
	((n > 0)) || return 1
	local apt_opts=(-o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$aptdir/sources.list.d"
		-o "Dir::State::Lists=$aptdir/lists" -o "APT::Sandbox::User=root")
	say "apt-get source $src_package=$src_version (deb-src lists of its own in $aptdir)"
	apt-get "${apt_opts[@]}" update -qq >"$aptdir/update.log" 2>&1 || {
		say "apt-get update of the deb-src lists failed: $(tail -n 3 "$aptdir/update.log")"
		return 1
	}
	dl=$aptdir/download
	mkdir -p "$dl"
	(cd "$dl" && apt-get "${apt_opts[@]}" source --download-only "$src_package=$src_version") >"$aptdir/source.log" 2>&1 || {
		say "apt-get source failed: $(grep -E '^E:' "$aptdir/source.log" | head -n 3 | tr '\n' ' ')"
		return 1
	}
	if ! command -v dpkg-source >/dev/null; then
		as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o Dpkg::Use-Pty=0 --no-install-recommends dpkg-dev
	fi
	dpkg-source --no-check -x "$dl/${src_package}_${src_version#*:}.dsc" "$dl/tree" >"$aptdir/unpack.log" 2>&1 ||
		die "dpkg-source -x failed: $(tail -n 5 "$aptdir/unpack.log")"
	store_suite "$dl/tree" "apt-get source $src_package=$src_version"
	rm -rf "$aptdir"
}

if [[ -n ${PSYCOPG_SUITE_SRC:-} ]] && ! have_suite "$suite_src"; then
	suite_from_src "$PSYCOPG_SUITE_SRC"
fi
if ! have_suite "$suite_src"; then
	suite_from_apt || die "could not get psycopg $upstream's test suite: no cached copy in $suite_src, and apt-get source $src_package=$src_version failed. Give it with PSYCOPG_SUITE_SRC=PATH: a psycopg source tree, a tarball of one, or a git clone of psycopg's repository (it uses the tag $upstream)."
fi
say "python3-psycopg $deb_version; test suite $suite_src ($(cat "$suite_src/ORIGIN"))"

# --- processes and cleanup ---------------------------------------------------------------------

work=$(mktemp -d "${TMPDIR:-/tmp}/fenceproxy-psycopg.XXXXXX")
chmod 0711 "$work" # the postgres user must reach its own folder inside
pids=()
stop_all() {
	local i pid
	for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
		pid=${pids[i]}
		kill -0 "$pid" 2>/dev/null || continue
		# SIGINT is PostgreSQL's fast shutdown; fenceproxy stops on SIGINT as on SIGTERM.
		kill -INT "$pid" 2>/dev/null || true
		for _ in $(seq 100); do
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.1
		done
		kill -KILL "$pid" 2>/dev/null || true
		wait "$pid" 2>/dev/null || true
	done
	pids=()
}
cleanup() {
	local rc=$?
	trap - EXIT INT TERM
	stop_all
	if [[ ${SUITE_KEEP:-0} == 1 ]]; then
		say "kept $work"
	else
		rm -rf "$work"
	fi
	exit "$rc"
}
trap cleanup EXIT
trap 'say interrupted; exit 130' INT
trap 'say terminated; exit 143' TERM

# --- PostgreSQL, the fence schema, fenceproxy --------------------------------------------------

mkdir -p "$repo/bin"
say "building bin/fenceproxy"
go build -o "$repo/bin/fenceproxy" ./cmd/fenceproxy
fenceproxy=$repo/bin/fenceproxy

free_port pg_port
free_port proxy_port
pg_dir=$work/postgres
mkdir -p "$pg_dir"
as_pg=()
if [[ $(id -u) == 0 ]]; then
	id postgres >/dev/null 2>&1 || die "no postgres OS user: run make deps"
	chown postgres: "$pg_dir"
	as_pg=(setpriv --reuid=postgres --regid=postgres --clear-groups --)
fi
printf 'postgres\n' >"$pg_dir/pwfile"
[[ $(id -u) != 0 ]] || chown postgres: "$pg_dir/pwfile"
say "PostgreSQL 15 on 127.0.0.1:$pg_port, folder $work"
"${as_pg[@]}" env -i PATH="$PATH" LC_ALL=C "$pg_bin/initdb" -D "$pg_dir/data" -U postgres \
	--pwfile="$pg_dir/pwfile" --auth=scram-sha-256 -E UTF8 --locale=C >"$pg_dir/initdb.log" 2>&1 ||
	die "initdb failed: $(tail -n 20 "$pg_dir/initdb.log")"
# max_prepared_transactions: psycopg's two-phase commit tests run instead of skipping.
setsid "${as_pg[@]}" env -i PATH="$PATH" LC_ALL=C "$pg_bin/postgres" -D "$pg_dir/data" \
	-c listen_addresses=127.0.0.1 -c port="$pg_port" -c unix_socket_directories="$pg_dir" \
	-c fsync=off -c synchronous_commit=off -c full_page_writes=off \
	-c max_prepared_transactions=10 >"$pg_dir/postgres.log" 2>&1 &
pids+=("$!")
pg_pid=$!
pg_ready() {
	kill -0 "$pg_pid" 2>/dev/null || die "PostgreSQL exited: $(tail -n 20 "$pg_dir/postgres.log")"
	"$pg_bin/pg_isready" -q -h 127.0.0.1 -p "$pg_port"
}
wait_for PostgreSQL 60 pg_ready
sql() {
	local db=$1
	shift
	PGPASSWORD=postgres "$pg_bin/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$pg_port" -U postgres -d "$db" "$@"
}

key_file=$work/proxy.key
declare -A dbname=([direct]=psycopg_direct [unfenced]=psycopg_unfenced [fenced]=psycopg_fenced)
for run in "${runs[@]}"; do
	db=${dbname[$run]:-}
	[[ -n $db ]] || die "unknown run $run in SUITE_RUNS (direct, unfenced, fenced)"
	sql postgres -c "CREATE DATABASE $db"
	# The same schema and key in every run's database: the runs differ only in the path.
	"$fenceproxy" migrate --database "postgres://postgres:postgres@127.0.0.1:$pg_port/$db?sslmode=disable" \
		--key-file "$key_file" --log-format console >>"$work/migrate.log" 2>&1 ||
		die "fenceproxy migrate failed: $(tail -n 20 "$work/migrate.log")"
done
say "fence schema and proxy key installed in: ${runs[*]/#/psycopg_}"

setsid "$fenceproxy" serve --listen "127.0.0.1:$proxy_port" --upstream "postgres://127.0.0.1:$pg_port" \
	--resource suite --key-file "$key_file" --unfenced allow --log-format console \
	--control-database "postgres://postgres:postgres@127.0.0.1:$pg_port/psycopg_fenced?sslmode=disable" \
	>"$work/fenceproxy.log" 2>&1 &
pids+=("$!")
proxy_pid=$!
proxy_ready() {
	kill -0 "$proxy_pid" 2>/dev/null || die "fenceproxy exited: $(tail -n 20 "$work/fenceproxy.log")"
	listening "$proxy_port"
}
wait_for fenceproxy 30 proxy_ready
say "fenceproxy on 127.0.0.1:$proxy_port: serve --resource suite --key-file KEY --unfenced allow --control-database .../psycopg_fenced"

base="host=127.0.0.1 user=postgres password=postgres sslmode=disable"
declare -A dsn=(
	[direct]="$base port=$pg_port dbname=psycopg_direct"
	[unfenced]="$base port=$proxy_port dbname=psycopg_unfenced"
	[fenced]="$base port=$proxy_port dbname=psycopg_fenced options='$fence_options'"
)

# A fenced session works before 4000 tests depend on it: its first bind admits the token, and
# the backend shows up in fence.bindings.
if [[ " ${runs[*]} " == *" fenced "* ]]; then
	bound=$(PGPASSWORD=postgres PGOPTIONS="$fence_options" "$pg_bin/psql" -X -A -t -v ON_ERROR_STOP=1 \
		-h 127.0.0.1 -p "$proxy_port" -U postgres -d psycopg_fenced \
		-c 'SELECT count(*) FROM fence.bindings WHERE pid = pg_backend_pid()' 2>&1) ||
		die "a fenced session through the proxy failed: $bound"
	[[ $bound == 1 ]] || die "a fenced session through the proxy is not bound (fence.bindings: $bound)"
	say "fenced sessions bind: resource suite, token $token ($(sql psycopg_fenced -A -t -c "SELECT token FROM fence.tokens WHERE resource = 'suite'") stored)"
fi

# --- the runs ----------------------------------------------------------------------------------

suite=$work/suite
mkdir -p "$suite" "$work/plugin" "$work/results" "$work/tmp"
cp -a "$suite_src/tests" "$suite_src/pyproject.toml" "$suite/"

# The plugin: which tests opened libpq connections without a fencing token. (And a stand-in
# for config.cache, which psycopg's conftest.py uses and -p no:cacheprovider removes.) It wraps
# PGconn.connect and connect_start (every psycopg connection, sync or async, starts there) and
# changes nothing else; it runs in every run so that it cannot make a difference.
cat >"$work/plugin/fence_suite_plugin.py" <<'EOF'
"""Records, per test, the libpq connections it opened: to the test DSN's host and port with
fence.token in its options ("fenced") or without ("unfenced"), or somewhere else ("elsewhere":
a conninfo not derived from the test DSN, such as psycopg's "dbname=nosuchdb")."""
import json
import os

import pytest

_current = ["(collection and session fixtures)"]
_conns = {}


def _params(conninfo):
    from psycopg import pq

    if isinstance(conninfo, str):
        conninfo = conninfo.encode()
    return {
        o.keyword.decode(): o.val.decode("utf-8", "replace")
        for o in pq.Conninfo.parse(conninfo)
        if o.val is not None
    }


def _target():
    p = _params(os.environ.get("PSYCOPG_TEST_DSN", ""))
    return p.get("host", ""), p.get("port", "")


def _note(conninfo):
    try:
        p = _params(conninfo)
        where = (p.get("host", os.environ.get("PGHOST", "")), p.get("port", os.environ.get("PGPORT", "")))
        options = p.get("options", os.environ.get("PGOPTIONS", ""))
        if where != _target():
            kind = "elsewhere"
        else:
            kind = "fenced" if "fence.token=" in options else "unfenced"
    except Exception:  # a malformed conninfo (tests pass some on purpose): libpq refuses it
        kind = "elsewhere"
    counts = _conns.setdefault(_current[0], {"fenced": 0, "unfenced": 0, "elsewhere": 0})
    counts[kind] += 1


def _wrap(cls, name):
    orig = cls.__dict__[name].__func__

    def wrapper(klass, conninfo=b""):
        _note(conninfo)
        return orig(klass, conninfo)

    wrapper.__name__ = orig.__name__
    wrapper.__doc__ = orig.__doc__
    setattr(cls, name, classmethod(wrapper))


class _NoCache:
    """config.cache under -p no:cacheprovider: psycopg's conftest keeps a "segfault" flag
    there (its crash detector across runs), which a throwaway run does not need."""

    def get(self, key, default):
        return default

    def set(self, key, value):
        pass


def pytest_configure(config):
    from psycopg import pq

    if not hasattr(config, "cache"):
        config.cache = _NoCache()
    for name in ("connect", "connect_start"):
        _wrap(pq.PGconn, name)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.nodeid
    yield
    _current[0] = "(between tests)"


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("FENCE_SUITE_CONNLOG")
    if path:
        with open(path, "w") as f:
            json.dump(_conns, f, indent=0, sort_keys=True)
EOF

# The analysis: outcomes from junit XML (xunit1: file and line give the node id back),
# counts, differences, unfenced connections.
cat >"$work/plugin/suite_report.py" <<'EOF'
import json
import sys
import xml.etree.ElementTree as ET

RANK = {"passed": 0, "xpassed": 0, "skipped": 1, "xfailed": 1, "failed": 2, "error": 3}


def nodeid(tc):
    f = tc.get("file", "")
    classname = tc.get("classname", "")
    module = f[:-3].replace("/", ".") if f.endswith(".py") else ""
    parts = [f]
    if module and classname.startswith(module):
        rest = classname[len(module):].lstrip(".")
        if rest:
            parts += rest.split(".")
    return "::".join(parts + [tc.get("name", "")])


def outcomes(path):
    """{nodeid: (outcome, message)}; a test in several testcase elements (a teardown error
    after a failure) takes its worst outcome."""
    res = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        out, msg = "passed", ""
        for child in tc:
            if child.tag == "failure":
                out, msg = "failed", child.get("message", "")
            elif child.tag == "error":
                out, msg = "error", child.get("message", "")
            elif child.tag == "skipped":
                xfail = child.get("type") == "pytest.xfail"
                out, msg = ("xfailed" if xfail else "skipped"), child.get("message", "")
        nid = nodeid(tc)
        if nid not in res or RANK[out] > RANK[res[nid][0]]:
            res[nid] = (out, msg)
    return res


def counts(res):
    c = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "xfailed": 0}
    for out, _ in res.values():
        c[{"error": "errors", "xpassed": "passed"}.get(out, out)] += 1
    return c


def main():
    cmd = sys.argv[1]
    if cmd == "counts":
        c = counts(outcomes(sys.argv[2]))
        print(f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped, "
              f"{c['errors']} errors, {c['xfailed']} xfailed")
    elif cmd == "diff":  # direct.xml other.xml: the tests passing directly, failing in other
        ref, other = outcomes(sys.argv[2]), outcomes(sys.argv[3])
        for nid, (out, _) in sorted(ref.items()):
            if RANK[out] != 0:
                continue
            o, msg = other.get(nid, ("missing", "not run"))
            if o in ("failed", "error", "missing"):
                print(f"{nid}\t{o}\t{' '.join(msg.split())[:300]}")
    elif cmd == "skipdiff":  # tests passing directly and skipped in other: for information
        ref, other = outcomes(sys.argv[2]), outcomes(sys.argv[3])
        for nid, (out, _) in sorted(ref.items()):
            o, msg = other.get(nid, ("missing", ""))
            if RANK[out] == 0 and o in ("skipped", "xfailed"):
                print(f"{nid}\t{o}\t{' '.join(msg.split())[:200]}")
    elif cmd == "outcome":  # file.xml nodeid
        print(outcomes(sys.argv[2]).get(sys.argv[3], ("missing", ""))[0])
    elif cmd in ("unfenced", "elsewhere"):  # connlog.json: tests that opened such connections
        for nid, c in sorted(json.load(open(sys.argv[2])).items()):
            if c[cmd] and not nid.startswith("("):
                print(f"{nid}\t{c['fenced']} fenced, {c['unfenced']} unfenced, {c['elsewhere']} elsewhere")
    elif cmd == "fencedcount":
        log = json.load(open(sys.argv[2]))
        tests = [n for n in log if not n.startswith("(")]
        print(sum(1 for n in tests if log[n]["fenced"] and not log[n]["unfenced"]))


main()
EOF

# pytest RUN NAME ARGS...: runs the suite (or the node ids in ARGS) against RUN's DSN, in a
# clean environment, writing junit XML to results/NAME.xml and its output to results/NAME.log.
pytest_run() {
	local run=$1 name=$2
	shift 2
	local rc=0
	(cd "$suite" && env -i PATH=/usr/bin:/bin HOME="$HOME" LANG=C.UTF-8 \
		PYTHONPATH="$work/plugin" PYTHONDONTWRITEBYTECODE=1 \
		PSYCOPG_TEST_DSN="${dsn[$run]}" FENCE_SUITE_CONNLOG="$work/results/$name.conns.json" \
		timeout --signal=INT --kill-after=60 7200 \
		"$python" -bb -m pytest -p fence_suite_plugin -p no:cacheprovider -p no:randomly \
		--timeout="$test_timeout" -m "$markers" --junitxml="$work/results/$name.xml" \
		-o junit_family=xunit1 --basetemp="$work/tmp/$name" -q -rfE --no-header "$@" \
		>"$work/results/$name.log" 2>&1) || rc=$?
	# pytest: 0 all passed, 1 some failed; anything else (usage, internal error, interrupted)
	# means the run itself did not work.
	if ((rc > 1)) || [[ ! -s $work/results/$name.xml ]]; then
		tail -n 40 "$work/results/$name.log" >&2
		die "pytest run $name exited $rc (log above)"
	fi
}

report() { "$python" "$work/plugin/suite_report.py" "$@"; }

declare -A took=()
for run in "${runs[@]}"; do
	t0=$SECONDS
	say "run $run: PSYCOPG_TEST_DSN='${dsn[$run]/password=postgres/password=***}'"
	# shellcheck disable=SC2086 # SUITE_PYTEST_ARGS: words
	pytest_run "$run" "$run" ${SUITE_PYTEST_ARGS:-}
	took[$run]=$((SECONDS - t0))
	say "run $run: $(report counts "$work/results/$run.xml") in ${took[$run]}s ($(tail -n 1 "$work/results/$run.log"))"
done

# --- differences -------------------------------------------------------------------------------

declare -A expected=()
while IFS=$'\t' read -r nid reason; do
	[[ -n $nid ]] && expected[$nid]=$reason
done <<<"$expected_differences"

differences=()
flaky=()
explained=()
for run in "${runs[@]:1}"; do
	while IFS=$'\t' read -r nid outcome msg; do
		[[ -n $nid ]] || continue
		if [[ -n ${expected[$nid]:-} ]]; then
			explained+=("$run: $nid ($outcome): ${expected[$nid]}")
			continue
		fi
		# Alone, again, on both sides: a test that fails only now and then is flaky, not a
		# difference of the proxy's.
		verdict=""
		if ((recheck > 0)); then
			fails=0 ref_fails=0
			for i in $(seq "$recheck"); do
				safe=$(printf '%s' "$nid" | md5sum | cut -c1-12)
				pytest_run "$run" "recheck-$run-$safe-$i" "$nid"
				[[ $(report outcome "$work/results/recheck-$run-$safe-$i.xml" "$nid") == passed ]] || fails=$((fails + 1))
				pytest_run direct "recheck-direct-$safe-$i" "$nid"
				[[ $(report outcome "$work/results/recheck-direct-$safe-$i.xml" "$nid") == passed ]] || ref_fails=$((ref_fails + 1))
			done
			if ((fails < recheck || ref_fails > 0)); then
				verdict="flaky: alone it failed $fails of $recheck times through the proxy, $ref_fails of $recheck directly"
			fi
		fi
		if [[ -n $verdict ]]; then
			flaky+=("$run: $nid ($outcome in the full run; $verdict): $msg")
		else
			differences+=("$run: $nid ($outcome): $msg")
		fi
	done < <(report diff "$work/results/direct.xml" "$work/results/$run.xml")
done

# --- summary -----------------------------------------------------------------------------------

printf '\n== psycopg %s test suite (python3-psycopg %s), -m "%s" ==\n' "$upstream" "$deb_version" "$markers"
for run in "${runs[@]}"; do
	case $run in
	direct) what="straight to PostgreSQL" ;;
	unfenced) what="through fenceproxy, unfenced" ;;
	fenced) what="through fenceproxy, fenced (token $token)" ;;
	esac
	printf '%-9s %s: %s (%ss)\n' "$run" "$what" "$(report counts "$work/results/$run.xml")" "${took[$run]}"
done

if [[ " ${runs[*]} " == *" fenced "* ]]; then
	log=$work/results/fenced.conns.json
	unfenced_list=$(report unfenced "$log")
	elsewhere_list=$(report elsewhere "$log")
	printf '\nfenced run: %s tests opened fenced sessions only.\n' "$(report fencedcount "$log")"
	printf 'tests that opened a session through the proxy without a token (their own options), run unfenced (--unfenced allow): %s\n' \
		"$(grep -c . <<<"$unfenced_list" || true)"
	[[ -z $unfenced_list ]] || sed 's/^/  /' <<<"$unfenced_list"
	printf 'tests that connected somewhere else (a conninfo not derived from the test DSN; not through the proxy): %s\n' \
		"$(grep -c . <<<"$elsewhere_list" || true)"
	[[ -z $elsewhere_list ]] || sed 's/^/  /' <<<"$elsewhere_list"
fi

for run in "${runs[@]:1}"; do
	skips=$(report skipdiff "$work/results/direct.xml" "$work/results/$run.xml")
	if [[ -n $skips ]]; then
		printf '\npassed directly, skipped in run %s (for information):\n' "$run"
		sed 's/^/  /' <<<"$skips"
	fi
done
if ((${#explained[@]} > 0)); then
	printf '\nexpected differences (cannot pass through any proxy):\n'
	printf '  %s\n' "${explained[@]}"
fi
if ((${#flaky[@]} > 0)); then
	printf '\nflaky (failed through the proxy in the full run; alone, passed through the proxy at least once or failed directly too):\n'
	printf '  %s\n' "${flaky[@]}"
fi
printf '\nwall time: %ss\n' "$((SECONDS - started))"
if ((${#differences[@]} > 0)); then
	printf '\npassed directly, failed through fenceproxy (%s):\n' "${#differences[@]}"
	printf '  %s\n' "${differences[@]}"
	say "FAILED: ${#differences[@]} test(s) pass directly but fail through the proxy"
	exit 1
fi
say "ok: every test that passes directly passes through fenceproxy, unfenced and fenced"
