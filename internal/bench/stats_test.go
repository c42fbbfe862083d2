package bench_test

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/bench"
)

func TestMedianAndPercentile(t *testing.T) {
	for _, tc := range []struct {
		xs   []float64
		want float64
	}{
		{[]float64{3}, 3},
		{[]float64{5, 1, 3}, 3},
		{[]float64{4, 1, 3, 2}, 2.5},
	} {
		if got := bench.Median(tc.xs); got != tc.want {
			t.Errorf("Median(%v) = %v, want %v", tc.xs, got, tc.want)
		}
	}
	if !math.IsNaN(bench.Median(nil)) {
		t.Error("Median(nil) is not NaN")
	}
	sorted := make([]float64, 200)
	for i := range sorted {
		sorted[i] = float64(i + 1)
	}
	if got := bench.Percentile(sorted, 99); got != 198 {
		t.Errorf("p99 of 1..200 = %v, want 198", got)
	}
	if got := bench.Percentile([]float64{7}, 99); got != 7 {
		t.Errorf("p99 of one value = %v, want 7", got)
	}
}

// pgbench 15's summaries: a throughput run, and a -C run with its connection time.
const (
	throughputOutput = `pgbench (15.18 (Debian 15.18-0+deb12u1))
transaction type: <builtin: select only>
scaling factor: 1
query mode: prepared
number of clients: 8
number of threads: 2
maximum number of tries: 1
duration: 5 s
number of transactions actually processed: 81234
number of failed transactions: 0 (0.000%)
latency average = 0.492 ms
initial connection time = 12.345 ms
tps = 16246.800000 (without initial connection time)
`
	connectOutput = `transaction type: <builtin: select only>
number of transactions actually processed: 512
number of failed transactions: 0 (0.000%)
latency average = 9.766 ms
average connection time = 8.123 ms
tps = 102.400000 (including reconnection times)
`
)

