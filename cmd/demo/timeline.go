package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
)

// event is one line of a run's timeline: a billing event (logfmt on the program's stdout),
// one of the demo's own, or one drawn from fenceproxy's and fenceproxy lock's logs.
type event struct {
	at time.Time
	kv map[string]string // replica, token, event, and the event's own keys
}

// readEvents reads the billing events of a log: the lines that start with "time=". The
// supervisor's own lines and testenv's start markers share the file and are skipped.
func readEvents(path string) ([]event, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var evs []event
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "time=") {
			continue
		}
		kv := parseLogfmt(line)
		at, err := time.Parse(time.RFC3339Nano, kv["time"])
		if err != nil {
			continue // a line cut short by a kill
		}
		evs = append(evs, event{at: at, kv: kv})
	}
	return evs, sc.Err()
}

// parseLogfmt reads key=value pairs; a value may be "quoted" with backslash escapes.
func parseLogfmt(s string) map[string]string {
	kv := map[string]string{}
	for {
		s = strings.TrimLeft(s, " ")
		k, rest, ok := strings.Cut(s, "=")
		if !ok || k == "" {
			return kv
		}
		s = rest
		if strings.HasPrefix(s, `"`) {
			var b strings.Builder
			i := 1
			for ; i < len(s); i++ {
				c := s[i]
				if c == '\\' && i+1 < len(s) {
					i++
					switch s[i] {
					case 'n':
						b.WriteByte(' ')
					default:
						b.WriteByte(s[i])
					}
					continue
				}
				if c == '"' {
					i++
					break
				}
				b.WriteByte(c)
			}
			kv[k] = b.String()
			s = s[min(i, len(s)):]
			continue
		}
		v, rest, _ := strings.Cut(s, " ")
		kv[k] = v
		s = rest
	}
}

// logEvents turns the lines of fenceproxy's and fenceproxy lock's console logs (time, level,
// message, fields as JSON, separated by tabs) that the timeline shows into events of who.
func logEvents(path, who string) []event {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	var evs []event
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		fields := strings.Split(sc.Text(), "\t")
		if len(fields) < 3 {
			continue
		}
		at, err := parseLogTime(fields[0])
		if err != nil {
			continue
		}
		var name string
		for _, m := range fields[1:] {
			switch {
			case strings.HasPrefix(m, "lost leadership"):
				name = "lost"
			case strings.HasPrefix(m, "raised token"):
				name = "raised"
			case strings.HasPrefix(m, "ending stale session"):
				name = "stale"
			}
		}
		if name == "" {
			continue
		}
		var attrs map[string]any
		_ = json.Unmarshal([]byte(fields[len(fields)-1]), &attrs)
		kv := map[string]string{"replica": who, "event": name, "token": jsonNumber(attrs["token"]), "admitted": jsonNumber(attrs["admitted"])}
		evs = append(evs, event{at: at, kv: kv})
	}
	return evs
}

func parseLogTime(s string) (time.Time, error) {
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	return time.Parse("2006-01-02T15:04:05.000Z0700", s)
}

func jsonNumber(v any) string {
	if f, ok := v.(float64); ok {
		return strconv.FormatFloat(f, 'f', -1, 64)
	}
	return "-"
}

// render prints the events in time order, one line each; consecutive charges by the same
// leader and token fold into one line, and a customer charged a second time is called out.
func render(w io.Writer, evs []event) {
	slices.SortStableFunc(evs, func(a, b event) int { return a.at.Compare(b.at) })
	fmt.Fprintf(w, "  %9s  %-10s %-9s %s\n", "time", "who", "", "what")
	if len(evs) == 0 {
		return
	}
	t0 := evs[0].at
	out := func(at time.Time, who, token, text string) {
		label := ""
		if token != "" && token != "-" {
			label = "token " + token
		}
		fmt.Fprintf(w, "  %8.3fs  %-10s %-9s %s\n", at.Sub(t0).Seconds(), who, label, text)
	}
	first := map[string]string{} // customer -> who charged it first
	var run struct {
		at         time.Time
		who, token string
		customers  []int
	}
	flush := func() {
		if len(run.customers) > 0 {
			plural := " "
			if len(run.customers) > 1 {
				plural = "s "
			}
			out(run.at, run.who, run.token, "charged customer"+plural+ranges(run.customers))
		}
		run.customers = nil
	}
	for _, e := range evs {
		kv := e.kv
		who, token := kv["replica"], kv["token"]
		switch kv["event"] {
		case "charging":
			continue
		case "charged":
			c := kv["customer"]
			if by, ok := first[c]; ok {
				flush()
				out(e.at, who, token, "charged customer "+c+" AGAIN: DUPLICATE (first charged by "+by+")")
				continue
			}
			first[c] = who + " with token " + token
			if len(run.customers) > 0 && (run.who != who || run.token != token) {
				flush()
			}
			if len(run.customers) == 0 {
				run.at, run.who, run.token = e.at, who, token
			}
			n, _ := strconv.Atoi(c)
			run.customers = append(run.customers, n)
			continue
		}
		flush()
		if kv["event"] == "raised" || kv["event"] == "stale" {
			token = "" // the proxy's line: the token is in its text
		}
		out(e.at, who, token, describe(kv))
	}
	flush()
}

// describe is the timeline's text for an event other than a charge.
func describe(kv map[string]string) string {
	switch kv["event"] {
	case "started":
		return "acquired the lock with token " + kv["token"] + ": billing starts (pid " + kv["pid"] + ")"
	case "rejected":
		return "REJECTED: customer " + kv["customer"] + ", " + kv["step"] + ": " + kv["sqlstate"] + " " + kv["message"]
	case "error":
		s := "error: "
		if kv["customer"] != "" {
			s += "customer " + kv["customer"] + ", "
		}
		s += kv["step"] + ": "
		if kv["sqlstate"] != "" {
			s += kv["sqlstate"] + " "
		}
		return s + kv["message"]
	case "stopped":
		return "stopped by a signal after " + kv["charged"] + " charge(s)"
	case "finished":
		return "nothing pending: finished after " + kv["charged"] + " charge(s)"
	case "lost":
		return "fenceproxy lock: lost the lock (its lease ended): SIGTERM to billing"
	case "raised":
		return "new lock holder in Consul: token " + kv["token"] + " raised in the database"
	case "stale":
		return "the session of token " + kv["token"] + " is stale (token " + kv["admitted"] + " admitted): its next statement will be refused"
	case "froze":
		return ">>> froze " + kv["who"] + " (SIGSTOP, process and child) with customer " + kv["customer"] + "'s charge not committed yet"
	case "thawed":
		return ">>> woke " + kv["who"] + " (SIGCONT) after " + kv["frozen_s"] + " s frozen; it still believes it leads"
	}
	return kv["event"]
}

// ranges turns 1 2 3 5 7 8 into "1-3, 5, 7-8".
func ranges(list []int) string {
	var parts []string
	for i := 0; i < len(list); {
		j := i
		for j+1 < len(list) && list[j+1] == list[j]+1 {
			j++
		}
		if i == j {
			parts = append(parts, strconv.Itoa(list[i]))
		} else {
			parts = append(parts, fmt.Sprintf("%d-%d", list[i], list[j]))
		}
		i = j + 1
	}
	return strings.Join(parts, ", ")
}
