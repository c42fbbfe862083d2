# Renders the demo's event lines (logfmt, sorted by time) as a readable timeline.
#
# Input: the billing program's events (one file per replica) and the demo script's own
# (froze, thawed), merged and sorted: sort works because every line starts with
# time=YYYY-MM-DDTHH:MM:SS.ffffffZ.
# Output: one line per event, consecutive charges by the same leader folded into one line,
# a customer charged a second time called out.
#
# POSIX awk (Debian's default is mawk): no gawk extensions.

# parse fills kv with the line's key=value pairs; values may be "quoted" with \ escapes.
function parse(s,    i, k, v, c) {
	split("", kv)
	while (length(s) > 0) {
		sub(/^ +/, "", s)
		i = index(s, "=")
		if (i == 0)
			break
		k = substr(s, 1, i - 1)
		s = substr(s, i + 1)
		if (substr(s, 1, 1) == "\"") {
			v = ""
			s = substr(s, 2)
			while (length(s) > 0) {
				c = substr(s, 1, 1)
				if (c == "\\") {
					c = substr(s, 2, 1)
					v = v (c == "n" ? " " : c)
					s = substr(s, 3)
					continue
				}
				s = substr(s, 2)
				if (c == "\"")
					break
				v = v c
			}
		} else {
			i = index(s, " ")
			if (i == 0) {
				v = s
				s = ""
			} else {
				v = substr(s, 1, i - 1)
				s = substr(s, i + 1)
			}
		}
		kv[k] = v
	}
}

# seconds since midnight UTC of an RFC 3339 UTC time (a day boundary adds a day).
function seconds(t,    d) {
	d = substr(t, 1, 10)
	if (day == "")
		day = d
	return (d != day ? 86400 : 0) + substr(t, 12, 2) * 3600 + substr(t, 15, 2) * 60 + substr(t, 18, 9)
}

function out(t, who, token, text) {
	printf "  %8.3fs  %-10s %-9s %s\n", seconds(t) - t0, who, (token == "" || token == "-" ? "" : "token " token), text
}

# ranges turns "1 2 3 5 7 8" into "1-3, 5, 7-8".
function ranges(list,    n, a, i, s, from) {
	n = split(list, a, " ")
	s = ""
	from = a[1]
	for (i = 1; i <= n; i++) {
		if (i < n && a[i + 1] == a[i] + 1)
			continue
		s = s (s == "" ? "" : ", ") (from == a[i] ? from : from "-" a[i])
		from = a[i + 1]
	}
	return s
}

function flush() {
	if (run_n > 0)
		out(run_t, run_who, run_token, "charged customer" (run_n > 1 ? "s " : " ") ranges(run_list))
	run_n = 0
	run_list = ""
}

BEGIN {
	printf "  %9s  %-10s %-9s %s\n", "time", "who", "", "what"
}

{
	parse($0)
	t = kv["time"]
	if (t0 == "")
		t0 = seconds(t)
	who = kv["replica"]
	token = kv["token"]
	ev = kv["event"]
	if (ev == "charging")
		next
	if (ev == "charged") {
		c = kv["customer"]
		if (c in first) {
			flush()
			out(t, who, token, "charged customer " c " AGAIN: DUPLICATE (first charged by " first[c] ")")
			next
		}
		first[c] = who " with token " token
		if (run_n > 0 && (run_who != who || run_token != token))
			flush()
		if (run_n == 0) {
			run_t = t
			run_who = who
			run_token = token
		}
		run_list = run_list (run_n > 0 ? " " : "") c
		run_n++
		next
	}
	flush()
	if (ev == "started")
		out(t, who, token, "acquired the lock with token " token ": billing starts (pid " kv["pid"] ")")
	else if (ev == "rejected")
		out(t, who, token, "REJECTED: customer " kv["customer"] ", " kv["step"] ": " kv["sqlstate"] " " kv["message"])
	else if (ev == "error")
		out(t, who, token, "error: " (kv["customer"] != "" ? "customer " kv["customer"] ", " : "") kv["step"] ": " (kv["sqlstate"] != "" ? kv["sqlstate"] " " : "") kv["message"])
	else if (ev == "stopped")
		out(t, who, token, "stopped by a signal after " kv["charged"] " charge(s)")
	else if (ev == "finished")
		out(t, who, token, "nothing pending: finished after " kv["charged"] " charge(s)")
	else if (ev == "lost")
		out(t, who, token, "fenceproxy lock: lost the lock (its lease ended): SIGTERM to billing")
	else if (ev == "raised")
		out(t, who, "", "new lock holder in Consul: token " token " raised in the database")
	else if (ev == "stale")
		out(t, who, "", "the session of token " token " is stale (token " kv["admitted"] " admitted): its next statement will be refused")
	else if (ev == "froze")
		out(t, "demo", "", ">>> froze " kv["who"] " (SIGSTOP, process and child) with customer " kv["customer"] "'s charge not committed yet")
	else if (ev == "thawed")
		out(t, "demo", "", ">>> woke " kv["who"] " (SIGCONT) after " kv["frozen_s"] " s frozen; it still believes it leads")
	else
		out(t, who, token, ev)
}

END {
	flush()
}
