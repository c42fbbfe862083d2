package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/faulthop"
	"github.com/fenceproxy/fenceproxy/internal/history"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// Names of the campaign's resource, lock key and database.
const (
	resource = "ledger"
	lockKey  = "locks/ledger"
	database = "ledger"
	appRole  = "app"
	replicas = 3
	proxies  = 2
)

// Fault kinds.
const (
	FreezeShort        = "freeze-short"    // SIGSTOP the leader's groups for TTL/2
	FreezeTTL          = "freeze-ttl"      // ... for TTL
	FreezeLong         = "freeze-long"     // ... for 3 x TTL (beyond Consul's 2 x TTL)
	KillLeader         = "kill-leader"     // SIGKILL the leader's supervisor and worker
	KillWorker         = "kill-worker"     // SIGKILL the leader's worker (its supervisor releases the lock)
	KillSupervisor     = "kill-supervisor" // SIGKILL the leader's supervisor: its worker writes on, orphaned
	KillProxy          = "kill-proxy"      // SIGKILL a proxy, start it again later
	FreezeProxy        = "freeze-proxy"    // SIGSTOP a proxy for TTL/2 to 3 x TTL
	PGRestartFast      = "pg-restart-fast"
	PGRestartImmediate = "pg-restart-immediate"
	ConsulRestart      = "consul-restart"
	DelayApp           = "delay-app" // app-proxy link (straight to PostgreSQL: unused)
	DelayPG            = "delay-pg"  // proxy-PostgreSQL link (straight: the app's link)
	LossApp            = "loss-app"
	LossPG             = "loss-pg"
	StallApp           = "stall-app"
	StallPG            = "stall-pg"
	CutApp             = "cut-app"
	CutPG              = "cut-pg"
	// ClockJump jumps the clock of every replica's lease keep-alive forward by 2 to 5 x TTL,
	// then back by 4 to 10 x TTL (behind the true time by 2 to 5 x TTL), then to the true
	// time (lease.OffsetFileClock: a Go program's clock is beyond libfaketime's reach).
	ClockJump = "clock-jump"
	// Failover cuts the standby's replication, then (TTL/2 to 2 x TTL later) kills the
	// primary (immediate shutdown) and promotes the standby while the workload runs; a new
	// standby is then made from the new primary by a base backup (the old primary is gone
	// for good). Drawn only with Config.Standby (AllFaults leaves it out).
	Failover = "failover"
)

// Standby modes (Config.Standby).
const (
	StandbyAsync = "async" // asynchronous; the proxies wait for it (--failover-standbys slot:*)
	StandbySync  = "sync"  // synchronous_standby_names names it; the proxies do not wait
)

// AllFaults are the kinds a round draws from by default.
var AllFaults = []string{FreezeShort, FreezeTTL, FreezeLong, KillLeader, KillWorker, KillSupervisor, KillProxy, FreezeProxy, PGRestartFast,
	PGRestartImmediate, ConsulRestart, DelayApp, DelayPG, LossApp, LossPG, StallApp, StallPG, CutApp, CutPG, ClockJump}

// Config is a campaign. Zero values mean the defaults.
type Config struct {
	Rounds    int           // default 20
	Seed      uint64        // default: from the clock (printed, to replay a campaign's draws)
	TTL       time.Duration // the replicas' Consul session TTL; default 1 s
	Units     int           // units of work added each round; default 16
	TxDelay   time.Duration // the worker's pause inside each transaction; default 80 ms
	MaxFaults int           // faults drawn per round, 1 to MaxFaults; default 3
	Faults    []string      // kinds to draw from; default AllFaults
	// Always are kinds every round includes (the negative control freezes a leader in every
	// round, so that it shows what the checker catches); empty: none.
	Always []string
	// Direct is the negative control: the replicas connect straight to PostgreSQL (through
	// the same fault hops), and the harness stores each new Consul LockIndex in fence.tokens
	// itself (fence.reset): the raises happen and are recorded, but no session is bound, so
	// nothing enforces them.
	Direct bool
	// Standby adds a streaming standby of PostgreSQL, multi-host upstreams (both servers,
	// target_session_attrs=read-write) and the Failover fault: "" (none), StandbyAsync or
	// StandbySync.
	Standby string
	// ClaimNoLoss: an acknowledged write lost with a failed-over primary is a violation
	// even with StandbyAsync, where it is otherwise excused and counted (PostgreSQL's
	// trade-off): the failover's negative control claims of an asynchronous standby what
	// only a synchronous one gives.
	ClaimNoLoss bool
	// FailoverAfterRaise: the failover, once replication is cut, waits (up to 10 x TTL) for
	// a raise above the token stored at the round's start, so that the raise is lost with
	// the old primary (the failover's negative control).
	FailoverAfterRaise bool
	// Settle bounds the wait for a round's units after its faults are healed; default 90 s.
	// Pending units after it are a hang.
	Settle time.Duration
	Logf   func(format string, args ...any) // default tb.Logf
	// Dir keeps the processes' logs and the replicas' outcome files (default: a temporary
	// folder removed at the end).
	Dir string
}

