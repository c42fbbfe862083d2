package bench

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
)

// The targets a cell can run against.
const (
	Direct     = "direct"      // PostgreSQL itself
	DirectBind = "direct-bind" // PostgreSQL itself, the proxy's bind statements first (connect cell only)
	Unfenced   = "unfenced"    // fenceproxy, sessions without a token (--unfenced allow): a plain relay
	PgBouncer  = "pgbouncer"   // PgBouncer in session mode
	Fenced     = "fenced"      // fenceproxy, sessions with a token: bound once at start, then relayed
)

// Config is one benchmark run. The zero value of a field is not its default: Defaults and
// Quick give the settings, cmd/bench's flags change them.
type Config struct {
	Rounds         int           `help:"Rounds: every cell and target once per round, interleaved; the table quotes medians (5 or more to quote)." default:"5"`
	Seconds        int           `help:"Duration of each measured pgbench run (-T)." default:"5"`
	Transactions   int           `help:"Transactions per client of each pgbench run (-t) instead of --seconds (0: use --seconds)." default:"0"`
	Warmup         int           `help:"Seconds of unmeasured pgbench per cell and target before the rounds (0: none)." default:"2"`
	Clients        []int         `help:"pgbench clients (-c) of the throughput cells; the cells of 1 client also log every transaction for latency." default:"1,8,64,256"`
	Threads        int           `help:"pgbench threads (-j) of the throughput cells (fewer for fewer clients)." default:"2"`
	Scale          int           `help:"pgbench scale factor (-i -s)." default:"10"`
	Protocols      []string      `help:"Query protocols (-M) of the throughput cells: simple, extended, prepared." default:"simple,prepared"`
	Workloads      []string      `help:"Cells: select-only (-S), read-write (-N), tpcb-like, connect (-C -S, simple protocol)." default:"select-only,read-write,connect"`
	Targets        []string      `help:"Targets of the throughput cells, in round order: direct, unfenced, pgbouncer, fenced." default:"direct,unfenced,pgbouncer,fenced"`
	ConnectClients int           `help:"pgbench clients of the connect cell." default:"1"`
	ConnectTargets []string      `help:"Targets of the connect cell (also direct-bind: PostgreSQL with the bind's statements)." default:"direct,direct-bind,unfenced,pgbouncer,fenced"`
	RaiseStale     []int         `help:"Numbers of stale sessions a raise ends, measured after every round (empty: no raise)." default:"0,1,10,100"`
	RaiseSamples   int           `help:"Raise samples per number of stale sessions in every round." default:"1"`
	IdleSessions   int           `help:"Idle sessions opened through each idle target after the rounds, for the memory per session (0: none)." default:"1000"`
	IdleTargets    []string      `help:"Targets of the idle-session measurement: unfenced, fenced, pgbouncer." default:"unfenced,fenced,pgbouncer"`
	IdleSettle     time.Duration `help:"Wait with every idle session open before reading the resident set." default:"2s"`
	Fsync          bool          `help:"PostgreSQL fsync, synchronous_commit and full_page_writes on (off: the disk is not what is measured)." default:"false"`
	Perf           bool          `help:"Count every system call with perf stat where it works (--no-perf: read/write calls from /proc/PID/io)." default:"true" negatable:""`
	ProxyArgs      []string      `help:"Extra flags for fenceproxy serve." sep:"none"`
	ProxyEnv       []string      `help:"Environment of fenceproxy serve, NAME=VALUE (GOMAXPROCS=1, GOGC=...)." sep:"none"`
	Bin            string        `help:"A fenceproxy binary to benchmark as it is (default: build ./cmd/fenceproxy)." type:"path"`
	Keep           bool          `help:"Keep the temporary folder (logs, pgbench outputs) and print its path."`
}

// Quick makes c the smoke test's size: one round, 20 transactions per client and run (a
// count, not a duration: on a loaded machine the sessions of a short -T run may not even
// have connected when it ends), no warm-up, scale 1, at most 100 idle sessions, raises of at
// most 10 stale sessions. Every row of the table is still there; no figure means anything.
func (c *Config) Quick() {
	c.Rounds, c.Warmup, c.Scale = 1, 0, 1
	if c.Transactions == 0 {
		c.Transactions = 20
	}
	c.IdleSessions, c.IdleSettle = min(c.IdleSessions, 100), min(c.IdleSettle, 200*time.Millisecond)
	c.RaiseStale = slices.DeleteFunc(c.RaiseStale, func(n int) bool { return n > 10 })
}

// Cell is one pgbench workload: a throughput cell (workload, protocol, clients) or the
// connect cell.
type Cell struct {
	Workload string // select-only, read-write, tpcb-like, connect
	Protocol string // simple, extended, prepared
	Clients  int
}

func (c Cell) String() string {
	if c.Workload == "connect" {
		return "connect/" + c.Protocol
	}
	return fmt.Sprintf("%s/%s/c%d", c.Workload, c.Protocol, c.Clients)
}

// Cells are the cells of c in round order: each throughput workload under each protocol and
// client count, then connect.
func (c *Config) Cells() []Cell {
	var cells []Cell
	for _, w := range c.Workloads {
		if w == "connect" {
			if len(c.ConnectTargets) > 0 {
				cells = append(cells, Cell{Workload: w, Protocol: "simple", Clients: c.ConnectClients})
			}
			continue
		}
		for _, p := range c.Protocols {
			for _, n := range c.Clients {
				cells = append(cells, Cell{Workload: w, Protocol: p, Clients: n})
			}
		}
	}
	return cells
}

