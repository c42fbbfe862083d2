package proxy_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

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
