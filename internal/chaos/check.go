package chaos

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/history"
)

func (e *env) fail(r int, what string) {
	msg := fmt.Sprintf("round %d: %s", r, what)
	e.logf("chaos: FAILED %s", msg)
	e.res.Failures = append(e.res.Failures, msg)
}

// checkBackends fails the round when a backend outlived what it served: one still bound to
// a token lower than the stored one (the raise must have ended it before committing), or
// more application backends than live workers to hold them (a leak) once the round settled.
func (e *env) checkBackends(r int) {
	deadline := time.Now().Add(15 * time.Second)
	for {
		var stale, app int
		var detail string
		err := e.tryAdmin(func(ctx context.Context, c *pgx.Conn) error {
			err := c.QueryRow(ctx, `
				SELECT count(*) FROM fence.bindings AS b
				JOIN pg_stat_get_activity(NULL) AS a ON a.pid = b.pid AND a.backend_start = b.backend_start
				WHERE b.resource = $1 AND b.token < (SELECT t.token FROM fence.tokens AS t WHERE t.resource = $1)`,
				resource).Scan(&stale)
			if err != nil {
				return err
			}
			return c.QueryRow(ctx, `SELECT count(*), coalesce(string_agg(pid || ' ' || state || ' ' || left(query, 40), '; '), '')
				FROM pg_stat_activity WHERE usename = $1`, appRole).Scan(&app, &detail)
		})
		if err != nil {
			e.fail(r, "backends: "+err.Error())
			return
		}
		if stale > 0 {
			// Never a wait: the raise committed only after they had exited.
			e.fail(r, fmt.Sprintf("leaked backend: %d live backends bound to a token lower than the stored one", stale))
			return
		}
		workers := len(e.workers())
		if app <= workers {
			return
		}
		if time.Now().After(deadline) {
			e.fail(r, fmt.Sprintf("leaked backend: %d application backends for %d live workers 15 s after the round: %s", app, workers, detail))
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// activity describes the server's sessions, for a hang's report.
func (e *env) activity() string {
	var out string
	_ = e.tryAdmin(func(ctx context.Context, c *pgx.Conn) error {
		return c.QueryRow(ctx, `SELECT coalesce(string_agg(pid || ' ' || usename || ' ' || coalesce(state, '') || ' ' || left(query, 60), '; '), 'no sessions')
			FROM pg_stat_activity WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()`).Scan(&out)
	})
	return "sessions: " + out + fmt.Sprintf("; workers %v", e.workers())
}

// collect reads the round's history (the decoding slot, the outcome files), checks the
// whole history so far, and fails the round for each new violation.
func (e *env) collect(r int) {
	if err := e.tryAdmin(func(ctx context.Context, c *pgx.Conn) error { return e.dec.read(ctx, c) }); err != nil {
		e.fail(r, "history: read the decoding slot: "+err.Error())
		return
	}
	outcomes, err := e.outcomes()
	if err != nil {
		e.fail(r, "history: "+err.Error())
		return
	}
	// Writes lost with a failed-over primary (decode.go): an acknowledged attempt among them
	// is a lost acknowledged write, which an asynchronous standby allows (PostgreSQL's
	// documented trade-off, as synchronous_commit = off is; the proxies wait for the
	// standby's flush of raises only): excused there and counted, a violation otherwise.
	lost := map[string]bool{}
	for _, w := range e.dec.lost {
		lost[w.Attempt] = true
	}
	e.res.LostWrites, e.res.LostAcked = len(e.dec.lost), 0
	for _, o := range outcomes {
		if o.Result == history.Acked && lost[o.Attempt] {
			e.res.LostAcked++
		}
	}
	checked := outcomes
	if e.excuseLoss() {
		checked = slices.DeleteFunc(slices.Clone(outcomes), func(o history.Outcome) bool { return o.Result == history.Acked && lost[o.Attempt] })
	}
	h := history.History{Raises: e.dec.raises, Writes: e.dec.writes, Outcomes: checked, Required: e.required}
	vs := history.Check(h)
	e.res.StaleAcross = 0
	for _, v := range vs {
		if v.Kind == history.StaleCommit && era(v.Raise.Pos) < era(v.Writes[0].Pos) {
			e.res.StaleAcross++
		}
	}
	for _, v := range vs {
		if !e.reported[v.String()] {
			e.reported[v.String()] = true
			e.fail(r, "violation: "+v.String())
		}
	}
	e.res.Violations = vs
	e.res.Writes = len(e.dec.writes)
	e.res.Acked, e.res.Unknown, e.res.Rejected = 0, 0, 0
	clear(e.res.Refused)
	for _, o := range outcomes {
		switch {
		case o.Result == history.Acked:
			e.res.Acked++
		case o.Result == history.Unknown:
			e.res.Unknown++
		case o.SQLState == "ZF001":
			e.res.Rejected++
		case o.Result == history.Failed:
			code := o.SQLState
			if code == "" {
				code = "no SQLSTATE"
			}
			e.res.Refused[code]++
		}
	}
	e.failovers(outcomes)
}

func (e *env) outcomes() ([]history.Outcome, error) {
	var all []history.Outcome
	for i := range replicas {
		f, err := os.Open(e.outcomesFile(i))
		if os.IsNotExist(err) {
			continue
		}
		if err != nil {
			return nil, err
		}
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			var o history.Outcome
			if err := json.Unmarshal(sc.Bytes(), &o); err != nil {
				continue // a line cut by a kill
			}
			all = append(all, o)
		}
		f.Close()
	}
	return all, nil
}

// failovers measures, for each leader fault, the time to the first acknowledged commit
// under a higher token.
func (e *env) failovers(outcomes []history.Outcome) {
	acks := slices.DeleteFunc(slices.Clone(outcomes), func(o history.Outcome) bool { return o.Result != history.Acked })
	sort.Slice(acks, func(i, j int) bool { return acks[i].At.Before(acks[j].At) })
	clear(e.res.Failovers)
	for _, p := range e.probes {
		for _, a := range acks {
			if a.Token > p.token && a.At.After(p.at) {
				e.res.Failovers[p.kind] = append(e.res.Failovers[p.kind], a.At.Sub(p.at))
				break
			}
		}
	}
}

// excuseLoss: an acknowledged write lost with a failed-over asynchronous standby's primary
// is no violation.
func (e *env) excuseLoss() bool { return e.cfg.Standby == StandbyAsync && !e.cfg.ClaimNoLoss }

// Report is the campaign's figures, one per line.
func (r Result) Report() string {
	var b strings.Builder
	mode := "through fenceproxy (2 proxies)"
	if r.Config.Direct {
		mode = "straight to PostgreSQL (negative control: raises stored, nothing bound)"
	}
	switch {
	case r.Config.Standby == StandbySync:
		mode += ", a synchronous standby"
	case r.Config.Standby == StandbyAsync && r.Config.Direct:
		mode += ", an asynchronous standby nothing waits for"
	case r.Config.Standby == StandbyAsync:
		mode += ", an asynchronous standby (--failover-standbys slot:*)"
	}
	fmt.Fprintf(&b, "campaign: %s, seed %d, TTL %v, %d units a round, %v\n", mode, r.Config.Seed, r.Config.TTL, r.Config.Units, r.Elapsed.Round(time.Second))
	fmt.Fprintf(&b, "rounds: %d\n", r.Rounds)
	var kinds []string
	total := 0
	for k, n := range r.Faults {
		kinds = append(kinds, fmt.Sprintf("%s %d", k, n))
		if !strings.HasSuffix(k, " mid-transaction") { // a note on a fault counted already
			total += n
		}
	}
	sort.Strings(kinds)
	fmt.Fprintf(&b, "faults: %d (%s)\n", total, strings.Join(kinds, ", "))
	if len(r.Exited) > 0 {
		fmt.Fprintf(&b, "servers that exited with no fault stopping them (started again): %v\n", r.Exited)
	}
	if len(r.Skipped) > 0 {
		fmt.Fprintf(&b, "faults skipped (no leader at that moment): %v\n", r.Skipped)
	}
	fmt.Fprintf(&b, "writes committed: %d (acknowledged %d, outcome unknown %d)\n", r.Writes, r.Acked, r.Unknown)
	fmt.Fprintf(&b, "stale attempts rejected (ZF001): %d\n", r.Rejected)
	if len(r.Refused) > 0 {
		fmt.Fprintf(&b, "other errors (by SQLSTATE): %v\n", r.Refused)
	}
	n := history.Count(r.Violations)
	fmt.Fprintf(&b, "violations: %d (stale-commit %d, duplicate %d, missing %d, lost-ack %d)\n", len(r.Violations),
		n[history.StaleCommit], n[history.Duplicate], n[history.Missing], n[history.LostAck])
	fmt.Fprintf(&b, "round failures: %d\n", len(r.Failures))
	if r.Config.Standby != "" {
		pauses := "none"
		if len(r.FailoverPauses) > 0 {
			pauses = quantiles(r.FailoverPauses)
		}
		fmt.Fprintf(&b, "failovers (primary killed, standby promoted; kill to links open again): %s\n", pauses)
		excused := "violations"
		if r.Config.Standby == StandbyAsync && !r.Config.ClaimNoLoss {
			excused = "excused: an asynchronous standby"
		}
		fmt.Fprintf(&b, "writes lost with a failed-over primary: %d (acknowledged %d, %s); stale commits across a failover: %d\n",
			r.LostWrites, r.LostAcked, excused, r.StaleAcross)
	}
	var all []time.Duration
	var byKind []string
	for k, d := range r.Failovers {
		all = append(all, d...)
		byKind = append(byKind, k+" "+quantiles(d))
	}
	sort.Strings(byKind)
	if len(all) > 0 {
		fmt.Fprintf(&b, "failover (frozen or killed leader to the first commit of a higher token; Consul's bound 2 x TTL = %v): %s\n", 2*r.Config.TTL, quantiles(all))
		for _, k := range byKind {
			fmt.Fprintf(&b, "  %s\n", k)
		}
	} else {
		fmt.Fprintf(&b, "failover: none measured\n")
	}
	return b.String()
}

// quantiles is "n N, median M, p99 P, max X" of d.
func quantiles(d []time.Duration) string {
	d = slices.Clone(d)
	slices.Sort(d)
	q := func(p float64) time.Duration { return d[max(0, min(len(d)-1, int(math.Ceil(p*float64(len(d))))-1))] }
	return fmt.Sprintf("n %d, median %v, p99 %v, max %v", len(d), q(0.5).Round(time.Millisecond), q(0.99).Round(time.Millisecond), d[len(d)-1].Round(time.Millisecond))
}