// Result is a campaign's figures.
type Result struct {
	Config     Config
	Rounds     int
	Faults     map[string]int // injected, by kind
	Skipped    map[string]int // drawn but not injectable at that moment (no leader)
	Writes     int            // committed ledger rows
	Acked      int
	Unknown    int            // attempts whose COMMIT's answer was lost
	Rejected   int            // attempts or connections refused with ZF001 (stale)
	Refused    map[string]int // other failed attempts and connections, by SQLSTATE
	Violations []history.Violation
	Failures   []string                   // round failures: violations, hangs, leaked backends
	Failovers  map[string][]time.Duration // by fault: frozen (TTL or longer) or killed leader to the first commit of a higher token
	Exited     map[string]int             // servers found exited with no fault stopping them, started again
	// FailoverPauses are the failovers' durations, from the primary's kill to the proxies'
	// links to the promoted standby opened again (the promotion, the new decoding slot, the
	// old primary's slot drained, the new standby's base backup).
	FailoverPauses []time.Duration
	LostWrites     int // ledger rows committed on a primary after its timeline's switch point: lost with it
	LostAcked      int // acknowledged attempts among them: excused with StandbyAsync (PostgreSQL's trade-off) unless ClaimNoLoss
	StaleAcross    int // stale commits whose write came on a later primary than the raise it followed
	Elapsed        time.Duration
}

type env struct {
	tb   testing.TB
	cfg  Config
	rng  *rand.Rand
	dir  string
	logf func(string, ...any)

	fenceBin, chaosBin string

	pg     *testenv.Postgres
	consul *testenv.Consul
	mu     sync.Mutex // adminURL, which the negative control's admitter reads
	// adminURL is the current primary's, straight (no hop).
	adminURL string
	// pgHops lead to the primary, sbHops to the standby (Config.Standby); a failover swaps them.
	pgHops   [proxies]*faulthop.Hop
	sbHops   [proxies]*faulthop.Hop
	sb       *testenv.Standby
	standbys int   // standbys made so far: s1, s2...
	token0   int64 // the leader's token at the round's start (FailoverAfterRaise)
	appHops  [proxies]*faulthop.Hop
	proxies  [proxies]*testenv.ProxyProcess
	replicas [replicas]*testenv.Process
	frozen   [replicas]bool
	// pgDown, consulDown: a fault stopped the server and will start it again; supervise
	// starts a server that exited without one (and counts it in Result.Exited).
	pgDown, consulDown bool

	dec      *decoder
	required []string
	res      Result
	probes   []probe

	roundStart time.Time
	added      []action        // steps the running step added to the round's plan
	reported   map[string]bool // violations already turned into round failures
}

// probe is a leader fault whose failover time is measured.
type probe struct {
	kind  string
	at    time.Time
	token int64
	round int
}

