package proxy_test

import (
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// hostsURL is a multi-host --upstream over the given clusters, with query.
func hostsURL(query string, pgs ...*testenv.Postgres) string {
	var hosts []string
	for _, p := range pgs {
		hosts = append(hosts, fmt.Sprintf("%s:%d", p.Host, p.Port))
	}
	return "postgres://" + strings.Join(hosts, ",") + "/" + query
}

// controlURL is the control database on every cluster, the primary chosen (read-write).
func controlURL(pgs ...*testenv.Postgres) string {
	var hosts []string
	for _, p := range pgs {
		hosts = append(hosts, fmt.Sprintf("%s:%d", p.Host, p.Port))
	}
	return fmt.Sprintf("postgres://%s:%s@%s/postgres?sslmode=disable&target_session_attrs=read-write",
		testenv.AdminUser, testenv.AdminPassword, strings.Join(hosts, ","))
}

// serverPort is the port of the server a connection reached.
func serverPort(t *testing.T, c *pgx.Conn) int {
	t.Helper()
	var port int
	if err := c.QueryRow(ctxT(t), "SELECT inet_server_port()").Scan(&port); err != nil {
		t.Fatal(err)
	}
	return port
}

// freePort is a loopback port where nothing listens.
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	return port
}

// TestMultiHostFirstHostDown: with the first host of --upstream down, sessions go to the
// next one, and the proxy is ready.
func TestMultiHostFirstHostDown(t *testing.T) {
	pg, _ := fencedDB(t)
	upstream := fmt.Sprintf("postgres://127.0.0.1:%d,%s:%d/?target_session_attrs=read-write", freePort(t), pg.Host, pg.Port)
	px := fencedProxy(t, pg, func(c *proxy.Config) { c.Upstream, c.ControlDatabase = upstream, pg.AdminURL() })

	c := connect(t, px.FenceURL("app", "postgres", "billing", 1))
	mustExec(t, c, "INSERT INTO items (tag, token) VALUES ('a', 1)")
	if p := serverPort(t, c); p != pg.Port {
		t.Fatalf("the session reached port %d, want the primary's %d", p, pg.Port)
	}
	eventually(t, 15*time.Second, "ready with the second host the primary", func() error {
		if why := px.Server.NotReady(ctxT(t)); len(why) > 0 {
			return fmt.Errorf("not ready: %v", why)
		}
		return nil
	})
}

// TestMultiHostFirstHostStandby: with a hot standby first in --upstream, fenced sessions go
// to the primary whatever target_session_attrs says; unfenced sessions follow it (standby:
// to the standby).
func TestMultiHostFirstHostStandby(t *testing.T) {
	pg, sb := replicatedDB(t)
	for _, attrs := range []string{"any", "standby", "prefer-standby", "read-write"} {
		t.Run(attrs, func(t *testing.T) {
			px := fencedProxy(t, pg, func(c *proxy.Config) {
				c.Upstream = hostsURL("?target_session_attrs="+attrs, sb.Postgres, pg)
				c.ControlDatabase = controlURL(sb.Postgres, pg)
				c.Unfenced = proxy.UnfencedReadOnly
			})
			for i := range 3 {
				c := connect(t, px.FenceURL("app", "postgres", "billing", 5))
				if p := serverPort(t, c); p != pg.Port {
					t.Fatalf("fenced session %d reached port %d, want the primary's %d", i, p, pg.Port)
				}
				mustExec(t, c, "INSERT INTO items (tag, token) VALUES ('a', 5)")
				c.Close(ctxT(t))
			}
			want := map[string]int{"any": sb.Port, "standby": sb.Port, "prefer-standby": sb.Port, "read-write": pg.Port}[attrs]
			u := connect(t, px.URL("app", "postgres"))
			if p := serverPort(t, u); p != want {
				t.Fatalf("unfenced session with target_session_attrs=%s reached port %d, want %d", attrs, p, want)
			}
			eventually(t, 15*time.Second, "ready with a primary among the hosts", func() error {
				if why := px.Server.NotReady(ctxT(t)); len(why) > 0 {
					return fmt.Errorf("not ready: %v", why)
				}
				return nil
			})
		})
	}
}

