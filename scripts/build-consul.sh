#!/usr/bin/env bash
# Builds the Consul agent that fenceproxy's tests run against, and prints its path.
#
# Consul 1.16.3 is the last MPL-2.0 release the Go module proxy serves to us (1.16.6 and
# 1.17+ carry the BSL). `go install github.com/hashicorp/consul@v1.16.3` cannot work: its
# go.mod replaces five submodules (api, sdk, proto-public, envoyextensions, troubleshoot)
# with local folders that the module zip does not contain. So we:
#   1. download the module, copy it to a writable temporary folder;
#   2. inside it, download each replaced submodule at the version its go.mod requires
#      (inside the module, so the checksum database and go.sum verify them) and copy it into
#      the folder its replace directive names;
#   3. go build.
# The binary is cached outside the repository (never commit it, nor Consul's source):
#   ${FENCEPROXY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fenceproxy}/consul-1.16.3/consul
# and reused while `consul version` says v1.16.3. Idempotent; instant when cached.
#
# Usage: scripts/build-consul.sh        (prints the binary's path on stdout, progress on stderr)
set -euo pipefail

version=1.16.3
module=github.com/hashicorp/consul
cache_root=${FENCEPROXY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fenceproxy}
dest_dir=$cache_root/consul-$version
dest=$dest_dir/consul

log() { printf 'build-consul: %s\n' "$*" >&2; }

is_good() {
	local out
	[[ -x $1 ]] && out=$("$1" version 2>/dev/null) && [[ ${out%%$'\n'*} == "Consul v$version" ]]
}

if is_good "$dest"; then
	printf '%s\n' "$dest"
	exit 0
fi

command -v go >/dev/null || { log "go is not on PATH"; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/fenceproxy-consul.XXXXXX")
cleanup() {
	# The module cache copies are read-only; make them removable first.
	chmod -R u+w "$work" 2>/dev/null || true
	rm -rf "$work"
}
trap cleanup EXIT

# Run the go tool outside any enclosing module (this script may be called from the repo).
export GOFLAGS="${GOFLAGS:-} -buildvcs=false"
export GOWORK=off

# dir_of MODULE@VERSION: downloads it (verified against go.sum / the checksum database)
# and prints its folder in the module cache. Parsed with sed so that no jq is needed.
dir_of() {
	go mod download -json "$1" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p'
}

start=$SECONDS
log "downloading $module@v$version"
src=$(cd "$work" && dir_of "$module@v$version")
[[ -n $src && -f $src/go.mod ]] || { log "download of $module@v$version failed"; exit 1; }

tree=$work/consul
cp -R "$src" "$tree"
chmod -R u+w "$tree"

# Replace directives that point at local folders, as "OLD ./dir" lines. go mod edit -print
# gives the canonical layout whatever the file's formatting; awk saves needing jq.
# gomod_entries KEYWORD: prints the entries of KEYWORD's lines (block or single-line form).
gomod_entries() {
	(cd "$tree" && go mod edit -print) | awk -v kw="$1" '
		$1 == kw && $2 == "(" { inblock = 1; next }
		inblock && $1 == ")" { inblock = 0; next }
		inblock { print; next }
		$1 == kw { $1 = ""; print }'
}
mapfile -t replaces < <(gomod_entries replace |
	awk '{ for (i = 1; i < NF; i++) if ($i == "=>" && $(i+1) ~ /^\.\.?\//) print $1, $(i+1) }')
((${#replaces[@]} > 0)) || { log "no local replace directives found in $module go.mod"; exit 1; }

# fetch_submodule OLD DIR: downloads OLD at the version the main module requires and copies
# it into DIR. Runs inside the module so that its go.sum is consulted before the checksum
# database.
fetch_submodule() {
	local path=$1 dir=${2#./} ver sub
	ver=$(gomod_entries require | awk -v p="$path" '$1 == p && !seen++ { print $2 }')
	[[ -n $ver ]] || { log "no required version for $path"; return 1; }
	sub=$(cd "$tree" && dir_of "$path@$ver" 2>/dev/null) || true
	[[ -n $sub && -f $sub/go.mod ]] || return 1
	log "copied $path@$ver into ./$dir"
	rm -rf "${tree:?}/$dir"
	cp -R "$sub" "$tree/$dir"
	chmod -R u+w "$tree/$dir"
}

# Some submodule versions are missing from the checksum database as served to us
# (envoyextensions v0.4.1 answers 404). Their hashes are, however, recorded in the go.sum of
# sibling submodules that did verify (troubleshoot's go.sum lists envoyextensions), so a
# failed one is retried after those go.sum lines are added to the main module's go.sum:
# the go tool then verifies the download against them instead of asking the database.
pending=()
for r in "${replaces[@]}"; do
	fetch_submodule ${r} || pending+=("$r")
done
for r in "${pending[@]}"; do
	path=${r%% *}
	ver=$(gomod_entries require | awk -v p="$path" '$1 == p && !seen++ { print $2 }')
	lines=$(cat "$tree"/*/go.sum 2>/dev/null | awk -v p="$path" -v v="$ver" \
		'$1 == p && ($2 == v || $2 == v "/go.mod") && !seen[$0]++')
	if [[ -z $lines ]]; then
		log "cannot verify $path@$ver: not in the checksum database nor in any verified go.sum"
		exit 1
	fi
	log "verifying $path@$ver with the hashes recorded in a sibling submodule's go.sum"
	printf '%s\n' "$lines" >>"$tree/go.sum"
	fetch_submodule ${r} || { log "download of $path@$ver failed"; exit 1; }
done

log "building (takes 1.5 to 3 minutes on 2 cores)"
mkdir -p "$dest_dir"
# Build to a unique name and rename: several checkouts (or CI and a developer) may run this
# script at once, and a reader must never see a half-written binary.
out_dir=$(mktemp -d "$dest_dir/.build.XXXXXX")
if ! (cd "$tree" && go build -trimpath -o "$out_dir/consul" .); then
	rm -rf "$out_dir"
	exit 1
fi
mv -f "$out_dir/consul" "$dest"
rmdir "$out_dir"

if ! is_good "$dest"; then
	log "built binary does not report Consul v$version:"
	"$dest" version >&2 || true
	exit 1
fi
log "built in $((SECONDS - start)) s"
printf '%s\n' "$dest"
