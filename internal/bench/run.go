package bench

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// bindSQL is the connect cell's direct-bind script (see the file).
//
//go:embed bind.sql
var bindSQL []byte

const (
	// resource and token are the fenced target's: token 1 of resource bench, admitted once
	// and never raised, so every fenced session binds without a raise.
	resource = "bench"
	token    = 1
	// raiseResource is raised over and over by the raise measurement: a resource of its own.
	raiseResource = "raise"
	database      = "bench"
)

// Sample is one measured pgbench run of a cell against a target.
type Sample struct {
	Cell   Cell
	Target string
	Round  int
	Err    error // the run failed: no figure of it counts
	PgbenchResult
	MiddlemanTicks int64   // CPU of the proxy or pgbouncer during the run (0 for direct)
	PostgresTicks  int64   // CPU of the postmaster and all its processes during the run
	BusyTicks      int64   // the machine's busy time, all CPUs
	IdleTicks      int64   // the machine's idle time, all CPUs
	Syscalls       float64 // system calls of the middleman (NaN for direct)
	Switches       float64 // context switches of the middleman (NaN for direct)
	LatMeanUs      float64 // per-transaction log (1-client cells): mean, NaN otherwise
	LatP99Us       float64 // and 99th percentile
}

// IdleResult is the memory an idle session costs a middleman.
type IdleResult struct {
	Target            string
	Sessions          int
	BeforeKiB, AfterK int64
}

// PerSessionKiB is the resident set each idle session added.
func (r IdleResult) PerSessionKiB() float64 {
	return float64(r.AfterK-r.BeforeKiB) / float64(r.Sessions)
}

// env is a run's servers and what it needs to drive them.
type env struct {
	cfg     Config
	out     io.Writer
	work    string
	pg      *testenv.Postgres
	bouncer *testenv.PgBouncer
	proxy   *testenv.ProxyProcess
	admin   *pgx.Conn // the bench database, straight on PostgreSQL: preparation and checks
	perf    bool      // perf stat counts system calls
	bindSQL string    // path of bind.sql
	// allowance is the seconds a cell and target's -T gets for its clients' connections
	// (see pgbench), by "cell target".
	allowance map[string]int
}

// Result is everything a run measured.
type Result struct {
	Config  Config
	Samples []Sample
	Raises  []RaiseSample
	Idle    []IdleResult
	Info    []string // the header lines: machine, versions, commands
	Footer  []string // the proxy's and pgbouncer's totals, the load, the log
}

// Run starts PostgreSQL, pgbouncer and fenceproxy through testenv, runs every round of cfg,
// writes progress lines to out, and returns the measurements (Report prints them). It fails
// when a server cannot start; a failed run of a cell is in its Sample, and Run returns it
// joined with the others after measuring everything else.
func Run(ctx context.Context, cfg Config, out io.Writer) (*Result, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	res := &Result{Config: cfg}
	loadStart := loadAverage()
	e, err := setup(ctx, cfg, out)
	if e != nil {
		defer e.close()
	}
	if err != nil {
		return nil, err
	}
	started := time.Now()
	res.Info = e.info()
	for _, line := range res.Info {
		e.say("%s", line)
	}

	var failures []error
	if cfg.Warmup > 0 {
		e.say("warm-up: %d s per cell and target (not recorded)", cfg.Warmup)
		for _, cell := range cfg.Cells() {
			for _, t := range cfg.TargetsOf(cell) {
				e.pgbench(ctx, cell, t, 0, cfg.Warmup, 0)
			}
		}
	}
	e.say("measuring: %d round(s) of %d cell(s)", cfg.Rounds, len(cfg.Cells()))
	for r := 1; r <= cfg.Rounds; r++ {
		for _, cell := range cfg.Cells() {
			for _, t := range inRoundOrder(cfg.TargetsOf(cell), r) {
				if err := ctx.Err(); err != nil {
					return res, err
				}
				s := e.pgbench(ctx, cell, t, r, cfg.Seconds, cfg.Transactions)
				res.Samples = append(res.Samples, s)
				if s.Err != nil {
					failures = append(failures, fmt.Errorf("round %d, %s, %s: %w", r, cell, t, s.Err))
				}
			}
		}
		if len(cfg.RaiseStale) > 0 {
			raises, err := e.raise(ctx, r, inRoundOrder(cfg.RaiseStale, r))
			res.Raises = append(res.Raises, raises...)
			if err != nil {
				failures = append(failures, fmt.Errorf("round %d, raise: %w", r, err))
			}
		}
		if err := ctx.Err(); err != nil {
			return res, err
		}
	}
	if cfg.IdleSessions > 0 {
		for _, t := range cfg.IdleTargets {
			r, err := e.idle(ctx, t)
			if err != nil {
				failures = append(failures, fmt.Errorf("idle sessions through %s: %w", t, err))
				continue
			}
			e.say("idle: %s: %d sessions, %d KiB -> %d KiB: %.1f KiB per session", t, r.Sessions, r.BeforeKiB, r.AfterK, r.PerSessionKiB())
			res.Idle = append(res.Idle, r)
		}
	}
	res.Footer = e.footer(ctx, loadStart, time.Since(started))
	return res, errors.Join(failures...)
}

