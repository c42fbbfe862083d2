package proxy_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/lease/pglease"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/standby"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// Issue 21's failover setups with real streaming replication, one table of cases: setup ×
// admission path × running proxies (× how the proxies reach the primary). What each case must
// show is docs/failover.md's "What holds" table; a failover is the primary's immediate stop
// (testenv Kill) and the standby's promotion.

// failoverSetup is how the raise of the new leader's token reaches the standby.
type failoverSetup string

const (
	// asyncWait: asynchronous standby named in --failover-standbys (and the lease's
	// Standbys): a session under a raised token starts only once the standby has flushed the
	// raise (setup 1's safe configuration; setup 2 with the wait).
	asyncWait failoverSetup = "async-wait"
	// asyncNoWait: asynchronous standby, no wait; replication is cut before the new leader
	// takes over, so its raise (or lease acquisition) is lost with the primary (setup 1's
	// negative control with bare tokens, setup 2 with the lease, the lock services).
	asyncNoWait failoverSetup = "async-nowait"
	// syncRoleOff: synchronous standby and ALTER ROLE app SET synchronous_commit = off: the
	// raise still waits for the standby (setup 3).
	syncRoleOff failoverSetup = "sync-roleoff"
)

// failoverCase is one case of TestFailoverMatrix. Every case keeps its proxies running
// across the failover (setup 4: through a virtual IP, a relay retargeted to the promoted
// standby, or the multi-host --upstream with target_session_attrs=read-write) and starts one
// more proxy in front of the new primary afterwards (a restarted proxy).
type failoverCase struct {
	setup     failoverSetup
	path      admissionPath
	proxies   int  // running across the failover
	multiHost bool // --upstream host1,host2 ?target_session_attrs=read-write instead of a VIP
}

func (c failoverCase) name() string {
	n := fmt.Sprintf("%s/%s/%dpx", c.setup, c.path.name, c.proxies)
	if c.multiHost {
		n += "-multihost"
	}
	return n
}

// resource is the case's resource: the cases share the lock services.
func (c failoverCase) resource() string {
	return strings.NewReplacer("/", ".", "_", "-").Replace("fo." + c.name())
}

func (c failoverCase) lease() bool { return c.path.name == "pg-lease" }

// unsafe: docs/failover.md says it does not hold (bare tokens, asynchronous standby, no
// wait): the case asserts that documented outcome, a negative control.
func (c failoverCase) unsafe() bool { return c.setup == asyncNoWait && c.path.store == nil }

// newLeaderAfter: the new leader's token is lost and nothing outside the database names it,
// so the leader on the new primary is a third holder c (bare: a token between a's and the
// lost one; the lease: the new primary's next acquisition). Otherwise b leads on.
func (c failoverCase) newLeaderAfter() bool {
	return c.setup == asyncNoWait && !c.path.guarded()
}

// failoverCases is the full matrix (FENCEPROXY_FAILOVER_MATRIX=1, make failover-matrix), or
// the subset plain `go test` runs: every setup and path once, one and two proxies, both ways
// of following the primary.
func failoverCases() []failoverCase {
	paths := map[string]admissionPath{}
	for _, p := range admissionPaths {
		paths[p.name] = p
	}
	names := []string{"bare", "pg-lease", "consul-lockindex", "etcd", "zookeeper"}
	if os.Getenv("FENCEPROXY_FAILOVER_MATRIX") == "" {
		return []failoverCase{
			{setup: asyncWait, path: paths["bare"], proxies: 2},
			{setup: asyncNoWait, path: paths["bare"], proxies: 1},
			{setup: syncRoleOff, path: paths["bare"], proxies: 1},
			{setup: asyncNoWait, path: paths["pg-lease"], proxies: 1, multiHost: true},
			{setup: asyncNoWait, path: paths["consul-lockindex"], proxies: 2},
			{setup: asyncNoWait, path: paths["etcd"], proxies: 2},
			{setup: asyncWait, path: paths["zookeeper"], proxies: 1},
		}
	}
	var cases []failoverCase
	for _, setup := range []failoverSetup{asyncWait, asyncNoWait, syncRoleOff} {
		for _, n := range names {
			for _, proxies := range []int{1, 2} {
				cases = append(cases, failoverCase{setup: setup, path: paths[n], proxies: proxies})
			}
		}
	}
	for _, n := range names {
		cases = append(cases, failoverCase{setup: asyncNoWait, path: paths[n], proxies: 1, multiHost: true})
	}
	return cases
}