// Run runs a campaign and returns its figures. Setup failures are fatal; round failures are
// in the Result (the caller decides what they mean: the fenced campaign must have none, the
// negative control must have violations).
func Run(tb testing.TB, cfg Config) Result {
	tb.Helper()
	if cfg.Rounds <= 0 {
		cfg.Rounds = 20
	}
	if cfg.Seed == 0 {
		cfg.Seed = uint64(time.Now().UnixNano())
	}
	if cfg.TTL <= 0 {
		cfg.TTL = time.Second
	}
	if cfg.Units <= 0 {
		cfg.Units = 16
	}
	if cfg.TxDelay <= 0 {
		cfg.TxDelay = 80 * time.Millisecond
	}
	if cfg.MaxFaults <= 0 {
		cfg.MaxFaults = 3
	}
	if len(cfg.Faults) == 0 {
		cfg.Faults = AllFaults
		if cfg.Standby != "" {
			cfg.Faults = append(slices.Clone(AllFaults), Failover)
		}
	}
	if cfg.Settle <= 0 {
		cfg.Settle = 90 * time.Second
	}
	if cfg.Logf == nil {
		cfg.Logf = tb.Logf
	}
	e := &env{tb: tb, cfg: cfg, rng: rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0x9e3779b97f4a7c15)), dir: cfg.Dir, logf: cfg.Logf}
	if e.dir == "" {
		e.dir = tb.TempDir()
	} else if err := os.MkdirAll(e.dir, 0o755); err != nil {
		tb.Fatal(err)
	}
	e.reported = map[string]bool{}
	e.res = Result{Config: cfg, Faults: map[string]int{}, Skipped: map[string]int{}, Refused: map[string]int{}, Failovers: map[string][]time.Duration{}, Exited: map[string]int{}}
	e.logf("chaos: seed %d, %d rounds, TTL %v, direct %t, standby %q", cfg.Seed, cfg.Rounds, cfg.TTL, cfg.Direct, cfg.Standby)
	begin := time.Now()
	e.setup()
	for r := 1; r <= cfg.Rounds; r++ {
		if !e.round(r) {
			break
		}
		e.res.Rounds = r
	}
	e.res.Elapsed = time.Since(begin)
	return e.res
}

func (e *env) setup() {
	tb := e.tb
	bins := testenv.BuildGo(tb, e.dir, "./cmd/fenceproxy", "./cmd/chaos")
	e.fenceBin, e.chaosBin = bins[0], bins[1]
	tb.Cleanup(e.sweepWorkers)

	// synchronous_commit on: testenv turns it off for speed, and an immediate shutdown
	// would then lose acknowledged commits, which is PostgreSQL's documented trade-off and
	// not what this campaign tests. fsync stays off: a process crash keeps the OS's cache.
	e.pg = testenv.StartPostgres(tb, pgOptions()...)
	e.pg.Exec(tb, "CREATE DATABASE "+database)
	e.setPrimary(e.pg)
	testenv.Migrate(tb, e.adminURL)
	e.pg.CreateRole(tb, appRole, "")
	e.admin(func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, schema)
		if err == nil {
			err = createSlot(ctx, c)
		}
		return err
	})
	e.dec = newDecoder(database, resource)
	if e.cfg.Standby != "" {
		e.newStandby()
	}
	e.consul = testenv.StartConsul(tb)

	keyFile := filepath.Join(e.dir, "proxy.key")
	if err := os.WriteFile(keyFile, []byte(fmt.Sprintf("%x\n", []byte(testenv.Key))), 0o600); err != nil {
		tb.Fatal(err)
	}
	for i := range proxies {
		e.pgHops[i] = e.hop(e.pg)
		upstream, control := "postgres://"+e.pgHops[i].Addr, fmt.Sprintf("postgres://%s:%s@%s/%s?sslmode=disable",
			testenv.AdminUser, testenv.AdminPassword, e.pgHops[i].Addr, database)
		var more []string
		if e.sb != nil {
			// Both servers, the primary first; after a failover the first is a standby.
			e.sbHops[i] = e.hop(e.sb.Postgres)
			hosts := e.pgHops[i].Addr + "," + e.sbHops[i].Addr
			upstream = "postgres://" + hosts + "/?target_session_attrs=read-write"
			control = fmt.Sprintf("postgres://%s:%s@%s/%s?sslmode=disable&target_session_attrs=read-write",
				testenv.AdminUser, testenv.AdminPassword, hosts, database)
			if e.cfg.Standby == StandbyAsync && !e.cfg.Direct {
				// Every physical slot: each standby the campaign makes has one, under a new name.
				more = []string{"--failover-standbys", "slot:*", "--standby-flush-timeout", "2s"}
			}
		}
		e.proxies[i] = testenv.StartProxyProcess(tb, e.dir, fmt.Sprintf("proxy-%d", i+1), e.fenceBin, append([]string{
			"--upstream", upstream, "--resource", resource + "=" + lockKey, "--key-file", keyFile,
			"--consul-addr", e.consul.Addr, "--control-database", control, "--log-level", "warn"}, more...)...)
		a, err := faulthop.Start("", e.proxies[i].Addr())
		if err != nil {
			tb.Fatal(err)
		}
		e.appHops[i] = a
		tb.Cleanup(func() { _ = a.Close(context.Background()) })
	}
	if e.cfg.Direct {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); e.admitter(ctx) }()
		tb.Cleanup(func() { cancel(); <-done })
	}
	for i := range replicas {
		e.replicas[i] = testenv.StartProcess(tb, e.dir, fmt.Sprintf("replica-%d", i+1), e.replicaArgv(i), e.replicaEnv(i))
	}
	// Cleanups run last first: the workers go before the proxies and servers they use
	// (a supervisor's end does not end its worker, which leads a process group of its own).
	tb.Cleanup(e.sweepWorkers)
}