// inRoundOrder is list in its order in odd rounds and reversed in even ones (A B C, C B A,
// ...): no target always runs first or right after another one, so the machine's drift
// spreads over all of them.
func inRoundOrder[T any](list []T, round int) []T {
	list = slices.Clone(list)
	if round%2 == 0 {
		slices.Reverse(list)
	}
	return list
}

func (e *env) say(format string, args ...any) {
	fmt.Fprintf(e.out, "bench: "+format+"\n", args...)
}

// setup starts the servers. The env it returns, even with an error, must be closed.
func setup(ctx context.Context, cfg Config, out io.Writer) (*env, error) {
	work, err := os.MkdirTemp("", "fenceproxy-bench-")
	if err != nil {
		return nil, err
	}
	e := &env{cfg: cfg, out: out, work: work, allowance: map[string]int{}}
	bin := cfg.Bin
	if bin == "" {
		e.say("building fenceproxy")
		bins, err := testenv.BuildGoContext(ctx, work, "./cmd/fenceproxy")
		if err != nil {
			return e, err
		}
		bin = bins[0]
	}
	if _, err := exec.LookPath(filepath.Join(testenv.DefaultBinDir, "pgbench")); err != nil && os.Getenv("FENCEPROXY_PG_BINDIR") == "" {
		return e, fmt.Errorf("pgbench not found (%w): run `make deps`", err)
	}

	durability := "off"
	if cfg.Fsync {
		durability = "on"
	}
	e.pg, err = testenv.LaunchPostgres(ctx,
		testenv.WithConf("max_connections", strconv.Itoa(cfg.maxConnections())),
		testenv.WithConf("shared_buffers", "256MB"), testenv.WithConf("max_wal_size", "2GB"),
		testenv.WithConf("checkpoint_timeout", "30min"), testenv.WithConf("fsync", durability),
		testenv.WithConf("synchronous_commit", durability), testenv.WithConf("full_page_writes", durability))
	if err != nil {
		return e, err
	}
	e.say("PostgreSQL on %s:%d, max_connections %d, fsync %s", e.pg.Host, e.pg.Port, cfg.maxConnections(), durability)
	if err := e.pg.ExecContext(ctx, "CREATE DATABASE "+database); err != nil {
		return e, err
	}
	e.say("pgbench -i -s %d", cfg.Scale)
	if _, err := e.command(ctx, "pgbench-init", nil, e.pg.Bin("pgbench"), "-i", "-q", "-s", strconv.Itoa(cfg.Scale),
		"-h", e.pg.Host, "-p", strconv.Itoa(e.pg.Port), "-U", testenv.AdminUser, database); err != nil {
		return e, err
	}
	// migrate creates the key file (a random key) and stores the key in the database; the
	// proxy proves its binds and raises with it.
	keyFile := filepath.Join(work, "fenceproxy.key")
	if _, err := e.command(ctx, "migrate", nil, bin, "migrate", "--database", e.directURL(), "--key-file", keyFile); err != nil {
		return e, err
	}
	e.bindSQL = filepath.Join(work, "bind.sql")
	if err := os.WriteFile(e.bindSQL, bindSQL, 0o644); err != nil {
		return e, err
	}
	if e.admin, err = pgx.Connect(ctx, e.directURL()); err != nil {
		return e, err
	}

	// --control-database as in production: the proxy LISTENs for raises there (one
	// connection, idle during the runs).
	flags := append([]string{"--upstream", fmt.Sprintf("postgres://%s:%d", e.pg.Host, e.pg.Port),
		"--unfenced", "allow", "--resource", resource + "," + raiseResource, "--key-file", keyFile,
		"--control-database", e.directURL(), "--log-level", "warn"}, cfg.ProxyArgs...)
	if e.proxy, err = launchProxy(ctx, work, bin, cfg.ProxyEnv, flags); err != nil {
		return e, err
	}
	e.say("fenceproxy on %s", e.proxy.Addr())

	if cfg.uses(PgBouncer) {
		pool := max(20, slices.Max(append([]int{cfg.ConnectClients}, cfg.Clients...)), cfg.IdleSessions)
		if e.bouncer, err = testenv.LaunchPgBouncer(ctx, e.pg, database, testenv.PgBouncerOptions{PoolSize: pool}); err != nil {
			return e, err
		}
		e.say("pgbouncer on %s, session mode, pool %d", e.bouncer.Addr(), pool)
	}
	e.perf = cfg.Perf && perfWorks(ctx)
	return e, nil
}

