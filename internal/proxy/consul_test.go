package proxy_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/lease/consul"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxy/guards"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// consulLock acquires key with a fresh Consul session and returns the
// session ID and the LockIndex it was granted (read back consistently).
func consulLock(t *testing.T, c *api.Client, key string) (string, int64) {
	t.Helper()
	id, _, err := c.Session().Create(&api.SessionEntry{TTL: "60s", LockDelay: time.Millisecond, Behavior: api.SessionBehaviorRelease}, nil)
	if err != nil {
		t.Fatal(err)
	}
	// After a holder's session is destroyed, Consul refuses acquires for the
	// lock-delay (1 ms here): retry through it.
	eventually(t, 5*time.Second, "acquire "+key, func() error {
		ok, _, err := c.KV().Acquire(&api.KVPair{Key: key, Session: id}, nil)
		if err == nil && !ok {
			err = errors.New("not acquired")
		}
		return err
	})
	p, _, err := c.KV().Get(key, &api.QueryOptions{RequireConsistent: true})
	if err != nil || p == nil || p.Session != id {
		t.Fatalf("read back %s: %+v %v", key, p, err)
	}
	return id, int64(p.LockIndex)
}

type consulSetup struct {
	pg     *testenv.Postgres
	admin  querier
	consul *testenv.Consul
	client *api.Client
	proxy  *testenv.Proxy
	guard  *consul.Guard
	cancel context.CancelFunc
}

func startConsulProxy(t *testing.T, mod ...func(*proxy.Config)) *consulSetup {
	t.Helper()
	s := &consulSetup{}
	s.pg, s.admin = fencedDB(t)
	s.consul = testenv.StartConsul(t)
	s.client = s.consul.Client(t)
	cfg := proxy.Config{
		Upstream:        fmt.Sprintf("postgres://%s:%d", s.pg.Host, s.pg.Port),
		Resources:       []string{"billing=locks/billing"},
		ConsulAddr:      s.consul.Addr,
		ControlDatabase: s.pg.AdminURL(),
		Key:             testenv.Key, // the Guard's proactive raise needs the proof
	}
	for _, m := range mod {
		m(&cfg)
	}
	s.proxy, s.guard, s.cancel = startConsulGuarded(t, s.pg, cfg)
	return s
}

// startConsulGuarded starts a proxy in front of pg with a Consul Guard for cfg and waits
// until it is ready; cancel stops the guard (also at the test's end).
func startConsulGuarded(t *testing.T, pg *testenv.Postgres, cfg proxy.Config) (*testenv.Proxy, *consul.Guard, context.CancelFunc) {
	t.Helper()
	reg := fence.NewRegistry()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	g, err := guards.Consul(ctx, cfg, consul.GuardOptions{Registry: reg, Logger: zapNop()})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { g.Run(ctx); close(done) }() //nolint:errcheck
	t.Cleanup(func() { cancel(); <-done })
	px := testenv.StartProxy(t, pg, cfg, testenv.ProxyOptions{Admitter: g, Registry: reg})
	// Ready: the watch has synchronised with Consul (until then every token is ZF007, which
	// a test that connects at once took for a failure under load).
	eventually(t, 15*time.Second, "the proxy ready", func() error {
		if why := px.Server.NotReady(ctxT(t)); len(why) > 0 {
			return fmt.Errorf("not ready: %v", why)
		}
		return nil
	})
	return px, g, cancel
}

func (s *consulSetup) url(tok int64, params ...string) string {
	return s.proxy.FenceURL("app", "postgres", "billing", tok, params...)
}

