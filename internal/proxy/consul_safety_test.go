package proxy_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/lease/consul"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxy/guards"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// guardedProxy is one proxy instance with its own Guard, in front of s's database and Consul:
// what a separate fenceproxy process is (its memory is its own; only the database is shared).
type guardedProxy struct {
	*testenv.Proxy
	logs *observer.ObservedLogs
	stop func()
}

func startGuardedProxy(t *testing.T, s *consulSetup, mod ...func(*proxy.Config)) *guardedProxy {
	t.Helper()
	cfg := proxy.Config{
		Upstream:        fmt.Sprintf("postgres://%s:%d", s.pg.Host, s.pg.Port),
		Resources:       []string{"billing=locks/billing"},
		ConsulAddr:      s.consul.Addr,
		ControlDatabase: s.pg.AdminURL(),
		Key:             testenv.Key,
	}
	for _, m := range mod {
		m(&cfg)
	}
	core, logs := observer.New(zap.InfoLevel)
	reg := fence.NewRegistry()
	ctx, cancel := context.WithCancel(context.Background())
	g, err := guards.Consul(ctx, cfg, consul.GuardOptions{Registry: reg, Logger: zap.New(core)})
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { g.Run(ctx); close(done) }() //nolint:errcheck
	p := testenv.StartProxy(t, s.pg, cfg, testenv.ProxyOptions{Admitter: g, Registry: reg})
	var once sync.Once
	gp := &guardedProxy{Proxy: p, logs: logs, stop: func() {
		once.Do(func() {
			p.Stop(t)
			cancel()
			<-done
		})
	}}
	t.Cleanup(gp.stop)
	// Sessions are refused (ZF007) until the Guard has read Consul once: wait for that, with a
	// token no lock ever issued (refused for another reason once synchronised), so that the
	// tests' first connection is not refused for the start-up alone.
	eventually(t, 15*time.Second, "the Guard synchronised with Consul", func() error {
		if err := connectErr(gp.url(1 << 40)); err != nil && strings.Contains(err.Error(), "not synchronised") {
			return err
		}
		return nil
	})
	return gp
}

func (p *guardedProxy) url(tok int64, params ...string) string {
	return p.FenceURL("app", "postgres", "billing", tok, params...)
}

// regressionLines counts the proxy's "failing closed" error lines.
func (p *guardedProxy) regressionLines() int {
	return p.logs.FilterMessage("failing closed: Consul token regression").Len()
}

// reacquire releases key for session and acquires it again with the same session: the
// LockIndex grows by one.
func reacquire(t *testing.T, c *api.Client, key, session string) int64 {
	t.Helper()
	if _, _, err := c.KV().Release(&api.KVPair{Key: key, Session: session}, nil); err != nil {
		t.Fatal(err)
	}
	if ok, _, err := c.KV().Acquire(&api.KVPair{Key: key, Session: session}, nil); err != nil || !ok {
		t.Fatalf("re-acquire: %t %v", ok, err)
	}
	p, _, err := c.KV().Get(key, &api.QueryOptions{RequireConsistent: true})
	if err != nil || p == nil || p.Session != session {
		t.Fatalf("read back %s: %+v %v", key, p, err)
	}
	return int64(p.LockIndex)
}