// pgOptions are the settings of the campaign's servers, primary and standbys. A fast
// shutdown waits for its walsenders to send every WAL record to the standbys, which a cut
// replication holds until wal_sender_timeout (60 s by default, beyond testenv's stop bound):
// 5 s here.
func pgOptions() []testenv.PGOption {
	return []testenv.PGOption{testenv.WithConf("wal_level", "logical"), testenv.WithConf("synchronous_commit", "on"),
		testenv.WithConf("wal_sender_timeout", "5s")}
}

// hop starts a fault hop to p.
func (e *env) hop(p *testenv.Postgres) *faulthop.Hop {
	h, err := faulthop.Start("", fmt.Sprintf("%s:%d", p.Host, p.Port))
	if err != nil {
		e.tb.Fatal(err)
	}
	e.tb.Cleanup(func() { _ = h.Close(context.Background()) })
	return h
}

// setPrimary makes p the server the campaign's own connections go to.
func (e *env) setPrimary(p *testenv.Postgres) {
	e.mu.Lock()
	e.pg, e.adminURL = p, p.URLWithPassword(testenv.AdminUser, testenv.AdminPassword, database)
	e.mu.Unlock()
}

// newStandby makes a streaming standby of the primary (a base backup) and, with
// StandbySync, names it in the primary's synchronous_standby_names.
func (e *env) newStandby() {
	e.standbys++
	name := fmt.Sprintf("s%d", e.standbys)
	e.sb = testenv.StartStandby(e.tb, e.pg, name, pgOptions()...)
	if e.cfg.Standby == StandbySync {
		e.pg.Exec(e.tb, "ALTER SYSTEM SET synchronous_standby_names = '"+name+"'")
		e.pg.Exec(e.tb, "SELECT pg_reload_conf()")
	}
}

// schema is the workload: units that must each be done once, and the ledger that does
// them. The trigger stamps each ledger row with the token its backend is bound to, read
// from fence.bindings by PostgreSQL itself (NULL for an unbound backend).
const schema = `
CREATE TABLE units (id bigint PRIMARY KEY, round integer NOT NULL, done boolean NOT NULL DEFAULT false);
CREATE TABLE ledger (
    id          bigserial PRIMARY KEY,
    unit_id     bigint NOT NULL,
    token       bigint,
    bound_token bigint,
    attempt     text NOT NULL,
    replica     text NOT NULL
);
CREATE FUNCTION ledger_bound_token() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    SELECT b.token INTO NEW.bound_token
    FROM fence.bindings AS b
    JOIN pg_stat_get_activity(pg_backend_pid()) AS a ON a.pid = b.pid AND a.backend_start = b.backend_start;
    RETURN NEW;
END
$$;
CREATE TRIGGER ledger_bound_token BEFORE INSERT ON ledger FOR EACH ROW EXECUTE FUNCTION ledger_bound_token();
GRANT SELECT, UPDATE ON units TO app;
GRANT SELECT, INSERT ON ledger TO app;
GRANT USAGE ON SEQUENCE ledger_id_seq TO app;
`