// TestFailoverMatrix runs each case: a leads and writes through every proxy; b takes over
// (its raise lost with the primary in the async-nowait setup, on the standby otherwise); the
// primary fails over. Then, through every running proxy and a proxy started afterwards:
//   - no stale commit: a's session left open fails at b's raise; a is refused (before and
//     after the proxies noticed the new timeline, and after the leader's sessions), and on
//     the new primary no row of a's token follows the leader's first row;
//   - no token held twice: tokens only rise; the lease never issues a generation twice (the
//     lost one's holder is refused, ZF002 then ZF001) and its row names the leader;
//   - the leader is not locked out: the running proxies forget the lost timeline's token,
//     and the leader connects and writes through every proxy.
//
// The bare async-nowait case asserts docs/failover.md's "does not hold" instead: a is admitted
// again on the new primary and its write commits after b's token was admitted.
//
// FENCEPROXY_FAILOVER_PARALLEL cases run at once (default 3, within go test's -parallel).
func TestFailoverMatrix(t *testing.T) {
	s := sharedServers(t)
	parallel := 3
	if n, err := strconv.Atoi(os.Getenv("FENCEPROXY_FAILOVER_PARALLEL")); err == nil && n > 0 {
		parallel = n
	}
	slots := make(chan struct{}, parallel)
	start := time.Now()
	t.Cleanup(func() { t.Logf("wall time %v", time.Since(start).Round(time.Second)) })
	for _, c := range failoverCases() {
		t.Run(c.name(), func(t *testing.T) {
			t.Parallel()
			slots <- struct{}{}
			defer func() { <-slots }()
			runFailoverCase(t, s, c)
		})
	}
}