// TestConsulRegressionSurvivesRestart: a regression one proxy saw (a plain PUT on the held
// key) is kept in the database. After that proxy restarts and Consul's LockIndex has climbed
// back to the token the database stored, neither the new holder nor the old one is admitted
// (both ZF007): the fail-closed state outlives the process, and the old holder and the new one
// never share the token. fence.reset is the way out.
func TestConsulRegressionSurvivesRestart(t *testing.T) {
	t.Parallel()
	s := startConsulProxy(t)
	p1 := startGuardedProxy(t, s)
	a, _ := consulLock(t, s.client, "locks/billing")
	tok := reacquire(t, s.client, "locks/billing", a) // LockIndex 2
	old := connect(t, p1.url(tok))
	mustExec(t, old, "INSERT INTO items (tag) VALUES ('a')")

	if _, err := s.client.KV().Put(&api.KVPair{Key: "locks/billing", Value: []byte("oops")}, nil); err != nil {
		t.Fatal(err)
	}
	eventually(t, 15*time.Second, "regression seen", func() error {
		if err := connectErr(p1.url(tok)); sqlstate(err) != fence.CodeUnavailable {
			return fmt.Errorf("got %v", err)
		}
		return nil
	})
	eventually(t, 15*time.Second, "regression recorded", func() error {
		if n := count(t, s.admin, "SELECT count(*)::int FROM fence.consul_tokens WHERE resource = 'billing' AND regression IS NOT NULL"); n != 1 {
			return errors.New("not yet")
		}
		return nil
	})
	// LockIndex climbs back to the stored token under a new holder.
	if _, err := s.client.Session().Destroy(a, nil); err != nil {
		t.Fatal(err)
	}
	b, tok1 := consulLock(t, s.client, "locks/billing")
	if tok1 != 1 {
		t.Fatalf("LockIndex after the plain PUT: %d, want 1", tok1)
	}
	if got := reacquire(t, s.client, "locks/billing", b); got != tok {
		t.Fatalf("LockIndex %d, want %d", got, tok)
	}
	wantCode(t, connectErr(p1.url(tok, "fence.session="+b)), fence.CodeUnavailable)
	// One regression, reported once, through all the changes that followed it.
	if n := p1.regressionLines(); n != 1 {
		t.Errorf("proxy 1 logged %d 'failing closed' lines, want 1", n)
	}
	p1.stop()
	s.cancel() // the setup's own Guard too: every proxy restarts

	p2 := startGuardedProxy(t, s)
	for name, url := range map[string]string{"new holder": p2.url(tok, "fence.session="+b), "old holder": p2.url(tok)} {
		err := connectErr(url)
		wantCode(t, err, fence.CodeUnavailable)
		t.Logf("%s: %v", name, err)
	}
	if n := count(t, s.admin, "SELECT count(*)::int FROM items"); n != 1 {
		t.Fatalf("%d rows, want only the first holder's", n)
	}
	if n := p2.regressionLines(); n != 1 {
		t.Errorf("proxy 2 logged %d 'failing closed' lines, want 1", n)
	}

	// The operator's way out: reset the stored token to Consul's. The running proxy follows
	// it (its LISTEN on the control database), no restart needed; a reset committed before
	// the just-started proxy's listener connected is not seen (docs/consul.md), so the
	// operator's reset is repeated until it is (under load the listener came late).
	eventually(t, 30*time.Second, "admitted after reset", func() error {
		mustExec(t, s.admin, "SELECT fence.reset('billing', $1)", tok)
		return connectErr(p2.url(tok, "fence.session="+b))
	})
}