func TestConsulAdmission(t *testing.T) {
	s := startConsulProxy(t)
	// The key does not exist: nobody holds the lock (ZF006, whatever the token:
	// an incarnation of the key that is gone may have issued it). Until the
	// watch has synchronised, every token is refused with ZF007.
	eventually(t, 15*time.Second, "never-held lock refused", func() error {
		if err := connectErr(s.url(1)); sqlstate(err) != fence.CodeNotHeld {
			return fmt.Errorf("got %v", err)
		}
		return nil
	})
	// It names the key, which a typo in the lock's --key would miss (a newcomer's).
	var pe *pgconn.PgError
	if err := connectErr(s.url(1)); !errors.As(err, &pe) || !strings.Contains(pe.Message, "the Consul lock key locks/billing of resource \"billing\" does not exist") ||
		!strings.Contains(pe.Hint, "fenceproxy lock --key locks/billing") {
		t.Fatalf("a never-held lock's refusal does not name its key: %v", err)
	}
	sess0, _ := consulLock(t, s.client, "locks/billing")
	if _, err := s.client.Session().Destroy(sess0, nil); err != nil {
		t.Fatal(err)
	}
	sess1, tok1 := consulLock(t, s.client, "locks/billing") // tok1 >= 2
	tests := []struct {
		name string
		url  string
		code string
	}{
		{"current token", s.url(tok1), ""},
		{"current token with holder session", s.url(tok1, "fence.session="+sess1), ""},
		{"holder session mismatch", s.url(tok1, "fence.session=00000000-0000-0000-0000-000000000000"), fence.CodeHolderMismatch},
		{"higher than issued", s.url(tok1 + 1), fence.CodeNotIssued},
		{"lower than current", s.url(tok1 - 1), fence.CodeStale},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := connectErr(tt.url)
			if tt.code == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			wantCode(t, err, tt.code)
		})
	}
	// Released: nobody holds it.
	if _, _, err := s.client.KV().Release(&api.KVPair{Key: "locks/billing", Session: sess1}, nil); err != nil {
		t.Fatal(err)
	}
	eventually(t, 15*time.Second, "released lock refused", func() error {
		if err := connectErr(s.url(tok1)); sqlstate(err) != fence.CodeNotHeld {
			return fmt.Errorf("got %v", err)
		}
		return nil
	})
}

// TestConsulRequireSession: with --consul-require-session a session without fence.session
// is refused (ZF003): without the holder's session the proxy cannot tell two holders of one
// LockIndex apart when Consul issued it twice while no proxy watched (a review had both
// commit). With the holder's session it is admitted, with another one refused (ZF009).
func TestConsulRequireSession(t *testing.T) {
	s := startConsulProxy(t, func(c *proxy.Config) { c.ConsulRequireSession = true })
	id, tok := consulLock(t, s.client, "locks/billing")
	eventually(t, 15*time.Second, "the holder admitted", func() error { return connectErr(s.url(tok, "fence.session="+id)) })
	err := connectErr(s.url(tok))
	wantCode(t, err, fence.CodeMissing)
	if !strings.Contains(err.Error(), "consul-require-session") {
		t.Errorf("refusal does not name the setting: %v", err)
	}
	wantCode(t, connectErr(s.url(tok, "fence.session=00000000-0000-0000-0000-000000000000")), fence.CodeHolderMismatch)
}