// launchProxy is testenv.LaunchProxyProcess with an environment for the proxy.
func launchProxy(ctx context.Context, dir, bin string, vars, flags []string) (*testenv.ProxyProcess, error) {
	if len(vars) == 0 {
		return testenv.LaunchProxyProcess(ctx, dir, "fenceproxy", bin, flags...)
	}
	port, err := testenv.PickFreePort()
	if err != nil {
		return nil, err
	}
	argv := append([]string{bin, "serve", "--listen", "127.0.0.1:" + strconv.Itoa(port)}, flags...)
	proc, err := testenv.LaunchProcess(dir, "fenceproxy", argv, append(os.Environ(), vars...))
	if err != nil {
		return nil, err
	}
	p := &testenv.ProxyProcess{Process: proc, Host: "127.0.0.1", Port: port}
	if err := p.WaitListeningContext(ctx); err != nil {
		p.Close()
		return nil, err
	}
	return p, nil
}

func (e *env) close() {
	if e.admin != nil {
		e.admin.Close(context.Background())
	}
	if e.proxy != nil {
		e.proxy.Close()
	}
	if e.bouncer != nil {
		e.bouncer.Close()
	}
	if e.pg != nil {
		if err := e.pg.Close(); err != nil {
			e.say("stop PostgreSQL: %v", err)
		}
	}
	if e.cfg.Keep {
		e.say("kept %s", e.work)
		return
	}
	_ = os.RemoveAll(e.work)
}

func (e *env) directURL() string { return e.pg.URL(testenv.AdminUser, database) }

// command runs argv to its end with its output in work/name.log, and returns the output.
func (e *env) command(ctx context.Context, name string, vars []string, argv ...string) (string, error) {
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Dir = e.work
	// PG* variables of the caller must not reach pgbench (PGOPTIONS is the fenced target's).
	cmd.Env = slices.DeleteFunc(os.Environ(), func(v string) bool { return strings.HasPrefix(v, "PG") })
	cmd.Env = append(cmd.Env, vars...)
	cmd.WaitDelay = 5 * time.Second
	b, err := cmd.CombinedOutput()
	_ = os.WriteFile(filepath.Join(e.work, name+".log"), b, 0o644)
	if err != nil {
		return string(b), fmt.Errorf("%s: %w\n%s", strings.Join(argv, " "), err, tail(string(b), 20))
	}
	return string(b), nil
}

func tail(s string, lines int) string {
	l := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return "    | " + strings.Join(l[max(0, len(l)-lines):], "\n    | ")
}

// port and pid of a target: where pgbench connects, and the middleman whose CPU counts.
func (e *env) port(t string) int {
	switch t {
	case Unfenced, Fenced:
		return e.proxy.Port
	case PgBouncer:
		return e.bouncer.Port
	}
	return e.pg.Port
}

func (e *env) middleman(t string) int {
	switch t {
	case Unfenced, Fenced:
		return e.proxy.Pid()
	case PgBouncer:
		return e.bouncer.Pid()
	}
	return 0
}

// fenceOptions are the fenced target's startup parameters, as PGOPTIONS.
const fenceOptions = "-c fence.resource=" + resource + " -c fence.token=1"

// pgbenchArgs is the pgbench command line of cell against t; a non-empty txlog asks for the
// per-transaction log.
func (e *env) pgbenchArgs(cell Cell, t string, seconds, transactions int, txlog string) []string {
	seconds += e.allowance[cell.String()+" "+t]
	j := min(e.cfg.Threads, cell.Clients)
	var flags []string
	switch cell.Workload {
	case "select-only":
		flags = []string{"-S"}
	case "read-write":
		flags = []string{"-N"}
	case "tpcb-like":
		flags = []string{"-b", "tpcb-like"}
	case "connect":
		flags = []string{"-C", "-S"}
	}
	if t == DirectBind {
		flags = []string{"-C", "-f", e.bindSQL, "-s", strconv.Itoa(e.cfg.Scale)}
	}
	if txlog != "" {
		flags = append(flags, "-l", "--log-prefix="+txlog)
	}
	duration := []string{"-T", strconv.Itoa(seconds)}
	if transactions > 0 {
		duration = []string{"-t", strconv.Itoa(transactions)}
	}
	args := append([]string{e.pg.Bin("pgbench"), "-n"}, flags...)
	args = append(args, "-M", cell.Protocol, "-c", strconv.Itoa(cell.Clients), "-j", strconv.Itoa(j))
	args = append(args, duration...)
	return append(args, "-h", "127.0.0.1", "-p", strconv.Itoa(e.port(t)), "-U", testenv.AdminUser, database)
}