// TestReadyzNotReadyBeforeOnlyStandby: a proxy whose --upstream is a hot standby is not
// ready (it said ready, and refused every fenced session with ZF007 "cannot set
// transaction read-write mode during recovery"); a fenced session is refused with 57P03
// saying the server is a standby; once the standby is promoted, the proxy is ready and the
// session starts. Without a control database the proxy learns it from the first session.
func TestReadyzNotReadyBeforeOnlyStandby(t *testing.T) {
	pg, sb := replicatedDB(t)
	upstream := hostsURL("", sb.Postgres)
	checked := fencedProxy(t, pg, func(c *proxy.Config) {
		c.Upstream, c.ControlDatabase = upstream, pg.AdminURL() // the listener on the primary
		c.UpstreamCheckInterval = 100 * time.Millisecond
	})
	passive := fencedProxy(t, pg, func(c *proxy.Config) { c.Upstream = upstream })

	eventually(t, 10*time.Second, "in front of a standby: not ready for want of a writable primary", func() error {
		why := strings.Join(checked.Server.NotReady(ctxT(t)), "; ")
		if strings.Contains(why, "no writable primary") && strings.Contains(why, fmt.Sprint(sb.Port)) {
			return nil
		}
		if why == "" {
			t.Fatalf("in front of a standby: not ready %q, want no writable primary naming the standby", why)
		}
		return fmt.Errorf("not ready %q, want no writable primary naming the standby", why)
	})
	for _, px := range []*testenv.Proxy{checked, passive} {
		err := connectErr(px.FenceURL("app", "postgres", "billing", 7))
		wantCode(t, err, wire.CodeCannotConnectNow)
		if !strings.Contains(err.Error(), "is a standby") || !strings.Contains(err.Error(), "needs the writable primary") {
			t.Fatalf("refusal does not say the server is a standby: %v", err)
		}
	}
	if why := strings.Join(passive.Server.NotReady(ctxT(t)), "; "); !strings.Contains(why, "no writable primary") {
		t.Fatalf("without a control database, after a session found the standby: not ready %q", why)
	}

	sb.Promote(t)
	eventually(t, 30*time.Second, "ready after the promotion", func() error {
		if why := checked.Server.NotReady(ctxT(t)); len(why) > 0 {
			return fmt.Errorf("not ready: %v", why)
		}
		return nil
	})
	c := connect(t, checked.FenceURL("app", "postgres", "billing", 7))
	mustExec(t, c, "INSERT INTO items (tag, token) VALUES ('a', 7)")
	connect(t, passive.FenceURL("app", "postgres", "billing", 7)).Close(ctxT(t))
	if why := passive.Server.NotReady(ctxT(t)); len(why) > 0 {
		t.Fatalf("without a control database, after a session found the primary: not ready %v", why)
	}
}

// TestMultiHostFailoverWithOpenSessions (issue 21 part 4): two hosts, the primary first; a
// failover (the primary crashes, the standby is promoted) while sessions are open. The old
// primary's sessions end with an error that says the server went away, not one that blames a
// raise; new sessions go to the promoted standby; fencing still holds there: the stale token
// is refused, the current one writes.
func TestMultiHostFailoverWithOpenSessions(t *testing.T) {
	pg, sb := replicatedDB(t)
	px := multiHostProxy(t, pg, sb)
	connect(t, px.FenceURL("app", "postgres", "billing", 33)).Close(ctxT(t))
	var open []*pgx.Conn
	for range 3 {
		c := connect(t, px.FenceURL("app", "postgres", "billing", 34))
		mustExec(t, c, "INSERT INTO items (tag, token) VALUES ('b', 34)")
		open = append(open, c)
	}
	if p := serverPort(t, open[0]); p != pg.Port {
		t.Fatalf("before the failover the session reached port %d, want the primary's %d", p, pg.Port)
	}

	sb.WaitFlushed(t, pg.CurrentLSN(t), 30*time.Second) // the raise to 34 is on the standby (docs/failover.md: --failover-standbys)
	pg.Kill(t)
	sb.Promote(t)

	for i, c := range open {
		_, err := c.Exec(ctxT(t), "INSERT INTO items (tag, token) VALUES ('b', 34)")
		pe := pgErrorOf(err)
		if pe == nil {
			t.Fatalf("session %d on the lost primary: %v, want the proxy's error", i, err)
		}
		if pe.Code != wire.CodeConnectionFailure || !strings.Contains(pe.Message, "went away") ||
			!strings.Contains(pe.Hint, "not a raise") || strings.Contains(pe.Hint, "stop writing") {
			t.Fatalf("session %d on the lost primary: %s %q (hint %q), want 08006 saying the server went away, not a raise", i, pe.Code, pe.Message, pe.Hint)
		}
	}

	// New sessions go to the promoted standby (once the monitor has seen it: a session that
	// reaches the dead host first is refused with a connection error and retries).
	var c *pgx.Conn
	eventually(t, 30*time.Second, "a session on the promoted standby", func() error {
		var err error
		c, err = pgx.Connect(ctxT(t), px.FenceURL("app", "postgres", "billing", 34))
		return err
	})
	defer c.Close(ctxT(t))
	if p := serverPort(t, c); p != sb.Port {
		t.Fatalf("after the failover the session reached port %d, want the promoted standby's %d", p, sb.Port)
	}
	mustExec(t, c, "INSERT INTO items (tag, token) VALUES ('b', 34)")
	wantStale(t, connectErr(px.FenceURL("app", "postgres", "billing", 33)))
	if got := storedToken(t, connect(t, sb.Postgres.AdminURL()), "billing"); got != 34 {
		t.Fatalf("the promoted standby stores token %d, want 34", got)
	}
	if h := px.Registry.Highest("postgres", "billing"); h != 34 {
		t.Fatalf("the proxy knows token %d after the failover, want 34", h)
	}
}