// TestConsulHolderName: the status and fenceproxy_leader_info show the holder's Consul
// session and its Name (issue 13: the holder's name when known).
func TestConsulHolderName(t *testing.T) {
	reg := prometheus.NewRegistry()
	s := startConsulProxy(t)
	cfg := proxy.Config{Resources: []string{"billing=locks/billing"}, ConsulAddr: s.consul.Addr, ControlDatabase: s.pg.AdminURL()}
	p := testenv.StartProxy(t, s.pg, cfg, testenv.ProxyOptions{Admitter: s.guard, Registry: s.proxy.Registry, Registerer: reg})
	id, _, err := s.client.Session().Create(&api.SessionEntry{Name: "billing-worker-3", TTL: "60s", LockDelay: time.Millisecond}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if ok, _, err := s.client.KV().Acquire(&api.KVPair{Key: "locks/billing", Session: id}, nil); err != nil || !ok {
		t.Fatalf("acquire: %v %v", ok, err)
	}
	kv, _, err := s.client.KV().Get("locks/billing", &api.QueryOptions{RequireConsistent: true})
	if err != nil || kv == nil {
		t.Fatalf("read back: %v %v", kv, err)
	}
	eventually(t, 15*time.Second, "admitted", func() error { return connectErr(p.FenceURL("app", "postgres", "billing", int64(kv.LockIndex))) })
	eventually(t, 15*time.Second, "holder name in the status", func() error {
		st := p.Server.Status(ctxT(t))
		if len(st.Resources) != 1 || st.Resources[0].Holder != id || st.Resources[0].HolderName != "billing-worker-3" {
			return fmt.Errorf("status %+v", st.Resources)
		}
		return nil
	})
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, f := range families {
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if f.GetName() == "fenceproxy_leader_info" && labels["resource"] == "billing" && labels["holder"] == id &&
				labels["holder_name"] == "billing-worker-3" && m.GetGauge().GetValue() == 1 {
				found = true
			}
		}
	}
	if !found {
		t.Errorf("no fenceproxy_leader_info{resource=billing,holder=%s,holder_name=billing-worker-3} 1 in %v", id, families)
	}
}

// TestConsulLeaderChange: when Consul hands the lock over, the proxy raises
// the new token before the new leader connects; the raise ends the old
// leader's sessions (the one in a query in a transaction, and the idle one),
// and the proxy tells them ZF001.
func TestConsulLeaderChange(t *testing.T) {
	s := startConsulProxy(t)
	sess1, tok1 := consulLock(t, s.client, "locks/billing")
	old := connect(t, s.url(tok1))
	idle := connect(t, s.url(tok1))
	mustExec(t, old, "BEGIN")
	mustExec(t, old, "INSERT INTO items(tag) VALUES ('old-in-flight')")
	inflight := make(chan error, 1)
	go func() {
		_, err := old.Exec(context.Background(), "SELECT pg_sleep(30)")
		inflight <- err
	}()
	waitActive(t, s.admin, old.PgConn().PID(), "pg_sleep")

	// The old holder's session ends (as if its TTL expired); another takes over.
	if _, err := s.client.Session().Destroy(sess1, nil); err != nil {
		t.Fatal(err)
	}
	_, tok2 := consulLock(t, s.client, "locks/billing")
	if tok2 <= tok1 {
		t.Fatalf("new LockIndex %d <= %d", tok2, tok1)
	}
	// Proactive raise: the database has tok2 before the new leader connects.
	eventually(t, 15*time.Second, "proactive raise", func() error {
		if n := count(t, s.admin, "SELECT coalesce(max(token), 0)::int FROM fence.tokens WHERE resource = 'billing'"); int64(n) != tok2 {
			return fmt.Errorf("stored token %d", n)
		}
		return nil
	})
	// It committed once the old backends had exited.
	if n := count(t, s.admin, "SELECT count(*) FROM fence.bindings b JOIN pg_stat_activity a USING (pid, backend_start) WHERE b.resource = 'billing' AND b.token < $1", tok2); n != 0 {
		t.Fatalf("%d backends of the old token outlived the raise", n)
	}
	select {
	case err := <-inflight:
		wantStale(t, err)
	case <-time.After(15 * time.Second):
		t.Fatal("in-flight query of the old leader was not ended")
	}
	// The idle old session was ended, told why.
	_, err := idle.Exec(ctxT(t), "INSERT INTO items(tag) VALUES ('old-idle')")
	if pe := pgErrorOf(err); err == nil || pe != nil && pe.Code != fence.CodeStale {
		t.Fatalf("old idle session: want ZF001 or a closed connection, got %v", err)
	}
	wantSessionOver(t, old, fence.CodeStale)
	wantSessionOver(t, idle, fence.CodeStale)
	if n := count(t, s.admin, "SELECT count(*) FROM items WHERE tag LIKE 'old-%'"); n != 0 {
		t.Fatalf("%d writes of the old leader committed", n)
	}
	// The old token is refused at startup; the new one is admitted and writes.
	wantCode(t, connectErr(s.url(tok1)), fence.CodeStale)
	nc := connect(t, s.url(tok2))
	mustExec(t, nc, "INSERT INTO items(tag) VALUES ('new')")
}