// prepare does what pgbench does by default before a run (VACUUM of branches and tellers,
// TRUNCATE of history), plus a CHECKPOINT, on PostgreSQL itself: pgbench runs with -n so
// that the preparation is the same for every target and outside the measurement.
func (e *env) prepare(ctx context.Context) error {
	for _, sql := range []string{"VACUUM pgbench_branches", "VACUUM pgbench_tellers", "TRUNCATE pgbench_history", "CHECKPOINT"} {
		if _, err := e.admin.Exec(ctx, sql); err != nil {
			return fmt.Errorf("%s: %w", sql, err)
		}
	}
	return nil
}

// counters are the readings taken before and after a run.
type counters struct {
	middleman, postgres, busy, idle int64
	switches, rwCalls               int64
}

func (e *env) read(mid int) (counters, error) {
	var c counters
	var err error
	pm, err := e.postmaster()
	if err != nil {
		return c, err
	}
	if c.postgres, err = TreeTicks(pm); err != nil {
		return c, err
	}
	if c.busy, c.idle, err = MachineTicks(); err != nil {
		return c, err
	}
	if mid == 0 {
		return c, nil
	}
	if c.middleman, err = CPUTicks(mid, false); err != nil {
		return c, err
	}
	if c.switches, err = ContextSwitches(mid); err != nil {
		return c, err
	}
	if !e.perf {
		if c.rwCalls, err = ReadWriteCalls(mid); err != nil {
			return c, err
		}
	}
	return c, nil
}

// postmaster is the pid of PostgreSQL's postmaster, the first line of postmaster.pid.
func (e *env) postmaster() (int, error) {
	b, err := os.ReadFile(filepath.Join(e.pg.DataDir, "postmaster.pid"))
	if err != nil {
		return 0, err
	}
	first, _, _ := strings.Cut(string(b), "\n")
	return strconv.Atoi(strings.TrimSpace(first))
}

// pgbench runs cell against t once; round 0 is a warm-up (not recorded).
//
// pgbench's -T runs from before its clients connect (its TPS leaves the connections out): a
// thread connects its clients one after the other, each a fenced bind for the fenced target,
// and on a loaded machine many clients can use up a short run before the first transaction.
// Each client a thread connects adds 25 ms to the run; a run that processed no transaction is
// run again with 2 s more, or 4 times as much, up to 4 times, and the cell and target keep the
// longer run for the next rounds.
func (e *env) pgbench(ctx context.Context, cell Cell, t string, round, seconds, transactions int) Sample {
	key := cell.String() + " " + t
	if _, ok := e.allowance[key]; !ok {
		e.allowance[key] = (cell.Clients/min(e.cfg.Threads, cell.Clients)*25 + 500) / 1000 // nothing below 20 a thread
	}
	for attempt := 1; ; attempt++ {
		s := e.pgbenchOnce(ctx, cell, t, round, seconds, transactions)
		if !errors.Is(s.Err, ErrNoTransactions) || transactions > 0 || attempt == 4 || ctx.Err() != nil {
			return s
		}
		e.allowance[key] = max(2, 4*e.allowance[key])
		e.say("%s %s: no transaction within -T: again with %d s for its connections", cell, t, e.allowance[key])
	}
}