// TargetsOf are the targets of cell, in round order.
func (c *Config) TargetsOf(cell Cell) []string {
	if cell.Workload == "connect" {
		return c.ConnectTargets
	}
	return c.Targets
}

// uses reports whether any measurement of c runs against target.
func (c *Config) uses(target string) bool {
	for _, cell := range c.Cells() {
		if slices.Contains(c.TargetsOf(cell), target) {
			return true
		}
	}
	return c.IdleSessions > 0 && slices.Contains(c.IdleTargets, target)
}

// Validate says what is wrong with c, if anything.
func (c *Config) Validate() error {
	if c.Rounds < 1 || c.Threads < 1 || c.Scale < 1 || c.ConnectClients < 1 || c.RaiseSamples < 1 {
		return fmt.Errorf("rounds, threads, scale, connect-clients and raise-samples must be at least 1")
	}
	if c.Seconds < 1 && c.Transactions < 1 {
		return fmt.Errorf("seconds or transactions must be at least 1")
	}
	if c.Warmup < 0 || c.IdleSessions < 0 {
		return fmt.Errorf("warmup and idle-sessions must not be negative")
	}
	for _, n := range c.Clients {
		if n < 1 {
			return fmt.Errorf("clients: %d is not a number of clients", n)
		}
		if n > c.Threads && n%c.Threads != 0 {
			return fmt.Errorf("clients: %d is not a multiple of threads (%d), which pgbench needs", n, c.Threads)
		}
	}
	for _, n := range c.RaiseStale {
		if n < 0 {
			return fmt.Errorf("raise-stale: %d is not a number of sessions", n)
		}
	}
	checks := []struct {
		name  string
		list  []string
		valid []string
	}{
		{"protocols", c.Protocols, []string{"simple", "extended", "prepared"}},
		{"workloads", c.Workloads, []string{"select-only", "read-write", "tpcb-like", "connect"}},
		{"targets", c.Targets, []string{Direct, Unfenced, PgBouncer, Fenced}},
		{"connect-targets", c.ConnectTargets, []string{Direct, DirectBind, Unfenced, PgBouncer, Fenced}},
		{"idle-targets", c.IdleTargets, []string{Unfenced, PgBouncer, Fenced}},
	}
	for _, ch := range checks {
		for _, v := range ch.list {
			if !slices.Contains(ch.valid, v) {
				return fmt.Errorf("%s: %q is not one of %s", ch.name, v, strings.Join(ch.valid, ", "))
			}
		}
	}
	if len(c.Cells()) == 0 && len(c.RaiseStale) == 0 && (c.IdleSessions == 0 || len(c.IdleTargets) == 0) {
		return fmt.Errorf("nothing to measure: no cell, no raise, no idle sessions")
	}
	return nil
}

// maxConnections is PostgreSQL's max_connections for c: the largest pgbench, the idle
// sessions or the raise's stale sessions, plus room for the benchmark's own connections,
// the proxy's control connection and autovacuum, plus the server connections PgBouncer keeps
// open after its largest pgbench (idle ones live for its server_idle_timeout, 10 minutes).
func (c *Config) maxConnections() int {
	clients := slices.Max(append(slices.Clone(c.Clients), c.ConnectClients))
	n := max(100, clients+20, c.IdleSessions+20, slices.Max(append([]int{0}, c.RaiseStale...))+20)
	if c.uses(PgBouncer) {
		n += clients
	}
	return n
}

// Flags is the command line of cmd/bench that repeats c.
func (c *Config) Flags() string {
	ints := func(v []int) string {
		s := make([]string, len(v))
		for i, n := range v {
			s[i] = strconv.Itoa(n)
		}
		return strings.Join(s, ",")
	}
	f := []string{
		fmt.Sprintf("--rounds=%d", c.Rounds), fmt.Sprintf("--seconds=%d", c.Seconds),
		fmt.Sprintf("--warmup=%d", c.Warmup), "--clients=" + ints(c.Clients),
		fmt.Sprintf("--threads=%d", c.Threads), fmt.Sprintf("--scale=%d", c.Scale),
		"--protocols=" + strings.Join(c.Protocols, ","), "--workloads=" + strings.Join(c.Workloads, ","),
		"--targets=" + strings.Join(c.Targets, ","), fmt.Sprintf("--connect-clients=%d", c.ConnectClients),
		"--connect-targets=" + strings.Join(c.ConnectTargets, ","), "--raise-stale=" + ints(c.RaiseStale),
		fmt.Sprintf("--raise-samples=%d", c.RaiseSamples), fmt.Sprintf("--idle-sessions=%d", c.IdleSessions),
		"--idle-targets=" + strings.Join(c.IdleTargets, ","),
	}
	if c.Transactions > 0 {
		f = append(f, fmt.Sprintf("--transactions=%d", c.Transactions))
	}
	if c.Fsync {
		f = append(f, "--fsync")
	}
	if !c.Perf {
		f = append(f, "--no-perf")
	}
	for _, a := range c.ProxyArgs {
		f = append(f, "--proxy-args="+a)
	}
	for _, e := range c.ProxyEnv {
		f = append(f, "--proxy-env="+e)
	}
	if c.Bin != "" {
		f = append(f, "--bin="+c.Bin)
	}
	return "go run ./cmd/bench " + strings.Join(f, " ")
}