// TestConsulRegression covers every way LockIndex goes backwards: the
// resource fails closed with ZF007 and says why, ending the sessions it
// admitted at their next message.
func TestConsulRegression(t *testing.T) {
	cases := []struct {
		name string
		// regress runs with the lock held by holder (token tok); it calls
		// ready(tok) once the session under test may connect with tok.
		regress func(t *testing.T, c *api.Client, holder string, tok int64, ready func(int64))
	}{
		{"key deleted and re-acquired", func(t *testing.T, c *api.Client, holder string, tok int64, ready func(int64)) {
			ready(tok)
			if _, err := c.KV().Delete("locks/billing", nil); err != nil {
				t.Fatal(err)
			}
			consulLock(t, c, "locks/billing")
		}},
		{"plain PUT on a held key", func(t *testing.T, c *api.Client, holder string, tok int64, ready func(int64)) {
			ready(tok)
			if _, err := c.KV().Put(&api.KVPair{Key: "locks/billing", Value: []byte("oops")}, nil); err != nil {
				t.Fatal(err)
			}
		}},
		{"snapshot restore", func(t *testing.T, c *api.Client, holder string, tok int64, ready func(int64)) {
			snap, _, err := c.Snapshot().Save(nil)
			if err != nil {
				t.Fatal(err)
			}
			buf, err := io.ReadAll(snap)
			snap.Close()
			if err != nil {
				t.Fatal(err)
			}
			// A newer leader after the snapshot...
			if _, _, err := c.KV().Release(&api.KVPair{Key: "locks/billing", Session: holder}, nil); err != nil {
				t.Fatal(err)
			}
			_, tok2 := consulLock(t, c, "locks/billing")
			ready(tok2)
			// ...then the restore moves LockIndex back.
			if err := c.Snapshot().Restore(nil, bytesReader(buf)); err != nil {
				t.Fatal(err)
			}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := startConsulProxy(t)
			holder, tok := consulLock(t, s.client, "locks/billing")
			var c *pgx.Conn
			var admitted int64 // the token c was admitted with
			tc.regress(t, s.client, holder, tok, func(tok int64) {
				admitted = tok
				eventually(t, 15*time.Second, "admitted", func() error {
					var err error
					c, err = pgx.Connect(ctxT(t), s.url(tok))
					return err
				})
				t.Cleanup(func() { c.Close(context.Background()) })
				mustExec(t, c, "INSERT INTO items(tag) VALUES ('before')")
			})
			// The session it admitted is ended at its next message once the
			// resource is blocked (ZF007, as the ERROR that answers it; or
			// ZF006 when the watch saw the lock free on the way, as when the
			// key is deleted first), then closed.
			attempt := 0
			var err error
			eventually(t, 15*time.Second, "existing session blocked", func() error {
				attempt++
				if _, err = c.Exec(ctxT(t), "INSERT INTO items(tag) VALUES ($1)", fmt.Sprint("after-", attempt)); err == nil {
					return errors.New("the write went through")
				}
				return nil
			})
			switch pe := pgErrorOf(err); {
			case pe == nil || pe.Severity != wire.SeverityError || pe.Code != fence.CodeUnavailable && pe.Code != fence.CodeNotHeld:
				t.Fatalf("write: want ERROR %s, got %v", fence.CodeUnavailable, err)
			case pe.Code == fence.CodeUnavailable && !strings.Contains(pe.Message, "went backwards"):
				t.Fatalf("message does not say why: %v", err)
			}
			wantSessionOver(t, c, pgErrorOf(err).Code)
			// New sessions are refused with ZF007, saying why.
			eventually(t, 15*time.Second, "new sessions refused", func() error {
				err := connectErr(s.url(admitted))
				if sqlstate(err) != fence.CodeUnavailable || !strings.Contains(err.Error(), "went backwards") {
					return fmt.Errorf("got %v", err)
				}
				return nil
			})
			p, _, err := s.client.KV().Get("locks/billing", &api.QueryOptions{RequireConsistent: true})
			if err != nil {
				t.Fatal(err)
			}
			var cur int64
			if p != nil {
				cur = int64(p.LockIndex)
			}
			for _, tok := range []int64{cur, cur + 1, tok} {
				if tok <= 0 {
					continue
				}
				if err := connectErr(s.url(tok)); sqlstate(err) == "" {
					t.Fatalf("token %d admitted after a regression", tok)
				}
			}
			if n := count(t, s.admin, "SELECT count(*) FROM items WHERE tag = $1", fmt.Sprint("after-", attempt)); n != 0 {
				t.Fatal("the refused write committed")
			}
		})
	}
}

