#!/usr/bin/env bash
# The drivers' own test suites through fenceproxy (`make driver-suites`; `make psycopg-suite`
# runs psycopg's alone): node-postgres's integration tests, psycopg 3's pytest suite and pgx's
# tests, each straight to PostgreSQL and through the proxy by each admission path (unfenced, a
# bare resource, a Consul-validated one, a PostgreSQL lease resource). This script
# installs what the suites need and gets their sources; cmd/driversuites starts the servers
# (internal/testenv), runs, compares and reports (see its doc comment), and exits non-zero
# when a test passes directly but fails through the proxy.
#
# On Debian 12 as root:
#   1. installs with apt-get what the suites need: scripts/deps.sh (PostgreSQL 15, node and
#      npm, Go modules: pgx's tests come from the module cache, Consul built for the consul
#      mode), python3-psycopg and python3-psycopg-pool (the driver under test),
#      python3-pytest and the plugins and optional modules psycopg's tests use;
#   2. gets each suite's source tree into ~/.cache/fenceproxy/driver-suites/NAME-VERSION,
#      from the first of: that cache; $PSYCOPG_SUITE_SRC / $NODE_POSTGRES_SRC (a source tree,
#      a tarball of one, or a git clone of the driver's repository, whose release tag it
#      uses); `apt-get source` of the Debian source package, with deb-src lists of its own
#      made from the machine's deb sources (the machine's apt configuration is not changed),
#      when Debian's version is the one wanted;
#      psycopg: the version of the installed python3-psycopg (Debian's 3.1.7, tag 3.1.7);
#      node-postgres: $NODE_POSTGRES_VERSION (default 8.23.0, the release nearest to the
#      8.23.1 of TestTransparencyMatrix with a tag: pg@8.23.0), its packages/pg folder (lib/ is the
#      driver under test) and, with npm, its dependencies and the modules its tests use;
#   3. runs `go run ./cmd/driversuites`.
#
# Settings (environment variables; cmd/driversuites reads its own, see `go run
# ./cmd/driversuites --help`: SUITES, SUITE_MODES, SUITE_RECHECK, SUITE_PYTEST_ARGS,
# NODE_SUITE_FILES, SUITE_TEST_TIMEOUT, SUITE_KEEP...):
#   SUITES=node-postgres,psycopg,pgx  the suites to run
#   SUITE_MODES=direct,unfenced,bare,consul,lease  the paths (direct first: the reference)
#   PSYCOPG_SUITE_SRC=, NODE_POSTGRES_SRC=   where to get a suite that is not cached (see 2.)
#   NODE_POSTGRES_VERSION=8.23.0    node-postgres's release whose tests and lib run
#   SUITE_DEPS=1                    0: install nothing (the caller did)
#   SUITE_CACHE=~/.cache/fenceproxy/driver-suites
set -euo pipefail
cd "$(dirname "$0")/.."

prog=driver-suites
# shellcheck source=scripts/lib.sh
. scripts/lib.sh

suites=${SUITES:-node-postgres,psycopg,pgx}
cache=${SUITE_CACHE:-$HOME/.cache/fenceproxy/driver-suites}
python=/usr/bin/python3 # Debian's: python3-psycopg is installed for it, whatever PATH says
node_version=${NODE_POSTGRES_VERSION:-8.23.0}
want() { [[ ,$suites, == *,$1,* ]]; }

# --- what the suites need ----------------------------------------------------------------------

packages=(dpkg-dev) # dpkg-source, to unpack a Debian source package
if want psycopg; then
	packages+=(
		python3-psycopg python3-psycopg-pool  # the driver and its pool, under test
		python3-pytest python3-pytest-asyncio # the runner; asyncio_mode=auto in pyproject.toml
		python3-pytest-timeout                # per-test timeout
		python3-anyio                         # the pool's tests without asyncio
		python3-dnspython python3-shapely     # optional modules some tests use (dns, postgis)
	)
fi
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

# --- getting a suite's source tree -------------------------------------------------------------

