package proxy_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/faulthop"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// TestServerGoneIsNotBlamedOnARaise (issue 21 part 3): a fenced session that the server's
// crash (immediate shutdown) or shutdown (fast: FATAL 57P01, the code a raise's
// pg_terminate_backend sends too) ends is told that the server went away, not that a raise
// may have ended it, with or without a control database to ask.
func TestServerGoneIsNotBlamedOnARaise(t *testing.T) {
	for _, tc := range []struct {
		name    string
		control bool
		stop    func(t *testing.T, pg *testenv.Postgres)
		code    string
	}{
		{"crash", false, func(t *testing.T, pg *testenv.Postgres) { pg.Kill(t) }, wire.CodeConnectionFailure},
		{"crash-control", true, func(t *testing.T, pg *testenv.Postgres) { pg.Kill(t) }, wire.CodeConnectionFailure},
		{"shutdown-control", true, func(t *testing.T, pg *testenv.Postgres) { pg.Stop(t) }, wire.CodeAdminShutdown},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pg, _ := fencedDB(t)
			px := fencedProxy(t, pg, func(c *proxy.Config) {
				if tc.control {
					c.ControlDatabase = pg.AdminURL()
				}
			})
			c := connect(t, px.FenceURL("app", "postgres", "billing", 3))
			mustExec(t, c, "INSERT INTO items (tag, token) VALUES ('a', 3)")
			tc.stop(t, pg)
			_, err := c.Exec(ctxT(t), "INSERT INTO items (tag, token) VALUES ('a', 3)")
			pe := pgErrorOf(err)
			if pe == nil {
				t.Fatalf("%v, want the proxy's error", err)
			}
			if pe.Code != tc.code || !strings.Contains(pe.Hint, "the server went away") || !strings.Contains(pe.Hint, "not a raise") {
				t.Fatalf("%s %q (hint %q), want %s with a hint that the server went away, not a raise", pe.Code, pe.Message, pe.Hint, tc.code)
			}
		})
	}
}

// TestVirtualIPFailoverEndsSessionsAsGone (issue 21 setup 4's last sentence): behind a
// virtual IP (a relay the test retargets and cuts), the session of the leader that the
// primary's crash and the standby's promotion ended is told the server went away, not that a
// raise may have ended it; its reconnection writes on the promoted standby.
func TestVirtualIPFailoverEndsSessionsAsGone(t *testing.T) {
	pg, sb := replicatedDB(t)
	vip, err := faulthop.Start("", fmt.Sprintf("%s:%d", pg.Host, pg.Port))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = vip.Close(context.Background()) })
	px := testenv.StartProxy(t, pg, proxy.Config{
		Upstream:        "postgres://" + vip.Addr,
		Resources:       []string{"billing"},
		ControlDatabase: fmt.Sprintf("postgres://%s:%s@%s/postgres?sslmode=disable", testenv.AdminUser, testenv.AdminPassword, vip.Addr),
	})
	c := connect(t, px.FenceURL("app", "postgres", "billing", 34))
	mustExec(t, c, "INSERT INTO items (tag, token) VALUES ('b', 34)")
	sb.WaitFlushed(t, pg.CurrentLSN(t), 30*time.Second)

	pg.Kill(t)
	sb.Promote(t)
	vip.Retarget(fmt.Sprintf("%s:%d", sb.Host, sb.Port))
	vip.Cut()

	_, err = c.Exec(ctxT(t), "INSERT INTO items (tag, token) VALUES ('b', 34)")
	pe := pgErrorOf(err)
	if pe == nil {
		t.Fatalf("%v, want the proxy's error", err)
	}
	if pe.Code != wire.CodeConnectionFailure || !strings.Contains(pe.Message, "went away") || !strings.Contains(pe.Hint, "not a raise") {
		t.Fatalf("%s %q (hint %q), want 08006 saying the server went away, not a raise", pe.Code, pe.Message, pe.Hint)
	}
	eventually(t, 30*time.Second, "the leader reconnects", func() error {
		c2, err := pgx.Connect(ctxT(t), px.FenceURL("app", "postgres", "billing", 34))
		if err == nil {
			mustExec(t, c2, "INSERT INTO items (tag, token) VALUES ('b', 34)")
			c2.Close(ctxT(t))
		}
		return err
	})
}