// regressWhileDown: a holder's token (LockIndex 2) is admitted and written with, every proxy
// stops, then a plain PUT resets LockIndex to 0 and the holder's session ends: the lock is
// free, and Consul's next tokens repeat numbers already issued. It returns the admitted token.
func regressWhileDown(t *testing.T) (*consulSetup, int64) {
	t.Helper()
	s := startConsulProxy(t)
	a, _ := consulLock(t, s.client, "locks/billing")
	tok := reacquire(t, s.client, "locks/billing", a)
	mustExec(t, connect(t, s.url(tok)), "INSERT INTO items (tag) VALUES ('a')")
	s.cancel()
	s.proxy.Stop(t)
	if _, err := s.client.KV().Put(&api.KVPair{Key: "locks/billing", Value: []byte("oops")}, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := s.client.Session().Destroy(a, nil); err != nil {
		t.Fatal(err)
	}
	return s, tok
}

// TestConsulSameTokenTwoHolders: the regression happened while no proxy ran (Consul lost its
// data, or a plain PUT during an outage of every proxy), so no proxy's watch can see it. The
// database recorded which Consul session held the admitted token; when Consul later shows the
// same number held by another session, that is a number issued twice: ZF007 for everyone,
// and recorded.
func TestConsulSameTokenTwoHolders(t *testing.T) {
	t.Parallel()
	s, tok := regressWhileDown(t)
	b, _ := consulLock(t, s.client, "locks/billing")
	reacquire(t, s.client, "locks/billing", b) // LockIndex 2 again, held by b

	p := startGuardedProxy(t, s)
	// The old holder, presenting the number without its session: Consul says it is current.
	err := connectErr(p.url(tok))
	wantCode(t, err, fence.CodeUnavailable)
	t.Logf("old holder: %v", err)
	wantCode(t, connectErr(p.url(tok, "fence.session="+b)), fence.CodeUnavailable)
	var regression string
	if err := s.admin.QueryRow(ctxT(t), "SELECT regression FROM fence.consul_tokens WHERE resource = 'billing'").Scan(&regression); err != nil {
		t.Fatal(err)
	}
	t.Logf("recorded: %s", regression)
	if n := p.regressionLines(); n != 1 {
		t.Errorf("%d 'failing closed' lines, want 1", n)
	}
}

// TestConsulQuickHandOvers: 20 hand-overs in quick succession, watched by two proxies with
// --control-database whose proactive raises cross (and queue behind the fence row's lock,
// held for a moment): neither proxy ever takes it for a regression, and both admit the last
// leader.
func TestConsulQuickHandOvers(t *testing.T) {
	t.Parallel()
	s := startConsulProxy(t)
	p1 := startGuardedProxy(t, s)
	p2 := startGuardedProxy(t, s)
	const key = "locks/billing"
	var sessions []string
	for range 3 {
		id, _, err := s.client.Session().Create(&api.SessionEntry{TTL: "60s", LockDelay: time.Millisecond, Behavior: api.SessionBehaviorRelease}, nil)
		if err != nil {
			t.Fatal(err)
		}
		sessions = append(sessions, id)
	}
	// Hold the fence row for a moment so that raises queue behind it.
	hold, err := connect(t, s.pg.AdminURL()).Begin(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := hold.Exec(ctxT(t), "INSERT INTO fence.tokens (resource, token) VALUES ('billing', 0) ON CONFLICT DO NOTHING"); err != nil {
		t.Fatal(err)
	}
	if _, err := hold.Exec(ctxT(t), "SELECT 1 FROM fence.tokens WHERE resource = 'billing' FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	var last string
	started := time.Now()
	for i := range 20 {
		id := sessions[i%len(sessions)]
		if last != "" {
			if _, _, err := s.client.KV().Release(&api.KVPair{Key: key, Session: last}, nil); err != nil {
				t.Fatal(err)
			}
		}
		if ok, _, err := s.client.KV().Acquire(&api.KVPair{Key: key, Session: id}, nil); err != nil || !ok {
			t.Fatalf("hand-over %d: %t %v", i, ok, err)
		}
		last = id
	}
	t.Logf("20 hand-overs in %v", time.Since(started))
	time.Sleep(200 * time.Millisecond) // let the raises queue (not a timing assertion)
	if err := hold.Rollback(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	pair, _, err := s.client.KV().Get(key, &api.QueryOptions{RequireConsistent: true})
	if err != nil || pair == nil || pair.Session != last {
		t.Fatalf("read back: %+v %v", pair, err)
	}
	tok := int64(pair.LockIndex)
	for i, p := range []*guardedProxy{p1, p2} {
		eventually(t, 15*time.Second, fmt.Sprintf("proxy %d admits the leader", i+1), func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			c, err := pgx.Connect(ctx, p.url(tok, "fence.session="+last))
			if err != nil {
				if sqlstate(err) == fence.CodeUnavailable {
					t.Fatalf("proxy %d refused the current leader with ZF007: %v", i+1, err)
				}
				return err
			}
			defer c.Close(ctx)
			_, err = c.Exec(ctx, "INSERT INTO items (tag, token) VALUES ('leader', $1)", tok)
			return err
		})
		if n := p.regressionLines(); n != 0 {
			t.Errorf("proxy %d logged %d regressions", i+1, n)
		}
	}
	if n := count(t, s.admin, "SELECT count(*)::int FROM fence.consul_tokens WHERE regression IS NOT NULL"); n != 0 {
		t.Errorf("%d regressions recorded", n)
	}
}

// TestConsulRegressionWhileDownIsZF007: Consul's sequence went back while no proxy ran; the
// new leader's token is below the one the database admitted. A proxy started afterwards has
// no history of the key, yet tells the leader ZF007 (fencing unavailable: a regression), not
// ZF001 ("no longer the leader", which it is not), and records it.
func TestConsulRegressionWhileDownIsZF007(t *testing.T) {
	t.Parallel()
	s, tok := regressWhileDown(t)
	b, low := consulLock(t, s.client, "locks/billing")
	if low >= tok {
		t.Fatalf("LockIndex %d, want below %d", low, tok)
	}
	p := startGuardedProxy(t, s)
	err := connectErr(p.url(low, "fence.session="+b))
	wantCode(t, err, fence.CodeUnavailable)
	t.Logf("leader: %v", err)
	eventually(t, 15*time.Second, "regression recorded", func() error {
		if n := count(t, s.admin, "SELECT count(*)::int FROM fence.consul_tokens WHERE regression IS NOT NULL"); n != 1 {
			return fmt.Errorf("%d regressions recorded", n)
		}
		return nil
	})
}

// TestConsulForgedResetNotifyChangesNothing (review finding F4): any client may NOTIFY on the
// proxies' channel. A forged "<resource> <token> reset" while the resource fails closed after a
// regression changes nothing: the Guard finds no such reset in fence.history, says so, and keeps
// refusing (ZF007). The operator's real fence.reset still ends the regression in the running
// proxy.
func TestConsulForgedResetNotifyChangesNothing(t *testing.T) {
	t.Parallel()
	s := startConsulProxy(t)
	p := startGuardedProxy(t, s)
	a, _ := consulLock(t, s.client, "locks/billing")
	tok := reacquire(t, s.client, "locks/billing", a) // LockIndex 2
	mustExec(t, connect(t, p.url(tok)), "INSERT INTO items (tag) VALUES ('a')")
	if _, err := s.client.KV().Put(&api.KVPair{Key: "locks/billing", Value: []byte("oops")}, nil); err != nil {
		t.Fatal(err)
	}
	eventually(t, 15*time.Second, "regression seen and recorded", func() error {
		if err := connectErr(p.url(tok)); sqlstate(err) != fence.CodeUnavailable {
			return fmt.Errorf("got %v", err)
		}
		if n := count(t, s.admin, "SELECT count(*)::int FROM fence.consul_tokens WHERE regression IS NOT NULL"); n != 1 {
			return errors.New("not recorded yet")
		}
		return nil
	})
	// Both Guards' listeners (the setup's and p's) are past their LISTEN.
	eventually(t, 15*time.Second, "listeners ready", func() error {
		if n := count(t, s.admin, `SELECT count(*)::int FROM pg_stat_activity
			WHERE application_name = $1 AND query LIKE '%fence.history%'`, consul.GuardApplicationName); n < 2 {
			return fmt.Errorf("%d listening", n)
		}
		return nil
	})

	forger := connect(t, s.pg.URL("app", "postgres"))
	mustExec(t, forger, "SELECT pg_notify($1, $2)", fence.Channel, fmt.Sprintf("billing %d reset", tok))
	eventually(t, 15*time.Second, "the forged notification seen and ignored", func() error {
		if p.logs.FilterMessageSnippet("ignoring a reset notification").Len() == 0 {
			return errors.New("not yet")
		}
		return nil
	})
	if n := p.logs.FilterMessageSnippet("fence reset by an operator").Len(); n != 0 {
		t.Errorf("the forged notification was taken for a reset (%d log lines)", n)
	}
	err := connectErr(p.url(tok))
	wantCode(t, err, fence.CodeUnavailable)
	t.Logf("after the forged reset: %v", err)

	// A real reset, to Consul's current token (0 after the plain PUT, so the next holder's 1).
	if _, err := s.client.Session().Destroy(a, nil); err != nil {
		t.Fatal(err)
	}
	b, low := consulLock(t, s.client, "locks/billing")
	mustExec(t, s.admin, "SELECT fence.reset('billing', $1)", low)
	eventually(t, 15*time.Second, "admitted after the operator's reset", func() error { return connectErr(p.url(low, "fence.session="+b)) })
}
