#!/usr/bin/env bash
# Verifies model/fence.pml with Spin: the real model must PASS, every mutant must FAIL with a
# trail of the expected kind. Prints states stored, depth reached and seconds for each run.
#   model/verify.sh quick   the bounded configuration of `make test`
#   model/verify.sh full    every configuration (`make model`)
# Needs spin (Debian package spin, scripts/deps.sh) and gcc.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-quick}
command -v spin >/dev/null || { echo "model: spin is not installed (scripts/deps.sh installs it)" >&2; exit 1; }
bash model/check-names.sh

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail=0

# run <name> <expect PASS|FAIL> <kind safety|progress> <error to expect> <spin -D flags...>
run() {
	local name=$1 expect=$2 kind=$3 want=$4; shift 4
	local d="$work/$name" cc pan out result
	mkdir -p "$d"; cp model/fence.pml "$d/"
	if [ "$kind" = progress ]; then
		cc=(-DCOLLAPSE -DNFAIR=3); pan=(-a -f -m400000 -w24); set -- -DPROGRESS "$@"
	else
		cc=(-DNOCLAIM -DCOLLAPSE); pan=(-m400000 -w24)
	fi
	(cd "$d" && spin "$@" -a fence.pml >spin.out 2>&1 && gcc -O2 -w "${cc[@]}" -o pan pan.c) || {
		echo "model: $name: spin or gcc failed:" >&2; cat "$d/spin.out" >&2; fail=1; return; }
	out=$(cd "$d" && ./pan "${pan[@]}" 2>&1) || true
	local states depth secs errors
	states=$(sed -n 's/^ *\([0-9.e+]*\) states, stored.*/\1/p' <<<"$out" | head -1)
	depth=$(sed -n 's/.*depth reached \([0-9]*\).*/\1/p' <<<"$out" | head -1)
	errors=$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' <<<"$out" | head -1)
	secs=$(sed -n 's/^pan: elapsed time \([0-9.e+-]*\) .*/\1/p' <<<"$out" | head -1)
	if grep -q 'max search depth too small' <<<"$out"; then
		result="INCOMPLETE (depth bound)"
	elif [ "$errors" = 0 ]; then
		result=PASS
	elif [ -f "$d/fence.pml.trail" ] && grep -q "$want" <<<"$out"; then
		result="FAIL ($(grep -m1 '^pan:1:' <<<"$out" | sed 's/^pan:1: //'))"
	else
		result="ERROR ($(grep -m1 '^pan:1:' <<<"$out" || echo "no trail"))"
	fi
	local ok=no
	case "$expect:$result" in PASS:PASS|FAIL:FAIL*) ok=yes ;; esac
	[ $ok = yes ] || fail=1
	printf '%-32s %-9s expect %-4s %-62s states %-9s depth %-5s %ss  spin %s\n' \
		"$name" "$kind" "$expect" "$result" "${states:-?}" "${depth:-?}" "${secs:-?}" "$*"
}

echo "model: $mode verification of model/fence.pml ($(spin -V | head -1))"
# The real model: safety (both assertions, no invalid end state) and progress.
run real-external-async     PASS safety   - 
run real-lease-async        PASS safety   - -DLEASE
run real-lease-async        PASS progress - -DLEASE
# The negative controls.
run mut-early-commit        FAIL safety   'assertion violated' -DMUT_EARLY_COMMIT
run mut-v1-check            FAIL safety   'assertion violated' -DMUT_V1
run mut-ack-local           FAIL safety   'assertion violated' -DMUT_ACK_LOCAL
run mut-no-rowlock          FAIL safety   'assertion violated' -DMUT_NO_ROWLOCK
run mut-lease-reissue       FAIL safety   'assertion violated' -DLEASE -DMUT_LEASE_REISSUE
run mut-proxy-cache         FAIL progress 'acceptance cycle'   -DLEASE -DMUT_PROXY_CACHE
# D3: a synchronous standby's commit wait cancelled (the proxy's login timeout, any cancel)
run mut-ignore-sync-warning FAIL safety   'assertion violated' -DSYNC -DMUT_IGNORE_SYNC_WARNING
run mut-nonraising-async    FAIL safety   'assertion violated' -DSYNC -DMUT_NONRAISING_ASYNC
if [ "$mode" = full ]; then
	run real-external-sync      PASS safety   - -DSYNC
	run real-lease-sync         PASS safety   - -DLEASE -DSYNC
	run real-external-async     PASS progress -
	run real-external-sync      PASS progress - -DSYNC
	run real-lease-sync         PASS progress - -DLEASE -DSYNC
	run mut-ack-local-sync      FAIL safety   'assertion violated' -DSYNC -DMUT_ACK_LOCAL
	# the lease answered before the standby has it, holder check kept: no two holders, but
	# the generation goes back below an admitted one (S1)
	run mut-ack-local-lease     FAIL safety   'assertion violated' -DLEASE -DMUT_ACK_LOCAL
	# What each defence answers: without a failover the local acknowledgement, the lease's
	# re-issue and D3's two holes are harmless.
	run ctl-ack-local-nofailover    PASS safety - -DMUT_ACK_LOCAL -DNOFAILOVER
	run ctl-reissue-nofailover      PASS safety - -DLEASE -DMUT_LEASE_REISSUE -DNOFAILOVER
	run ctl-ignore-warning-nofailover   PASS safety - -DSYNC -DMUT_IGNORE_SYNC_WARNING -DNOFAILOVER
	run ctl-nonraising-async-nofailover PASS safety - -DSYNC -DMUT_NONRAISING_ASYNC -DNOFAILOVER
	run real-external-noregression  PASS safety - -DNOREGRESSION
fi
if [ $fail != 0 ]; then
	echo "model: FAILED (a real configuration failed or a mutant passed)" >&2
	exit 1
fi
echo "model: ok (real model passes, every mutant fails with a trail)"