func (e *env) replicaArgv(i int) []string {
	hops := e.appHops
	if e.cfg.Direct {
		hops = e.pgHops
	}
	// Replicas spread over both proxies: each tries its own first, then the other.
	first, second := hops[i%proxies], hops[(i+1)%proxies]
	hosts, attrs := first.Addr+","+second.Addr, ""
	if e.cfg.Direct && e.sb != nil {
		// Straight to PostgreSQL: both servers, whichever is the primary.
		hosts += "," + e.sbHops[i%proxies].Addr + "," + e.sbHops[(i+1)%proxies].Addr
		attrs = "&target_session_attrs=read-write"
	}
	url := fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable&connect_timeout=5%s", appRole, hosts, database, attrs)
	return []string{e.fenceBin, "lock", "--log-format", "console", "--resource", resource, "--key", lockKey,
		"--consul-addr", e.consul.Addr, "--ttl", e.cfg.TTL.String(), "--grace", "2s",
		"--database-url", url, "--clock-offset-file", e.clockFile(), "--", e.chaosBin, "worker"}
}

// clockFile holds the replicas' clock offset (ClockJump rewrites it; no file: none).
func (e *env) clockFile() string { return filepath.Join(e.dir, "clock.offset") }

// setClock shifts the replicas' lease clocks to offset from the true time.
func (e *env) setClock(offset time.Duration) {
	if err := os.WriteFile(e.clockFile(), []byte(offset.String()+"\n"), 0o644); err != nil {
		e.tb.Fatalf("chaos: %v", err)
	}
}

func (e *env) replicaEnv(i int) []string {
	return []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME"),
		"CHAOS_REPLICA=" + fmt.Sprintf("r%d", i+1),
		"CHAOS_OUTCOMES=" + e.outcomesFile(i),
		"CHAOS_TX_DELAY=" + e.cfg.TxDelay.String()}
}

func (e *env) outcomesFile(i int) string {
	return filepath.Join(e.dir, fmt.Sprintf("replica-%d.outcomes", i+1))
}

// admin runs f on a fresh superuser connection to the campaign's database (a long-lived
// one would not survive the server's restarts).
func (e *env) admin(f func(context.Context, *pgx.Conn) error) {
	e.tb.Helper()
	if err := e.tryAdmin(f); err != nil {
		e.tb.Fatalf("chaos: %v", err)
	}
}

func (e *env) tryAdmin(f func(context.Context, *pgx.Conn) error) error {
	e.mu.Lock()
	url := e.adminURL
	e.mu.Unlock()
	return tryConn(url, f)
}

func tryConn(url string, f func(context.Context, *pgx.Conn) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	return f(ctx, conn)
}

// admitter is the negative control's stand-in for the proxies' raises: it stores every new
// LockIndex of the lock in fence.tokens, so that the history has the raises a fenced run
// would have, with nothing bound to enforce them.
func (e *env) admitter(ctx context.Context) {
	client, err := api.NewClient(&api.Config{Address: e.consul.Addr})
	if err != nil {
		return
	}
	var index, stored uint64
	for ctx.Err() == nil {
		q := (&api.QueryOptions{WaitIndex: index, WaitTime: 5 * time.Second, RequireConsistent: true}).WithContext(ctx)
		kv, meta, err := client.KV().Get(lockKey, q)
		if err != nil {
			index = 0
			pause(ctx, 100*time.Millisecond)
			continue
		}
		index = meta.LastIndex
		if kv == nil || kv.Session == "" || kv.LockIndex <= stored {
			continue
		}
		for ctx.Err() == nil {
			err := e.tryAdmin(func(ctx context.Context, c *pgx.Conn) error {
				_, err := c.Exec(ctx, `SELECT fence.reset($1, $2)`, resource, int64(kv.LockIndex))
				return err
			})
			if err == nil {
				stored = kv.LockIndex
				break
			}
			pause(ctx, 100*time.Millisecond)
		}
	}
}

func pause(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}