// TestConsulOutageUnderLoad: while Consul is down, admitted sessions keep
// writing (their backends are bound: a raise would still end them) and new sessions are refused with
// ZF007; after Consul comes back, new sessions are admitted again.
func TestConsulOutageUnderLoad(t *testing.T) {
	s := startConsulProxy(t)
	_, tok := consulLock(t, s.client, "locks/billing")
	conns := []*pgx.Conn{connect(t, s.url(tok)), connect(t, s.url(tok))}
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var ok, failed atomic.Int64
	for i, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for n := 0; ctx.Err() == nil; n++ {
				if _, err := c.Exec(ctx, "INSERT INTO items(tag) VALUES ($1)", fmt.Sprintf("load-%d-%d", i, n)); err != nil {
					if ctx.Err() == nil {
						failed.Add(1)
					}
				} else {
					ok.Add(1)
				}
				time.Sleep(5 * time.Millisecond)
			}
		}()
	}
	time.Sleep(300 * time.Millisecond)
	s.consul.Stop(t)
	before := ok.Load()
	eventually(t, 15*time.Second, "new sessions refused while Consul is down", func() error {
		if err := connectErr(s.url(tok)); sqlstate(err) != fence.CodeUnavailable {
			return fmt.Errorf("got %v", err)
		}
		return nil
	})
	time.Sleep(300 * time.Millisecond)
	if ok.Load() <= before {
		t.Fatal("admitted sessions stopped writing while Consul was down")
	}
	s.consul.Start(t)
	eventually(t, 15*time.Second, "new sessions admitted after Consul is back", func() error { return connectErr(s.url(tok)) })
	stop()
	wg.Wait()
	if failed.Load() != 0 {
		t.Fatalf("%d writes of the admitted sessions failed during the outage", failed.Load())
	}
	t.Logf("writes during the test: %d", ok.Load())
}

// TestConsulDownTrustDatabase: with --consul-down=trust-database, new
// sessions are admitted on the database's word while Consul is down, and a
// token lower than the stored one is still refused.
func TestConsulDownTrustDatabase(t *testing.T) {
	s := startConsulProxy(t, func(c *proxy.Config) { c.ConsulDownMode = proxy.ConsulDownTrustDatabase })
	sess0, _ := consulLock(t, s.client, "locks/billing")
	if _, err := s.client.Session().Destroy(sess0, nil); err != nil {
		t.Fatal(err)
	}
	_, tok := consulLock(t, s.client, "locks/billing") // >= 2
	eventually(t, 15*time.Second, "admitted while Consul is up", func() error { return connectErr(s.url(tok)) })
	s.consul.Stop(t)
	eventually(t, 15*time.Second, "admitted while Consul is down", func() error { return connectErr(s.url(tok)) })
	wantCode(t, connectErr(s.url(tok-1)), fence.CodeStale)
}
