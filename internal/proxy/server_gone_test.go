package proxy_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

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
			var pe *pgconn.PgError
			if !errors.As(err, &pe) {
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
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		t.Fatalf("%v, want the proxy's error", err)
	}
	if pe.Code != wire.CodeConnectionFailure || !strings.Contains(pe.Message, "went away") || !strings.Contains(pe.Hint, "not a raise") {
		t.Fatalf("%s %q (hint %q), want 08006 saying the server went away, not a raise", pe.Code, pe.Message, pe.Hint)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		c2, err := pgx.Connect(ctxT(t), px.FenceURL("app", "postgres", "billing", 34))
		if err == nil {
			mustExec(t, c2, "INSERT INTO items (tag, token) VALUES ('b', 34)")
			c2.Close(ctxT(t))
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the leader could not reconnect within 30 s: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