// action is one step of a round's fault timeline, at an offset from the round's start. A
// step may add steps to the plan with env.later (the end of a freeze is timed from the
// moment it began, which waiting for a leader may have delayed).
type action struct {
	at   time.Duration
	name string
	do   func()
}

// later adds a to the running round's plan.
func (e *env) later(a action) { e.added = append(e.added, a) }

// since is the offset from the running round's start.
func (e *env) since() time.Duration { return time.Since(e.roundStart) }

// round runs round r; false stops the campaign (a hang: the state is unknown).
func (e *env) round(r int) bool {
	first := int64((r - 1) * e.cfg.Units)
	e.admin(func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, `INSERT INTO units (id, round) SELECT g, $1 FROM generate_series($2::bigint, $3::bigint) AS g`,
			r, first+1, first+int64(e.cfg.Units))
		return err
	})
	for u := first + 1; u <= first+int64(e.cfg.Units); u++ {
		e.required = append(e.required, strconv.FormatInt(u, 10))
	}
	if e.sb != nil {
		// The round's units on the standby before any fault: a failover must not lose them.
		e.sb.WaitFlushed(e.tb, e.pg.CurrentLSN(e.tb), time.Minute)
	}
	if e.cfg.FailoverAfterRaise {
		// The leader's token: the stored one may be lower (the admitter has not stored the
		// first yet, or a failover lost the last raise).
		e.token0 = e.storedToken()
		if _, _, token, ok := e.awaitLeader(); ok {
			e.token0 = max(e.token0, token)
		}
	}

	kinds := e.draw()
	var plan []action
	for _, k := range kinds {
		// Within the first TTL: while the round's units are being worked on.
		plan = append(plan, e.fault(r, k, time.Duration(e.rng.Int64N(int64(e.cfg.TTL))))...)
	}
	e.logf("chaos: round %d: %s", r, strings.Join(kinds, " "))
	e.roundStart = time.Now()
	for len(plan) > 0 {
		sort.SliceStable(plan, func(i, j int) bool { return plan[i].at < plan[j].at })
		a := plan[0]
		plan = plan[1:]
		for wait := a.at - e.since(); wait > 0; wait = a.at - e.since() {
			e.supervise()
			time.Sleep(min(wait, 50*time.Millisecond))
		}
		a.do()
		plan = append(plan, e.added...)
		e.added = nil
	}
	e.healAll()

	// Every unit of the round done, within the bound.
	deadline := time.Now().Add(e.cfg.Settle)
	for {
		e.supervise()
		var pending int
		if err := e.tryAdmin(func(ctx context.Context, c *pgx.Conn) error {
			return c.QueryRow(ctx, `SELECT count(*) FROM units WHERE NOT done`).Scan(&pending)
		}); err == nil && pending == 0 {
			break
		}
		if time.Now().After(deadline) {
			e.fail(r, fmt.Sprintf("hang: %d units still pending %v after the faults were healed; %s", pending, e.cfg.Settle, e.activity()))
			e.collect(r)
			return false
		}
		time.Sleep(50 * time.Millisecond)
	}
	e.checkBackends(r)
	e.collect(r)
	return true
}

// draw picks 1 to MaxFaults distinct kinds.
func (e *env) draw() []string {
	n := 1 + e.rng.IntN(e.cfg.MaxFaults)
	perm := e.rng.Perm(len(e.cfg.Faults))
	kinds := slices.Clone(e.cfg.Always)
	for _, i := range perm {
		if len(kinds) >= n {
			break
		}
		if k := e.cfg.Faults[i]; !slices.Contains(kinds, k) {
			kinds = append(kinds, k)
		}
	}
	return kinds
}