# from_apt PACKAGE UPSTREAM DEST: `apt-get source` of Debian's PACKAGE unpacked into DEST, when
# its upstream version is UPSTREAM, with a deb-src list of its own for every deb source this
# machine has (its URIs, suites and keys: nothing of the mirror is written here) and its own
# package lists.
from_apt() {
	local package=$1 upstream=$2 dest=$3 aptdir=$cache/apt f n=0 version
	rm -rf "$aptdir"
	mkdir -p "$aptdir/sources.list.d" "$aptdir/lists/partial" "$aptdir/download"
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
	say "apt-get source $package (deb-src lists of its own in $aptdir)"
	apt-get "${apt_opts[@]}" update -qq >"$aptdir/update.log" 2>&1 || {
		say "apt-get update of the deb-src lists failed: $(tail -n 3 "$aptdir/update.log")"
		return 1
	}
	version=$(apt-cache "${apt_opts[@]}" showsrc "$package" 2>/dev/null | sed -n 's/^Version: //p' | sort -V | tail -n 1 || true)
	if [[ $(deb_upstream "$version") != "$upstream" ]]; then
		say "Debian's source package $package is ${version:-unknown}, not $upstream"
		return 1
	fi
	(cd "$aptdir/download" && apt-get "${apt_opts[@]}" source --download-only "$package=$version") >"$aptdir/source.log" 2>&1 || {
		say "apt-get source failed: $(grep -E '^E:' "$aptdir/source.log" | head -n 3 | tr '\n' ' ')"
		return 1
	}
	dpkg-source --no-check -x "$aptdir/download/${package}_${version#*:}.dsc" "$dest" >"$aptdir/unpack.log" 2>&1 || {
		say "dpkg-source -x failed: $(tail -n 5 "$aptdir/unpack.log")"
		return 1
	}
	rm -rf "$aptdir"
}

# from_src SRC TAG DEST: SRC is a source tree (copied), a tarball of one (unpacked), or a git
# repository (its tag TAG, archived).
from_src() {
	local src=$1 tag=$2 dest=$3
	mkdir -p "$dest"
	if [[ -d $src ]] && git -C "$src" rev-parse --git-dir >/dev/null 2>&1 &&
		git -C "$src" rev-parse -q --verify "refs/tags/$tag^{commit}" >/dev/null; then
		say "git $src, tag $tag ($(git -C "$src" rev-parse "refs/tags/$tag^{commit}"))"
		git -C "$src" archive --format=tar "refs/tags/$tag" | tar -x -C "$dest"
	elif [[ -d $src ]]; then
		cp -a "$src/." "$dest/"
	elif [[ -f $src ]]; then
		tar -x -f "$src" -C "$dest"
	else
		die "$src is neither a source tree, a tarball nor a git repository with tag $tag"
	fi
}

# get_tree NAME ENVVAR TAG DEBPKG UPSTREAM: a fresh source tree of the suite in the folder it
# prints (under the cache's tmp/), from ENVVAR's path or apt-get source.
get_tree() {
	local name=$1 var=$2 tag=$3 debpkg=$4 upstream=$5 tmp
	tmp=$cache/tmp/$name
	rm -rf "$tmp"
	mkdir -p "$tmp"
	if [[ -n ${!var:-} ]]; then
		from_src "${!var}" "$tag" "$tmp/tree" >&2
	else
		from_apt "$debpkg" "$upstream" "$tmp/tree" >&2 || return 1
	fi
	printf '%s\n' "$tmp/tree"
}

