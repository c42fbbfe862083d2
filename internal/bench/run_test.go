package bench_test

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/bench"
)

// TestRunQuick runs the benchmark at its smallest against the real servers and pgbench, and
// checks that it produced every row of its table with a figure for every target. It never
// looks at a figure's size: speed is the benchmark's business, not a test's.
func TestRunQuick(t *testing.T) {
	// One cell per workload and a figure of every kind: the cross product of protocols and
	// client counts adds only more of the same rows (and time: under 30 s on a loaded CI).
	cfg := bench.Config{
		Rounds: 1, Transactions: 3, Clients: []int{1}, Threads: 2, Scale: 1,
		Protocols: []string{"prepared"}, Workloads: []string{"select-only", "read-write", "connect"},
		Targets:        []string{bench.Direct, bench.Unfenced, bench.PgBouncer, bench.Fenced},
		ConnectClients: 1, ConnectTargets: []string{bench.Direct, bench.DirectBind, bench.Unfenced, bench.PgBouncer, bench.Fenced},
		RaiseStale: []int{1}, RaiseSamples: 1,
		IdleSessions: 4, IdleTargets: []string{bench.Unfenced, bench.Fenced, bench.PgBouncer},
		// perf attached to runs of a few milliseconds may count nothing; /proc always can.
		Perf: false,
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	var progress bytes.Buffer
	res, err := bench.Run(ctx, cfg, &progress)
	if err != nil {
		t.Fatalf("Run: %v\nits output:\n%s", err, progress.String())
	}

	type key struct{ cell, measure string }
	rows := map[key]bench.Row{}
	for _, r := range res.Rows() {
		rows[key{r.Cell, r.Measure}] = r
	}
	want := func(cell, measure string, targets ...string) {
		t.Helper()
		r, ok := rows[key{cell, measure}]
		if !ok {
			t.Errorf("no row %s %s", cell, measure)
			return
		}
		for _, target := range targets {
			if _, ok := r.Values[target]; !ok {
				t.Errorf("row %s %s: no figure for %s (%v)", cell, measure, target, r.Values)
			}
		}
	}
	middlemen := []string{bench.Unfenced, bench.PgBouncer, bench.Fenced}
	for _, cell := range cfg.Cells() {
		c := cell.String()
		targets := cfg.TargetsOf(cell)
		want(c, bench.MeasureTPS, targets...)
		want(c, bench.MeasurePostgres, targets...)
		want(c, bench.MeasureMiddleman, middlemen...)
		want(c, bench.MeasureSyscalls, middlemen...)
		want(c, bench.MeasureSwitches, middlemen...)
		if cell.Workload == "connect" {
			want(c, bench.MeasureConnection, targets...)
		}
		if cell.Clients == 1 && cell.Workload != "connect" {
			want(c, bench.MeasureLatMean, targets...)
			want(c, bench.MeasureLatP99, targets...)
			want(c, bench.MeasureAddedMean, middlemen...)
		}
	}
	want("idle/4 sessions", bench.MeasureIdle, cfg.IdleTargets...)
	for _, n := range cfg.RaiseStale {
		want(fmt.Sprintf("raise/%d stale", n), bench.MeasureRaise, bench.Fenced)
	}

	var report bytes.Buffer
	res.Report(&report)
	for _, s := range []string{"f/pgb", "u/dir", "read-write/prepared/c1", "connect/simple", "reproduce"} {
		if !strings.Contains(report.String(), s) {
			t.Errorf("the report has no %q:\n%s", s, report.String())
		}
	}
	if t.Failed() {
		t.Logf("report:\n%s", report.String())
	}
}