func TestParsePgbench(t *testing.T) {
	r, err := bench.ParsePgbench(throughputOutput)
	if err != nil {
		t.Fatal(err)
	}
	if r.TPS != 16246.8 || r.LatencyMs != 0.492 || r.Transactions != 81234 || r.Failed != 0 || !math.IsNaN(r.ConnectionMs) {
		t.Errorf("throughput run parsed as %+v", r)
	}
	r, err = bench.ParsePgbench(connectOutput)
	if err != nil {
		t.Fatal(err)
	}
	if r.TPS != 102.4 || r.ConnectionMs != 8.123 || r.Transactions != 512 {
		t.Errorf("connect run parsed as %+v", r)
	}
	if _, err := bench.ParsePgbench("number of transactions actually processed: 0\n"); !errors.Is(err, bench.ErrNoTransactions) {
		t.Errorf("a run without transactions: %v, want ErrNoTransactions", err)
	}
	for name, out := range map[string]string{
		"no tps":  "number of transactions actually processed: 12\n",
		"aborted": throughputOutput + "pgbench: error: client 3 aborted in command 1\n",
	} {
		if _, err := bench.ParsePgbench(out); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

func TestReadLatencyLog(t *testing.T) {
	prefix := filepath.Join(t.TempDir(), "txlog")
	// pgbench -l: client_id transaction_no time(us) script_no time_epoch time_us, one file
	// per thread.
	files := map[string]string{
		prefix + ".123":   "0 0 300 0 1700000000 1\n0 1 100 0 1700000000 2\n",
		prefix + ".123.1": "1 0 200 0 1700000000 3\n",
	}
	for name, text := range files {
		if err := os.WriteFile(name, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	lat, err := bench.ReadLatencyLog(prefix)
	if err != nil {
		t.Fatal(err)
	}
	if len(lat) != 3 || lat[0] != 100 || lat[2] != 300 || bench.Mean(lat) != 200 {
		t.Errorf("latencies %v", lat)
	}
}

func TestProcReaders(t *testing.T) {
	pid := os.Getpid()
	if _, err := bench.CPUTicks(pid, true); err != nil {
		t.Error(err)
	}
	if n, err := bench.ContextSwitches(pid); err != nil || n <= 0 {
		t.Errorf("context switches %d, %v", n, err)
	}
	if n, err := bench.StatusKiB(pid, "VmRSS"); err != nil || n <= 0 {
		t.Errorf("VmRSS %d, %v", n, err)
	}
	if busy, idle, err := bench.MachineTicks(); err != nil || busy+idle <= 0 {
		t.Errorf("machine ticks %d %d, %v", busy, idle, err)
	}
	if _, err := bench.TreeTicks(pid); err != nil {
		t.Error(err)
	}
}

func TestConfigValidate(t *testing.T) {
	good := func() bench.Config {
		return bench.Config{Rounds: 1, Seconds: 1, Clients: []int{1, 8}, Threads: 2, Scale: 1,
			Protocols: []string{"simple"}, Workloads: []string{"select-only"}, Targets: []string{bench.Direct},
			ConnectClients: 1, RaiseSamples: 1}
	}
	if c := good(); c.Validate() != nil {
		t.Fatalf("good config: %v", c.Validate())
	}
	for name, change := range map[string]func(*bench.Config){
		"clients not a multiple of threads": func(c *bench.Config) { c.Clients = []int{3} },
		"unknown protocol":                  func(c *bench.Config) { c.Protocols = []string{"binary"} },
		"direct-bind outside connect":       func(c *bench.Config) { c.Targets = []string{bench.DirectBind} },
		"no rounds":                         func(c *bench.Config) { c.Rounds = 0 },
		"nothing to measure":                func(c *bench.Config) { c.Workloads = nil },
	} {
		c := good()
		change(&c)
		if c.Validate() == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

func TestRowsRatiosAndAdded(t *testing.T) {
	cfg := bench.Config{Rounds: 2, Clients: []int{1}, Protocols: []string{"simple"}, Workloads: []string{"select-only"},
		Targets: []string{bench.Direct, bench.PgBouncer, bench.Fenced}}
	cell := cfg.Cells()[0]
	sample := func(target string, round int, tps, latMean float64, midTicks int64) bench.Sample {
		s := bench.Sample{Cell: cell, Target: target, Round: round, MiddlemanTicks: midTicks, PostgresTicks: 100,
			LatMeanUs: latMean, LatP99Us: 2 * latMean, Syscalls: 4000, Switches: 1000}
		s.TPS, s.Transactions = tps, 1000
		return s
	}
	res := &bench.Result{Config: cfg, Samples: []bench.Sample{
		sample(bench.Direct, 1, 1000, 100, 0), sample(bench.Direct, 2, 1200, 120, 0),
		sample(bench.PgBouncer, 1, 800, 150, 10), sample(bench.PgBouncer, 2, 900, 160, 20),
		sample(bench.Fenced, 1, 700, 170, 30), sample(bench.Fenced, 2, 750, 190, 30),
	}}
	rows := map[string]bench.Row{}
	for _, r := range res.Rows() {
		rows[r.Measure] = r
	}
	if got := rows[bench.MeasureTPS].Values; got[bench.Direct] != 1100 || got[bench.PgBouncer] != 850 || got[bench.Fenced] != 725 {
		t.Errorf("TPS medians %v", got)
	}
	if got := rows[bench.MeasureAddedMean].Values; got[bench.Fenced] != 70 || got[bench.PgBouncer] != 45 {
		t.Errorf("added mean latency %v", got)
	}
	// 30 ticks of 10 ms over 1000 transactions: 300 us each.
	if got := rows[bench.MeasureMiddleman].Values; got[bench.Fenced] != 300 || got[bench.PgBouncer] != 150 {
		t.Errorf("middleman CPU %v", got)
	}
	if _, ok := rows[bench.MeasureMiddleman].Values[bench.Direct]; ok {
		t.Error("direct has a middleman CPU figure")
	}
	if got := rows[bench.MeasureSyscalls].Values[bench.Fenced]; got != 4 {
		t.Errorf("syscalls/tx %v", got)
	}
}