# deb_upstream VERSION: Debian's version without epoch, revision and repack suffix.
deb_upstream() {
	local v=${1#*:}
	v=${v%-*}
	printf '%s\n' "${v%%+*}"
}


# --- psycopg 3 ---------------------------------------------------------------------------------

if want psycopg; then
	"$python" -c 'import psycopg, psycopg_pool, pytest, pytest_asyncio, pytest_timeout' 2>/dev/null ||
		die "$python cannot import psycopg, psycopg_pool, pytest and its plugins: install ${packages[*]}"
	src_package=$(dpkg-query -W -f='${source:Package}' python3-psycopg)
	src_version=$(dpkg-query -W -f='${source:Version}' python3-psycopg)
	upstream=$(deb_upstream "$src_version")
	py_version=$("$python" -c 'import psycopg; print(psycopg.__version__)')
	[[ $py_version == "$upstream" ]] || die "python3-psycopg $src_version imports as psycopg $py_version, not $upstream"
	psycopg_dir=$cache/psycopg-$upstream
	if [[ ! -f $psycopg_dir/tests/conftest.py ]]; then
		tree=$(get_tree psycopg PSYCOPG_SUITE_SRC "$upstream" "$src_package" "$upstream") ||
			die "could not get psycopg $upstream's test suite: not cached in $psycopg_dir, and apt-get source $src_package failed. Give it with PSYCOPG_SUITE_SRC=PATH: a psycopg source tree, a tarball of one, or a git clone of psycopg's repository (it uses the tag $upstream)."
		conftest=$(find "$tree" -path '*/tests/conftest.py' -print -quit)
		[[ -n $conftest ]] || die "no tests/conftest.py in the psycopg source tree"
		root=$(dirname "$(dirname "$conftest")")
		v=$root/psycopg/psycopg/version.py
		if [[ -f $v ]] && ! grep -q "^__version__ = \"$upstream\"" "$v"; then
			die "the psycopg source tree is not psycopg $upstream: its $(grep -h '^__version__' "$v")"
		fi
		rm -rf "$psycopg_dir"
		mkdir -p "$psycopg_dir"
		cp -a "$root/tests" "$root/pyproject.toml" "$psycopg_dir/"
		rm -rf "$cache/tmp"
		say "psycopg $upstream test suite cached in $psycopg_dir"
	fi
	export PSYCOPG_SUITE_DIR=$psycopg_dir
	say "psycopg: python3-psycopg $(dpkg-query -W -f='${Version}' python3-psycopg), test suite $psycopg_dir"
fi

# --- node-postgres -----------------------------------------------------------------------------

if want node-postgres; then
	command -v node >/dev/null && command -v npm >/dev/null || die "node and npm are not on PATH (run make deps)"
	node_dir=$cache/node-postgres-$node_version
	if [[ ! -f $node_dir/test/integration/test-helper.js ]]; then
		tree=$(get_tree node-postgres NODE_POSTGRES_SRC "pg@$node_version" node-postgres "$node_version") ||
			die "could not get node-postgres $node_version's tests: not cached in $node_dir, and apt-get source node-postgres failed (see above). Give it with NODE_POSTGRES_SRC=PATH: a node-postgres source tree (the monorepo or its packages/pg), a tarball of one, or a git clone of node-postgres's repository (it uses the tag pg@$node_version)."
		helper=$(find "$tree" -path '*/test/integration/test-helper.js' -not -path '*/node_modules/*' -print -quit)
		[[ -n $helper ]] || die "no test/integration/test-helper.js in the node-postgres source tree"
		root=$(dirname "$(dirname "$(dirname "$helper")")")
		got=$(node -p "require('$root/package.json').version")
		[[ $got == "$node_version" ]] || die "the node-postgres source tree is pg $got, not $node_version"
		rm -rf "$node_dir"
		mkdir -p "$node_dir"
		cp -a "$root/lib" "$root/test" "$node_dir/"
		# package.json of its own: pg's runtime dependencies and the modules its tests require,
		# not its devDependencies' toolchains (TypeScript, vitest, wrangler for the Cloudflare
		# tests, which do not run here).
		node -e '
			const o = require(process.argv[1])
			const deps = Object.assign({}, o.dependencies)
			for (const m of ["async", "bluebird", "co", "pg-copy-streams"]) deps[m] = o.devDependencies[m]
			const out = { name: "fenceproxy-node-postgres-suite", private: true, version: o.version, dependencies: deps }
			require("fs").writeFileSync(process.argv[2], JSON.stringify(out, null, 2) + "\n")
		' "$root/package.json" "$node_dir/package.json"
		rm -rf "$cache/tmp"
		(cd "$node_dir" && npm install --no-audit --no-fund --ignore-scripts --omit=optional --loglevel=error)
		say "node-postgres $node_version test suite cached in $node_dir (its dependencies installed with npm)"
	fi
	export NODE_SUITE_DIR=$node_dir
	say "node-postgres: pg $node_version (lib and test from its source), node $(node --version)"
fi

export SUITES=$suites
exec go run ./cmd/driversuites