// TestServerFatalRelayedAlone: a fenced session whose backend ends with a FATAL of its own (not a raise's
// 57P01) sees exactly what a direct one sees: the server's FATAL, then the
// end. (At 76c742c the proxy added, a second later, a FATAL 08006 "the server
// closed the connection" whose hint blamed a raise. Found by the generated
// sequences, seed 38.)
func TestServerFatalRelayedAlone(t *testing.T) {
	t.Parallel()
	e := startStaleEnv(t, []string{"ownfatal"})
	for _, tc := range []struct {
		name  string
		msgs  []pgproto3.FrontendMessage
		sleep time.Duration
	}{
		{"08P01 protocol synchronization lost in COPY", frontendMsgs(parseBindExecute("", "", "COPY public.v2_rows (resource, token, tag) FROM STDIN"), queryMsg("SELECT 1")), 0},
		{"25P03 idle-in-transaction timeout", frontendMsgs(queryMsg("SET idle_in_transaction_session_timeout = '200ms'"), queryMsg("BEGIN")), 700 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			run := func(addr string, params map[string]string) []string {
				s, err := dialSession(addr, params)
				if err != nil {
					t.Fatal(err)
				}
				defer s.Close()
				if err := s.send(tc.msgs...); err != nil {
					t.Fatal(err)
				}
				time.Sleep(tc.sleep)
				rest, err := s.drain(10 * time.Second)
				if err != nil {
					t.Fatal(err)
				}
				var out []string
				for _, m := range rest {
					out = append(out, m.Text)
				}
				return append(out, "EOF")
			}
			d := run(addrOf(e.pg.Host, e.pg.Port), fenceParams("postgres", "", 0))
			p := run(addrOf(e.a.Host, e.a.Port), fenceParams("postgres", "ownfatal", 1))
			if strings.Join(d, "\n") != strings.Join(p, "\n") {
				t.Fatalf("the proxy's session differs from a direct one:\n%s", diffLines(d, p))
			}
			t.Logf("%d messages alike, the last: %s", len(d), shortText(d[len(d)-2]))
		})
	}
}

// TestServerFatalOfFencedSessionRelayedAlone (found by TestGeneratedSequences
// seed 38 after the F7 fix): when the server ends a fenced session with a
// FATAL error of its own that is not a raise's 57P01 (here the idle-session
// timeout, 57P05), the client gets that error and the end of the connection,
// as directly, and not a second FATAL 08006 "the server closed the
// connection" with a hint that blames a raise.
func TestServerFatalOfFencedSessionRelayedAlone(t *testing.T) {
	t.Parallel()
	pg, _ := fencedDB(t)
	p := fencedProxy(t, pg)
	for _, via := range []struct{ name, addr string }{{"direct", pgAddr(pg)}, {"fenced", proxyAddr(p)}} {
		t.Run(via.name, func(t *testing.T) {
			r := dialRaw(t, via.addr)
			params := []string{"user", "app", "database", "postgres"}
			if via.name == "fenced" {
				params = append(params, "fence.resource", "billing", "fence.token", "5")
			}
			if tr := r.startup(196608, params...); !strings.HasPrefix(tr[len(tr)-1], "ReadyForQuery") {
				t.Fatalf("startup: %q", tr)
			}
			r.send(&pgproto3.Query{String: "SET idle_session_timeout = '200ms'"})
			if _, err := r.readUntil(1, ""); err != nil {
				t.Fatal(err)
			}
			r.conn.SetReadDeadline(time.Now().Add(10 * time.Second)) //nolint:errcheck
			msgs, err := r.readAll()
			if !isClosed(err) {
				t.Fatalf("the session did not end: %v", err)
			}
			var got []string
			for _, m := range msgs {
				if e, ok := m.(*pgproto3.ErrorResponse); ok {
					got = append(got, e.Severity+" "+e.Code+": "+e.Message)
				}
			}
			if len(got) != 1 || !strings.HasPrefix(got[0], "FATAL 57P05: ") {
				t.Fatalf("want the server's FATAL 57P05 alone, got %q", got)
			}
		})
	}
}