// TestMultiHostNewPrimaryEndsFencedSessionsElsewhere: when another host of --upstream becomes
// the primary, the fenced sessions on the old one end at once, whatever the old one now says:
// frozen (a stopped VM whose open transaction would commit when it wakes, after the new
// primary admitted a higher token: a review's F10) or still primary (a split brain). Here the
// standby is promoted while the primary runs on: the open transaction's COMMIT does not reach
// the old primary, and nothing of it is there.
func TestMultiHostNewPrimaryEndsFencedSessionsElsewhere(t *testing.T) {
	pg, sb := replicatedDB(t)
	px := multiHostProxy(t, pg, sb)
	a := connect(t, px.FenceURL("app", "postgres", "billing", 1))
	mustExec(t, a, "BEGIN")
	mustExec(t, a, "INSERT INTO items (tag, token) VALUES ('frozen', 1)")
	sb.Promote(t)
	eventually(t, 30*time.Second, "the fenced session on the old primary ended", func() error {
		if a.IsClosed() {
			return nil
		}
		if _, err := a.Exec(ctxT(t), "SELECT 1"); err != nil {
			return nil
		}
		return fmt.Errorf("the session on the old primary still runs statements")
	})
	if n := count(t, connect(t, pg.AdminURL()), "SELECT count(*) FROM items WHERE tag = 'frozen'"); n != 0 {
		t.Fatalf("%d rows of the ended session committed on the old primary", n)
	}
}

// multiHostProxy is a fenced proxy whose --upstream and control database list the primary
// then the standby, the monitor reading their roles every 100 ms.
func multiHostProxy(t *testing.T, pg *testenv.Postgres, sb *testenv.Standby) *testenv.Proxy {
	return fencedProxy(t, pg, func(c *proxy.Config) {
		c.Upstream = hostsURL("?target_session_attrs=read-write", pg, sb.Postgres)
		c.ControlDatabase = controlURL(pg, sb.Postgres)
		c.UpstreamCheckInterval = 100 * time.Millisecond
	})
}

// TestMultiHostFrozenOldPrimaryLocksNobodyOut: the old primary of a failover is frozen (a
// paused VM: its sockets accept and nothing answers), not down. The proxy's control
// connections (the standby wait's, the listener's) go to the primary its monitor reads, not to
// the first host of the control URL, which they waited for without end; and sessions go to the
// primary of the newest timeline at once, not to the old one while its overdue reading has not
// failed yet (a review: every fenced start refused ZF007 "s2 did not confirm" for minutes, also
// after a restart of the proxy, and a session waited 15 s on the frozen host).
func TestMultiHostFrozenOldPrimaryLocksNobodyOut(t *testing.T) {
	pg, sb := replicatedDB(t)
	cfg := proxy.Config{
		Resources:             []string{"billing", "other"},
		Upstream:              hostsURL("?target_session_attrs=read-write", pg, sb.Postgres),
		ControlDatabase:       controlURL(pg, sb.Postgres),
		UpstreamCheckInterval: 100 * time.Millisecond,
		FailoverStandbys:      []string{"s1"},
		StandbyFlushTimeout:   3 * time.Second,
	}
	px := testenv.StartProxy(t, pg, cfg)
	connect(t, px.FenceURL("app", "postgres", "billing", 1)).Close(ctxT(t))

	pg.Freeze(t)
	sb.Promote(t)
	testenv.StartStandby(t, sb.Postgres, "s2")
	cfg.Listen = net.JoinHostPort(px.Host, strconv.Itoa(px.Port))
	cfg.FailoverStandbys = []string{"s2"}
	if _, skipped, err := px.Server.Reload(cfg); err != nil || len(skipped) > 0 {
		t.Fatalf("reload with s2: skipped %q, %v", skipped, err)
	}
	eventually(t, 30*time.Second, "the new leader admitted on the new primary", writes(px, 2))
	for i := range 3 {
		began := time.Now()
		if err := writes(px, 2)(); err != nil {
			t.Fatalf("session %d after the failover: %v", i+1, err)
		}
		if took := time.Since(began); took > 3*time.Second {
			t.Fatalf("session %d after the failover took %v: it waited for the frozen old primary", i+1, took)
		}
	}
}
