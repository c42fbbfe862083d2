package bench

import (
	"context"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// Row is one line of the table: a measure of a cell, the median of its rounds per target.
type Row struct {
	Cell    string
	Measure string
	Values  map[string]float64 // by target; a target without a value is absent
}

// columns are the table's targets, in this order when present, then its ratios: each the
// first target's value over the second's.
var (
	columns = []string{Fenced, Unfenced, PgBouncer, Direct, DirectBind}
	ratios  = [][2]string{{Fenced, PgBouncer}, {Unfenced, PgBouncer}, {Fenced, Direct}, {Unfenced, Direct}, {Fenced, Unfenced}}
	short   = map[string]string{Fenced: "f", Unfenced: "u", PgBouncer: "pgb", Direct: "dir"}
)

// The measures of a cell, as Rows names them.
const (
	MeasureTPS         = "TPS"
	MeasureConnection  = "connection ms"
	MeasureLatMean     = "latency mean us"
	MeasureLatP99      = "latency p99 us"
	MeasureAddedMean   = "added mean us"
	MeasureAddedP99    = "added p99 us"
	MeasureMiddleman   = "middleman CPU us/tx"
	MeasurePostgres    = "PostgreSQL CPU us/tx"
	MeasureSyscalls    = "syscalls/tx"
	MeasureSwitches    = "ctx switches/tx"
	MeasureIdle        = "KiB per session"
	MeasureRaise       = "raise ms"
	MeasurePlainRaise  = "connect ms, no raise"
	perTransactionUsec = 1e6 / ticksPerSecond
)

// Rows are the table of res: per cell TPS, (connect) connection time, (1 client) latency
// mean and p99 and what each target adds to direct's, the CPU per transaction of the
// middleman and of PostgreSQL, the middleman's system calls and context switches per
// transaction; then memory per idle session and the raise.
func (res *Result) Rows() []Row {
	var rows []Row
	cfg := &res.Config
	for _, cell := range cfg.Cells() {
		by := map[string][]Sample{}
		for _, s := range res.Samples {
			if s.Cell == cell && s.Err == nil {
				by[s.Target] = append(by[s.Target], s)
			}
		}
		med := func(measure string, f func(Sample) float64) Row {
			r := Row{Cell: cell.String(), Measure: measure, Values: map[string]float64{}}
			for _, t := range cfg.TargetsOf(cell) {
				var xs []float64
				for _, s := range by[t] {
					if v := f(s); !math.IsNaN(v) {
						xs = append(xs, v)
					}
				}
				if len(xs) > 0 {
					r.Values[t] = Median(xs)
				}
			}
			return r
		}
		perTx := func(ticks func(Sample) int64) func(Sample) float64 {
			return func(s Sample) float64 {
				if s.Transactions == 0 {
					return math.NaN()
				}
				return float64(ticks(s)) * perTransactionUsec / float64(s.Transactions)
			}
		}
		perTxCount := func(count func(Sample) float64) func(Sample) float64 {
			return func(s Sample) float64 {
				if s.Transactions == 0 {
					return math.NaN()
				}
				return count(s) / float64(s.Transactions)
			}
		}
		middle := func(v func(Sample) float64) func(Sample) float64 {
			return func(s Sample) float64 {
				if s.Target == Direct || s.Target == DirectBind {
					return math.NaN()
				}
				return v(s)
			}
		}
		rows = append(rows, med(MeasureTPS, func(s Sample) float64 { return s.TPS }))
		if cell.Workload == "connect" {
			rows = append(rows, med(MeasureConnection, func(s Sample) float64 { return s.ConnectionMs }))
		}
		if cell.Clients == 1 && cell.Workload != "connect" {
			mean := med(MeasureLatMean, func(s Sample) float64 { return s.LatMeanUs })
			p99 := med(MeasureLatP99, func(s Sample) float64 { return s.LatP99Us })
			rows = append(rows, mean, p99, added(mean, MeasureAddedMean), added(p99, MeasureAddedP99))
		}
		rows = append(rows,
			med(MeasureMiddleman, middle(perTx(func(s Sample) int64 { return s.MiddlemanTicks }))),
			med(MeasurePostgres, perTx(func(s Sample) int64 { return s.PostgresTicks })),
			med(MeasureSyscalls, middle(perTxCount(func(s Sample) float64 { return s.Syscalls }))),
			med(MeasureSwitches, middle(perTxCount(func(s Sample) float64 { return s.Switches }))))
	}
	if len(res.Idle) > 0 {
		r := Row{Cell: fmt.Sprintf("idle/%d sessions", res.Idle[0].Sessions), Measure: MeasureIdle, Values: map[string]float64{}}
		for _, i := range res.Idle {
			r.Values[i.Target] = i.PerSessionKiB()
		}
		rows = append(rows, r)
	}
	for _, n := range cfg.RaiseStale {
		var raise, plain []float64
		for _, s := range res.Raises {
			if s.Stale == n {
				raise, plain = append(raise, ms(s.Raise)), append(plain, ms(s.Plain))
			}
		}
		cell := fmt.Sprintf("raise/%d stale", n)
		if len(raise) > 0 {
			rows = append(rows,
				Row{Cell: cell, Measure: MeasureRaise, Values: map[string]float64{Fenced: Median(raise)}},
				Row{Cell: cell, Measure: MeasurePlainRaise, Values: map[string]float64{Fenced: Median(plain)}})
		}
	}
	return rows
}

// added is row minus its direct value, for every other target.
func added(row Row, measure string) Row {
	r := Row{Cell: row.Cell, Measure: measure, Values: map[string]float64{}}
	d, ok := row.Values[Direct]
	if !ok {
		return r
	}
	for t, v := range row.Values {
		if t != Direct {
			r.Values[t] = v - d
		}
	}
	return r
}

// Report prints res: its header, the table with its ratios, and the totals.
func (res *Result) Report(w io.Writer) {
	rows := res.Rows()
	var cols []string
	for _, c := range columns {
		for _, r := range rows {
			if _, ok := r.Values[c]; ok {
				cols = append(cols, c)
				break
			}
		}
	}
	var rats [][2]string
	for _, q := range ratios {
		if slices.Contains(cols, q[0]) && slices.Contains(cols, q[1]) {
			rats = append(rats, q)
		}
	}
	line := strings.Repeat("=", 120)
	fmt.Fprintln(w, line)
	for _, l := range res.Info {
		fmt.Fprintln(w, l)
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "%-26s %-21s", "cell", "measure (median)")
	for _, c := range cols {
		fmt.Fprintf(w, " %10s", c)
	}
	for _, q := range rats {
		fmt.Fprintf(w, " %7s", short[q[0]]+"/"+short[q[1]])
	}
	fmt.Fprintln(w)
	prev := ""
	for _, r := range rows {
		cell := r.Cell
		if cell == prev {
			cell = ""
		}
		prev = r.Cell
		fmt.Fprintf(w, "%-26s %-21s", cell, r.Measure)
		for _, c := range cols {
			if v, ok := r.Values[c]; ok {
				fmt.Fprintf(w, " %10s", number(v))
			} else {
				fmt.Fprintf(w, " %10s", "-")
			}
		}
		for _, q := range rats {
			a, okA := r.Values[q[0]]
			b, okB := r.Values[q[1]]
			if okA && okB && b != 0 && !math.IsNaN(a/b) {
				fmt.Fprintf(w, " %7.3f", a/b)
			} else {
				fmt.Fprintf(w, " %7s", "-")
			}
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Medians of the rounds. Ratios: f fenced, u unfenced (both fenceproxy), pgb PgBouncer (session mode), dir direct.")
	fmt.Fprintln(w, "latency: pgbench -l, every transaction of the 1-client runs; added: minus direct's. middleman: the proxy or")
	fmt.Fprintln(w, "pgbouncer process; PostgreSQL: the postmaster and all its processes; CPU from /proc/PID/stat, context")
	fmt.Fprintln(w, "switches from /proc/PID/task/*/status, system calls from perf stat (raw_syscalls) or /proc/PID/io.")
	if n := res.noisyCells(); n > 0 {
		fmt.Fprintf(w, "WARNING: in %d cell(s) the runs of a target differ by more than 30%%: the machine was busy; rerun on a\n"+
			"quiet machine, or with more rounds, before trusting the ratios to two digits.\n", n)
	}
	fmt.Fprintln(w)
	for _, l := range res.Footer {
		fmt.Fprintln(w, l)
	}
	fmt.Fprintln(w, line)
}

// number prints v with as many decimals as its size deserves.
func number(v float64) string {
	switch a := math.Abs(v); {
	case a >= 1000:
		return fmt.Sprintf("%.0f", v)
	case a >= 10:
		return fmt.Sprintf("%.1f", v)
	default:
		return fmt.Sprintf("%.2f", v)
	}
}

// noisyCells counts the cells and targets whose fastest run was more than 1.3 times their
// slowest.
func (res *Result) noisyCells() int {
	type key struct {
		cell   Cell
		target string
	}
	lo, hi := map[key]float64{}, map[key]float64{}
	for _, s := range res.Samples {
		if s.Err != nil || s.TPS <= 0 {
			continue
		}
		k := key{s.Cell, s.Target}
		if v, ok := lo[k]; !ok || s.TPS < v {
			lo[k] = s.TPS
		}
		hi[k] = max(hi[k], s.TPS)
	}
	n := 0
	for k, l := range lo {
		if hi[k]/l > 1.3 {
			n++
		}
	}
	return n
}

// info is the report's header: what ran, where, and how to run it again.
func (e *env) info() []string {
	commit := "unknown"
	if root, err := testenv.ModuleRoot(); err == nil {
		if out, err := exec.Command("git", "-C", root, "rev-parse", "--short", "HEAD").Output(); err == nil {
			commit = strings.TrimSpace(string(out))
			if st, err := exec.Command("git", "-C", root, "status", "--porcelain", "--untracked-files=no").Output(); err == nil && len(st) > 0 {
				commit += " (with uncommitted changes)"
			}
		}
	}
	cpu := "unknown CPU"
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		if m := regexp.MustCompile(`(?m)^model name\s*: (.*)$`).FindSubmatch(b); m != nil {
			cpu = string(m[1])
		}
	}
	kernel, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	version := func(argv ...string) string {
		out, err := exec.Command(argv[0], argv[1:]...).Output()
		if err != nil {
			return "unknown"
		}
		first, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
		return first
	}
	c := e.cfg
	run := fmt.Sprintf("-T %d", c.Seconds)
	if c.Transactions > 0 {
		run = fmt.Sprintf("-t %d", c.Transactions)
	}
	syscalls := "perf stat (every system call)"
	if !e.perf {
		syscalls = "/proc/PID/io syscr+syscw (read/write-family calls only: perf stat cannot count here)"
	}
	lines := []string{
		fmt.Sprintf("fenceproxy benchmark  %s  commit %s", time.Now().UTC().Format(time.RFC3339), commit),
		fmt.Sprintf("machine: %d CPU(s), %s, Linux %s", runtime.NumCPU(), cpu, strings.TrimSpace(string(kernel))),
		fmt.Sprintf("%s, fsync=%t, max_connections=%d, shared_buffers=256MB; pgbench -c %v -j %d %s (connect: -C -S -c %d), scale %d, %d round(s), interleaved",
			version(e.pg.Bin("postgres"), "--version"), c.Fsync, c.maxConnections(), c.Clients, c.Threads, run, c.ConnectClients, c.Scale, c.Rounds),
		fmt.Sprintf("targets over TCP 127.0.0.1; fenced = fenceproxy with PGOPTIONS='%s'; unfenced = fenceproxy, no token", fenceOptions),
		"system calls: " + syscalls,
	}
	if e.bouncer != nil {
		lines = append(lines, "pgbouncer: "+version("pgbouncer", "--version")+", session mode")
	}
	return append(lines, "reproduce (from the repository root): "+c.Flags())
}

// footer are the totals after the rounds: the middlemen's memory and CPU over the whole run,
// what the bindings table holds, the proxy's log, the load.
func (e *env) footer(ctx context.Context, loadStart string, measured time.Duration) []string {
	var lines []string
	pid := e.proxy.Pid()
	hwm, _ := StatusKiB(pid, "VmHWM")
	rss, _ := StatusKiB(pid, "VmRSS")
	threads, _ := ThreadCount(pid)
	cpu, _ := CPUTicks(pid, false)
	lines = append(lines, fmt.Sprintf("fenceproxy: peak RSS (VmHWM) %.1f MiB, RSS at end %.1f MiB, %d threads, CPU time %.1f s (whole run)",
		float64(hwm)/1024, float64(rss)/1024, threads, float64(cpu)/ticksPerSecond))
	if e.bouncer != nil {
		bpid := e.bouncer.Pid()
		bhwm, _ := StatusKiB(bpid, "VmHWM")
		bcpu, _ := CPUTicks(bpid, false)
		lines = append(lines, fmt.Sprintf("pgbouncer:  peak RSS (VmHWM) %.1f MiB, CPU time %.1f s", float64(bhwm)/1024, float64(bcpu)/ticksPerSecond))
	}
	var bindings int64
	if err := e.admin.QueryRow(ctx, "SELECT count(*) FROM fence.bindings WHERE resource = $1", resource).Scan(&bindings); err == nil {
		lines = append(lines, fmt.Sprintf("fence.bindings: %d row(s) of resource %s at the end (a row leaves when its pid is bound again, "+
			"at the next raise, or when a bind sweeps the rows of exited backends)", bindings, resource))
	}
	if log, err := os.ReadFile(e.proxy.LogFile); err == nil {
		n := len(regexp.MustCompile(`(?m)\b(WARN|ERROR|DPANIC|PANIC|FATAL)\b`).FindAll(log, -1))
		lines = append(lines, fmt.Sprintf("fenceproxy log: %d line(s) at warn or above", n))
	}
	return append(lines,
		fmt.Sprintf("load average (1, 5, 15 min) at the start: %s; at the end: %s (%d CPU(s))", loadStart, loadAverage(), runtime.NumCPU()),
		fmt.Sprintf("measured in %s (warm-up included)", measured.Round(time.Second)))
}