// fault is the timeline of one fault injected at t0.
func (e *env) fault(r int, kind string, t0 time.Duration) []action {
	ttl := e.cfg.TTL
	span := func(lo, hi time.Duration) time.Duration { return lo + time.Duration(e.rng.Int64N(int64(hi-lo)+1)) }
	hop := func(app bool) *faulthop.Hop {
		i := e.rng.IntN(proxies)
		if app && !e.cfg.Direct {
			return e.appHops[i]
		}
		return e.pgHops[i]
	}
	switch kind {
	case FreezeShort, FreezeTTL, FreezeLong:
		d := map[string]time.Duration{FreezeShort: ttl / 2, FreezeTTL: ttl, FreezeLong: 3 * ttl}[kind]
		return []action{{t0, kind, func() {
			i, w, token, ok := e.awaitLeader()
			if !ok {
				e.res.Skipped[kind]++
				return
			}
			// Mostly in the middle of a unit, where a late commit does harm; sometimes
			// wherever the leader is.
			if e.rng.IntN(4) > 0 && e.midTransaction(w, ttl) {
				e.res.Faults[kind+" mid-transaction"]++
			}
			if i >= 0 {
				e.frozen[i] = true
				_ = e.replicas[i].Signal(syscall.SIGSTOP)
			}
			_ = syscall.Kill(-w, syscall.SIGSTOP)
			e.res.Faults[kind]++
			if kind != FreezeShort {
				e.probes = append(e.probes, probe{kind: kind, at: time.Now(), token: token, round: r})
			}
			e.later(action{e.since() + d, kind + " end", func() {
				_ = syscall.Kill(-w, syscall.SIGCONT)
				if i >= 0 {
					_ = e.replicas[i].Signal(syscall.SIGCONT)
					e.frozen[i] = false
				}
			}})
		}}}
	case KillLeader, KillWorker, KillSupervisor:
		return []action{{t0, kind, func() {
			i, w, token, ok := e.awaitLeader()
			if !ok || (i < 0 && kind == KillSupervisor) {
				e.res.Skipped[kind]++
				return
			}
			if kind != KillSupervisor {
				_ = syscall.Kill(-w, syscall.SIGKILL)
			}
			if kind != KillWorker && i >= 0 {
				// Its process group only: the worker leads a group of its own.
				e.replicas[i].Kill(e.tb)
			}
			e.res.Faults[kind]++
			e.probes = append(e.probes, probe{kind: kind, at: time.Now(), token: token, round: r})
		}}}
	case KillProxy:
		p := e.proxies[e.rng.IntN(proxies)]
		var restart func()
		restart = func() {
			if e.consulDown {
				// A proxy exits at start when Consul does not answer: start it once Consul is back.
				e.later(action{e.since() + 100*time.Millisecond, kind + " end", restart})
				return
			}
			if !p.Running() {
				p.Start(e.tb)
				p.WaitListening(e.tb)
			}
		}
		return []action{
			{t0, kind, func() { p.Kill(e.tb); e.res.Faults[kind]++ }},
			{t0 + span(100*time.Millisecond, ttl), kind + " end", restart},
		}
	case FreezeProxy:
		p := e.proxies[e.rng.IntN(proxies)]
		return []action{
			{t0, kind, func() { _ = p.Signal(syscall.SIGSTOP); e.res.Faults[kind]++ }},
			{t0 + span(ttl/2, 3*ttl), kind + " end", func() { _ = p.Signal(syscall.SIGCONT) }},
		}
	case PGRestartFast, PGRestartImmediate:
		return []action{
			{t0, kind, func() {
				e.pgDown = true
				if kind == PGRestartFast {
					e.pg.Stop(e.tb)
				} else {
					e.pg.Kill(e.tb)
				}
				e.res.Faults[kind]++
			}},
			{t0 + span(0, ttl), kind + " end", func() {
				if !e.pg.Running() {
					e.pg.Start(e.tb)
				}
				e.pgDown = false
			}},
		}
	case ConsulRestart:
		return []action{
			{t0, kind, func() { e.consulDown = true; e.consul.Stop(e.tb); e.res.Faults[kind]++ }},
			{t0 + span(0, ttl), kind + " end", func() {
				if !e.consul.Running() {
					e.consul.Start(e.tb)
				}
				e.consulDown = false
			}},
		}
	case DelayApp, DelayPG, LossApp, LossPG, StallApp, StallPG:
		h := hop(kind == DelayApp || kind == LossApp || kind == StallApp)
		d := span(ttl/2, 2*ttl)
		return []action{
			{t0, kind, func() {
				switch kind {
				case DelayApp, DelayPG:
					h.SetDelay(span(5*time.Millisecond, 150*time.Millisecond))
				case LossApp, LossPG:
					h.SetLoss(0.02 + 0.2*e.rng.Float64())
				default:
					h.Stall(d)
				}
				e.res.Faults[kind]++
			}},
			{t0 + d, kind + " end", h.Heal},
		}
	case ClockJump:
		ahead, behind := span(2*ttl, 5*ttl), -span(2*ttl, 5*ttl)
		t1 := t0 + span(ttl/2, ttl)
		return []action{
			{t0, kind, func() { e.setClock(ahead); e.res.Faults[kind]++ }},
			{t1, kind + " back", func() { e.setClock(behind) }},
			{t1 + span(ttl/2, ttl), kind + " end", func() { e.setClock(0) }},
		}
	case CutApp, CutPG:
		h := hop(kind == CutApp)
		return []action{{t0, kind, func() { h.Cut(); e.res.Faults[kind]++ }}}
	case Failover:
		cut := false
		return []action{
			{t0, kind + " cut", func() {
				// Replication cut first: what the primary commits from now on is lost.
				if e.sb != nil && !e.pgDown {
					e.sb.CutReplication()
					cut = true
				}
			}},
			{t0 + span(ttl/2, 2*ttl), kind, func() {
				if !cut || e.pgDown {
					e.res.Skipped[kind]++ // no standby, or a restart fault has the primary down
					if cut {
						e.sb.HealReplication()
					}
					return
				}
				if e.cfg.FailoverAfterRaise {
					e.awaitRaise(10 * ttl)
				}
				e.failover()
			}},
		}
	}
	e.tb.Fatalf("chaos: unknown fault %q", kind)
	return nil
}