func runFailoverCase(t *testing.T, s *servers, c failoverCase) {
	res := c.resource()
	pg, admin := fencedDB(t)
	sb := testenv.StartStandby(t, pg, "s1")
	if c.setup == syncRoleOff {
		makeSynchronous(t, pg, "s1")
		pg.Exec(t, "ALTER ROLE app SET synchronous_commit = off") // testenv's default is off too
	}
	// The case's servers: the shared lock services, this case's primary.
	cs := *s
	cs.pg, cs.admin = pg, admin
	path := c.path
	if c.lease() && c.setup == asyncWait {
		store := path.store
		path.store = func(s *servers, holder string) lease.Store {
			st := store(s, holder).(*pglease.Store)
			st.Standbys = standby.Set{Names: []string{"s1"}}
			return st
		}
	}

	var v *vip
	upstream, control := hostsURL("?target_session_attrs=read-write", pg, sb.Postgres), controlURL(pg, sb.Postgres)
	if !c.multiHost {
		v = startVIP(t, pg)
		upstream, control = "postgres://"+v.hop.Addr, v.url("postgres")
	}
	leaseResource := func(cfg *proxy.Config) {
		if c.lease() {
			cfg.LeaseResources = []string{res}
		}
	}
	running := func(cfg *proxy.Config) {
		cfg.Upstream, cfg.ControlDatabase = upstream, control
		cfg.UpstreamCheckInterval = 100 * time.Millisecond
		leaseResource(cfg)
		switch c.setup {
		case asyncWait:
			cfg.FailoverStandbys = []string{"s1"}
			cfg.StandbyFlushTimeout = time.Second
		case syncRoleOff:
			cfg.LoginTimeout = 3 * time.Second // a raise that waits for the cut standby
		}
	}
	var proxies []*testenv.Proxy
	for range c.proxies {
		proxies = append(proxies, startPathProxy(t, &cs, path, []string{res}, running))
	}

	take := func(srv *servers, name string, bare int64) holding {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		h, err := holder(ctx, srv, path, res, name, bare)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(h.release)
		return h
	}
	url := func(px *testenv.Proxy, h holding) string {
		params := []string{"password=app"}
		if h.session != "" {
			params = append(params, "fence.session="+h.session)
		}
		return px.FenceURL("app", "postgres", res, h.token, params...)
	}
	// write inserts a row tagged tag under h through each proxy, retrying until h's session
	// is admitted.
	write := func(h holding, tag string) {
		t.Helper()
		for i, px := range proxies {
			eventually(t, 15*time.Second, fmt.Sprintf("%s (token %d) writes through proxy %d", tag, h.token, i+1), func() error {
				conn, err := tryConnect(url(px, h))
				if err != nil {
					return err
				}
				defer conn.Close(context.Background())
				_, err = conn.Exec(ctxT(t), "INSERT INTO items (tag, token) VALUES ($1, $2)", tag, h.token)
				return err
			})
		}
	}
	// refused checks that h's session starts through no proxy (code: the SQLSTATE it must
	// get, "" for any error, "ZF" for any fence error); a session that starts writes a row
	// tagged "a stale", which the end checks for.
	refused := func(who string, h holding, code, when string) {
		t.Helper()
		for i, px := range proxies {
			conn, err := tryConnect(url(px, h))
			if err != nil {
				if got := sqlstate(err); !strings.HasPrefix(got, code) {
					t.Errorf("%s through proxy %d %s: want SQLSTATE %s, got %q: %v", who, i+1, when, code, got, err)
				}
				continue
			}
			_, err = conn.Exec(ctxT(t), "INSERT INTO items (tag, token) VALUES ('a stale', $1)", h.token)
			conn.Close(context.Background())
			t.Errorf("%s's session (token %d) through proxy %d started %s (write: %v)", who, h.token, i+1, when, err)
		}
	}
	settledCode := "ZF"
	if !path.guarded() {
		settledCode = fence.CodeStale
	}
	knows := func(what string, want int64) {
		t.Helper()
		if path.guarded() {
			return // a guard keeps what its lock service said
		}
		for i, px := range proxies {
			eventually(t, 15*time.Second, fmt.Sprintf("proxy %d knows token %d (%s)", i+1, want, what), func() error {
				if h := px.Registry.Highest("postgres", res); h != want {
					return fmt.Errorf("it knows %d", h)
				}
				return nil
			})
		}
	}

	// a leads and writes; one of its sessions stays open; it releases (as fenceproxy lock does
	// on exit); all of it reaches the standby.
	a := take(&cs, "a", 33)
	write(a, "a")
	aOpen := connect(t, url(proxies[0], a))
	a.release()
	sb.WaitFlushed(t, pg.CurrentLSN(t), 30*time.Second)
	if c.setup == asyncNoWait {
		sb.CutReplication()
	}

	// b takes over; its first session raises (bare, lease) or finds the guard's raise. Its
	// sessions through every proxy start before replication is cut (async-wait, sync): each
	// started only once the standby had the raise.
	b := take(&cs, "b", 35)
	if b.token <= a.token {
		t.Fatalf("b's token %d is not above a's %d", b.token, a.token)
	}
	var bConns []*pgx.Conn
	for i, px := range proxies {
		eventually(t, 15*time.Second, fmt.Sprintf("b's session through proxy %d", i+1), func() error {
			conn, err := tryConnect(url(px, b))
			if err == nil {
				t.Cleanup(func() { conn.Close(context.Background()) })
				bConns = append(bConns, conn)
			}
			return err
		})
	}
	if c.setup != asyncNoWait {
		sb.CutReplication()
	}
	for _, conn := range bConns {
		mustExec(t, conn, "INSERT INTO items (tag, token) VALUES ('b', $1)", b.token)
	}
	if _, err := aOpen.Exec(ctxT(t), "INSERT INTO items (tag, token) VALUES ('a stale', $1)", a.token); err == nil {
		t.Errorf("a's open session wrote after b's token %d was admitted", b.token)
	}
	knows("b's, on the old primary", b.token)
	eventually(t, 15*time.Second, "b's token raised on the old primary", func() error {
		if got := storedToken(t, admin, res); got != b.token {
			return fmt.Errorf("stored token %d, want %d", got, b.token)
		}
		return nil
	})
	if c.setup == syncRoleOff && !path.guarded() && !c.lease() {
		// A raise with the synchronous standby cut off does not return: the session whose
		// bind raises does not start.
		d := holding{token: b.token + 1}
		if err := connectErr(url(proxies[0], d)); err == nil {
			t.Errorf("the session raising to %d started with its synchronous standby cut off", d.token)
		}
	}

	if c.multiHost {
		pg.Kill(t)
		sb.Promote(t)
	} else {
		v.failover(t, sb)
	}
	stored := a.token // the new primary's token: b's raise lost, or there
	if c.setup != asyncNoWait {
		stored = b.token
	}
	promoted := connect(t, sb.AdminURL())
	if got := storedToken(t, promoted, res); got != stored {
		t.Fatalf("the new primary stores token %d, want %d", got, stored)
	}
	if !c.unsafe() {
		refused("a", a, "", "right after the failover")
	}
	for _, px := range proxies {
		waitNewTimeline(t, px, res)
	}
	knows("the new primary's, the lost timeline's forgotten", stored)
	if !c.unsafe() {
		refused("a", a, "", "after the proxies followed the new primary")
	}

	if c.setup == asyncWait {
		// The standby the proxies wait for is the primary now: they fail closed (ZF007 naming
		// s1 as this primary's own name) until the operator drops it from --failover-standbys
		// (docs/failover.md), here by a reload: nothing tells the promoted standby's name from
		// another standby of that name that is cut off (a second review's G2).
		for i, px := range proxies {
			// (The first ZF007 may blame a control connection that still pointed at the lost
			// primary.)
			eventually(t, 15*time.Second, fmt.Sprintf("proxy %d refuses b with ZF007 naming s1 as the primary's own", i+1), func() error {
				err := connectErr(url(px, b))
				if err == nil {
					t.Fatalf("b admitted through proxy %d, its --failover-standbys s1 promoted and not streaming", i+1)
				}
				if sqlstate(err) != fence.CodeUnavailable || !strings.Contains(err.Error(), "standby s1") || !strings.Contains(err.Error(), "own name") {
					return err
				}
				return nil
			})
			cfg := proxy.Config{Listen: net.JoinHostPort(px.Host, strconv.Itoa(px.Port))}
			path.configure(&cs, &cfg, []string{res})
			running(&cfg)
			cfg.FailoverStandbys = nil
			applied, skipped, err := px.Server.Reload(cfg)
			if err != nil || len(skipped) > 0 || !strings.Contains(strings.Join(applied, "; "), "failover-standbys") {
				t.Fatalf("reload of proxy %d without the promoted standby: applied %q, skipped %q, %v", i+1, applied, skipped, err)
			}
		}
	}

	// A proxy started after the failover, in front of the new primary.
	after := cs
	after.pg = sb.Postgres
	after.admin = adminPool(t, sb.Postgres)
	proxies = append(proxies, startPathProxy(t, &after, path, []string{res}, leaseResource))

	if c.unsafe() {
		// docs/failover.md: bare tokens, asynchronous standby, no wait: does not hold. The
		// older token is current again on the new primary: a is admitted and its write
		// commits after b's token was admitted (on the lost timeline).
		for i, px := range proxies {
			conn, err := tryConnect(url(px, a))
			if err != nil {
				t.Fatalf("negative control: a (token %d) through proxy %d: %v; docs/failover.md says it is admitted again (update it if this changed)", a.token, i+1, err)
			}
			mustExec(t, conn, "INSERT INTO items (tag, token) VALUES ('a stale', $1)", a.token)
			conn.Close(context.Background())
		}
	}

	leader := b // the leader on the new primary
	if c.newLeaderAfter() {
		if c.lease() {
			refused("b (the lost generation)", b, fence.CodeNotIssued, "before the new primary's acquisition")
			leader = take(&after, "c", 0)
			if leader.token <= b.token {
				t.Errorf("the new primary issued generation %d to c; b holds %d from the lost timeline: issued twice or below", leader.token, b.token)
			}
		} else {
			leader = take(&after, "c", 34) // the new primary's leader, below the lost 35
		}
	}
	write(leader, "lead")
	refused("a", a, settledCode, "after the leader's sessions")
	if c.newLeaderAfter() && c.lease() {
		// (With bare tokens b's lost 35 is above c's 34 and would be admitted, raising over
		// c: the same documented "does not hold".)
		refused("b (the lost generation)", b, settledCode, "after the leader's sessions")
	}
	write(leader, "lead again")
	t.Logf("tokens: a %d, b %d, leader %d; %d proxies", a.token, b.token, leader.token, len(proxies))

	check := connect(t, sb.AdminURL())
	staleRows := count(t, check, "SELECT count(*)::int FROM items WHERE tag = 'a stale'")
	if c.unsafe() {
		if staleRows != len(proxies) {
			t.Errorf("negative control: %d stale rows of a on the new primary, want %d (docs/failover.md: does not hold)", staleRows, len(proxies))
		}
	} else if staleRows != 0 {
		t.Errorf("%d stale rows of a committed on the new primary", staleRows)
	}
	if n := count(t, check, "SELECT count(*)::int FROM items WHERE token < $1 AND id > (SELECT min(id) FROM items WHERE tag = 'lead')", leader.token); n != 0 {
		t.Errorf("%d rows of a lower token committed after the leader's first write", n)
	}
	if n := count(t, check, "SELECT count(*)::int FROM items WHERE tag LIKE 'lead%'"); n != 2*len(proxies) {
		t.Errorf("%d rows of the leader on the new primary, want %d", n, 2*len(proxies))
	}
	if got := storedToken(t, check, res); got != leader.token {
		t.Errorf("the new primary stores token %d, want the leader's %d", got, leader.token)
	}
	if c.lease() {
		if c.setup == asyncNoWait {
			if n := count(t, check, "SELECT count(*)::int FROM items WHERE token = $1", b.token); n != 0 {
				t.Errorf("%d rows of b's lost generation %d on the new primary", n, b.token)
			}
		}
		var name string
		var gen int64
		if err := check.QueryRow(ctxT(t), "SELECT holder, generation FROM fence.leases WHERE resource = $1", res).Scan(&name, &gen); err != nil {
			t.Fatal(err)
		}
		want := "b"
		if c.newLeaderAfter() {
			want = "c"
		}
		if name != want || gen != leader.token {
			t.Errorf("the lease is held by %q with generation %d, want %s with %d", name, gen, want, leader.token)
		}
	}
}

// adminPool is a pool of superuser connections to p, closed when the test ends.
func adminPool(t *testing.T, p *testenv.Postgres) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(ctxT(t), p.AdminURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// tryConnect connects to url, returning the error instead of failing the test.
func tryConnect(url string) (*pgx.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	return pgx.Connect(ctx, url)
}
