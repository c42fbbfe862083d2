# Shell helpers shared by scripts/deps.sh and scripts/driver-suites.sh:
# sourced, not run. The sourcing
# script sets `prog`, the prefix of its messages, first.

say() { printf '%s: %s\n' "$prog" "$*"; }
die() {
	printf '%s: FAILED: %s\n' "$prog" "$*" >&2
	exit 1
}

# as_root COMMAND...: runs COMMAND as root (directly, or through sudo).
as_root() {
	if [[ $(id -u) == 0 ]]; then
		"$@"
	elif command -v sudo >/dev/null; then
		sudo "$@"
	else
		die "need root (or sudo) to run: $*"
	fi
}

# wait_for DESCRIPTION SECONDS COMMAND...: polls COMMAND until it succeeds.
wait_for() {
	local what=$1 limit=$2 deadline
	shift 2
	deadline=$((SECONDS + limit))
	until "$@"; do
		((SECONDS < deadline)) || die "timed out after ${limit}s waiting for $what"
		sleep 0.05
	done
}

# listening PORT: whether something accepts connections on 127.0.0.1:PORT.
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# free_port VAR: sets VAR to a port on 127.0.0.1 that nothing listens on and that this script
# has not handed out before.
declare -A taken=()
free_port() {
	local port
	for _ in $(seq 100); do
		port=$((20000 + RANDOM % 12000))
		[[ -z ${taken[$port]:-} ]] || continue
		if ! listening "$port"; then
			taken[$port]=1
			printf -v "$1" %s "$port"
			return
		fi
	done
	die "no free port found"
}