// midTransaction waits up to within until worker's backend is inside a transaction (idle
// in it: the worker's pause between its INSERT and its UPDATE), and reports whether it is.
func (e *env) midTransaction(worker int, within time.Duration) bool {
	var in bool
	_ = e.tryAdmin(func(ctx context.Context, c *pgx.Conn) error {
		deadline := time.Now().Add(within)
		for time.Now().Before(deadline) {
			err := c.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity WHERE application_name = $1 AND state = 'idle in transaction')`,
				fmt.Sprintf("chaos-worker-%d", worker)).Scan(&in)
			if err != nil || in {
				return err
			}
			time.Sleep(5 * time.Millisecond)
		}
		return nil
	})
	return in
}

// healAll undoes whatever a round left: every process running and awake, every link clean.
func (e *env) healAll() {
	e.setClock(0)
	for i, p := range e.replicas {
		_ = p.Signal(syscall.SIGCONT)
		e.frozen[i] = false
	}
	for _, pid := range e.workers() {
		_ = syscall.Kill(pid, syscall.SIGCONT)
	}
	for _, h := range slices.Concat(e.pgHops[:], e.sbHops[:], e.appHops[:]) {
		if h != nil {
			h.Heal()
		}
	}
	if e.sb != nil {
		e.sb.HealReplication()
	}
	e.pgDown, e.consulDown = false, false
	for _, p := range e.proxies {
		_ = p.Signal(syscall.SIGCONT)
		if !p.Running() {
			p.Start(e.tb)
			p.WaitListening(e.tb)
		}
	}
	e.supervise()
}

// supervise starts again every replica whose `fenceproxy lock` exited (lost its lock, its
// worker was fenced off, or a fault killed it), unless a fault holds it frozen.
func (e *env) supervise() {
	// A server that exited with no fault stopping it (seen once in a long campaign: the
	// Consul agent shut down on a SIGTERM that none of the campaign's faults sent) is
	// started again and counted, so that the round goes on and the figures say so.
	if !e.pgDown && !e.pg.Running() {
		e.logf("chaos: PostgreSQL had exited with no fault stopping it; starting it again")
		e.res.Exited["postgres"]++
		e.pg.Start(e.tb)
	}
	if !e.consulDown && !e.consul.Running() {
		e.logf("chaos: the Consul agent had exited with no fault stopping it; starting it again")
		e.res.Exited["consul"]++
		e.consul.Start(e.tb)
	}
	for i, p := range e.replicas {
		if !e.frozen[i] && !p.Running() {
			p.Start(e.tb)
		}
	}
}