func (e *env) pgbenchOnce(ctx context.Context, cell Cell, t string, round, seconds, transactions int) Sample {
	s := Sample{Cell: cell, Target: t, Round: round, Syscalls: math.NaN(), Switches: math.NaN(), LatMeanUs: math.NaN(), LatP99Us: math.NaN()}
	name := fmt.Sprintf("pgbench-%s-%s-%d", strings.ReplaceAll(cell.String(), "/", "-"), t, round)
	txlog := ""
	if cell.Clients == 1 && cell.Workload != "connect" && round > 0 {
		txlog = filepath.Join(e.work, "txlog-"+name)
	}
	args := e.pgbenchArgs(cell, t, seconds, transactions, txlog)
	var vars []string
	if t == Fenced {
		vars = []string{"PGOPTIONS=" + fenceOptions}
	}
	s.Err = func() error {
		if err := e.prepare(ctx); err != nil {
			return err
		}
		mid := e.middleman(t)
		before, err := e.read(mid)
		if err != nil {
			return err
		}
		var perf *perfCounter
		if mid != 0 && e.perf {
			if perf, err = startPerf(ctx, e.work, name, mid); err != nil {
				return err
			}
		}
		// A hang of a target must not hang the benchmark.
		limit := time.Duration(seconds+60) * time.Second
		if transactions > 0 {
			limit = 5 * time.Minute
		}
		rctx, cancel := context.WithTimeout(ctx, limit)
		out, runErr := e.command(rctx, name, vars, args...)
		cancel()
		syscalls := math.NaN()
		if perf != nil {
			// A count perf could not make (a run shorter than its start-up) leaves the row's
			// figure out; it does not fail the run.
			if syscalls, err = perf.stop(); err != nil {
				e.say("%s %s: %v", cell, t, err)
				syscalls = math.NaN()
			}
		}
		after, err := e.read(mid)
		if err != nil {
			return err
		}
		if runErr != nil {
			return runErr
		}
		if s.PgbenchResult, err = ParsePgbench(out); err != nil {
			return fmt.Errorf("%w\n%s", err, tail(out, 20))
		}
		s.MiddlemanTicks = after.middleman - before.middleman
		s.PostgresTicks = after.postgres - before.postgres
		s.BusyTicks, s.IdleTicks = after.busy-before.busy, after.idle-before.idle
		if mid != 0 {
			s.Switches = float64(after.switches - before.switches)
			s.Syscalls = float64(after.rwCalls - before.rwCalls)
			if perf != nil {
				s.Syscalls = syscalls
			}
		}
		if txlog != "" {
			lat, err := ReadLatencyLog(txlog)
			if err != nil {
				return err
			}
			s.LatMeanUs, s.LatP99Us = Mean(lat), Percentile(lat, 99)
		}
		return nil
	}()
	status := "ok"
	if s.Err != nil {
		status = "FAILED: " + s.Err.Error()
	}
	if round > 0 {
		conn := ""
		if !math.IsNaN(s.ConnectionMs) && s.ConnectionMs > 0 {
			conn = fmt.Sprintf("  (connection %.3f ms)", s.ConnectionMs)
		}
		e.say("round %d  %-26s %-11s %10.0f tps  %7.3f ms%s  %s", round, cell, t, s.TPS, s.LatencyMs, conn, status)
	} else if s.Err != nil {
		e.say("warm-up %s %s: %s", cell, t, status)
	}
	return s
}

// perfCounter is a `perf stat` counting every system call of a process's threads (epoll_wait,
// futex, recvfrom, sendto, read, write...). The context switches come from /proc with or
// without it.
type perfCounter struct {
	cmd  *exec.Cmd
	file string
}

// perfWorks reports whether perf stat can count the raw_syscalls tracepoint here.
func perfWorks(ctx context.Context) bool {
	out, err := exec.CommandContext(ctx, "perf", "stat", "-x,", "-e", "raw_syscalls:sys_enter", "--", "true").CombinedOutput()
	if err != nil {
		return false
	}
	_, ok := perfCount(string(out), "raw_syscalls:sys_enter")
	return ok
}

func startPerf(ctx context.Context, dir, name string, pid int) (*perfCounter, error) {
	p := &perfCounter{file: filepath.Join(dir, "perf-"+name+".csv")}
	p.cmd = exec.CommandContext(ctx, "perf", "stat", "-x,", "-o", p.file, "-e", "raw_syscalls:sys_enter", "-p", strconv.Itoa(pid))
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("perf stat: %w", err)
	}
	return p, nil
}

// stop ends the count (perf stat prints its totals on SIGINT) and reads them.
func (p *perfCounter) stop() (float64, error) {
	_ = p.cmd.Process.Signal(syscall.SIGINT)
	_ = p.cmd.Wait()
	b, err := os.ReadFile(p.file)
	if err != nil {
		return 0, fmt.Errorf("perf stat: %w", err)
	}
	if n, ok := perfCount(string(b), "raw_syscalls:sys_enter"); ok {
		return n, nil
	}
	return 0, fmt.Errorf("perf stat counted no system calls:\n%s", b)
}

// perfCount is the count of event in perf stat -x, output.
func perfCount(out, event string) (float64, bool) {
	for line := range strings.SplitSeq(out, "\n") {
		if f := strings.Split(line, ","); len(f) > 2 && f[2] == event {
			v, err := strconv.ParseFloat(f[0], 64)
			return v, err == nil
		}
	}
	return 0, false
}

func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	return strings.Join(strings.Fields(string(b))[:3], " ")
}
