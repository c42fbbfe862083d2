package proxy_test

import (
	"testing"

	"github.com/jackc/pgx/v5"
)

// TestPreparedCheckSurvivesDeallocation: the proxy prepares its check once
// per session; whatever removes it (DEALLOCATE, DISCARD ALL, a Close of its
// name, or DEALLOCATE run inside a function), the check still runs.
func TestPreparedCheckSurvivesDeallocation(t *testing.T) {
	pg, admin := fencedDB(t)
	p := fencedProxy(t, pg)
	ctx := ctxT(t)
	tricks := []struct {
		name string
		do   func(c *pgx.Conn) error
	}{
		{"DEALLOCATE ALL in a string", func(c *pgx.Conn) error { return simple(ctx, c, "SELECT 1; DEALLOCATE ALL; SELECT 2") }},
		{"DEALLOCATE by name", func(c *pgx.Conn) error { return simple(ctx, c, "DEALLOCATE __fenceproxy_check") }},
		{"DISCARD ALL", func(c *pgx.Conn) error { return simple(ctx, c, "DISCARD ALL") }},
		{"DEALLOCATE ALL extended", func(c *pgx.Conn) error {
			_, err := c.PgConn().ExecParams(ctx, "DEALLOCATE ALL", nil, nil, nil, nil).Close()
			return err
		}},
		{"DEALLOCATE inside a function", func(c *pgx.Conn) error {
			return simple(ctx, c, "BEGIN; DO $$BEGIN EXECUTE 'DEALLOCATE ALL'; END$$; COMMIT")
		}},
	}
	for i, tt := range tricks {
		t.Run(tt.name, func(t *testing.T) {
			tok := int64(10 * (i + 1))
			old := connect(t, p.FenceURL("app", "postgres", "billing", tok))
			if err := tt.do(old); err != nil {
				t.Logf("the trick itself: %v", err)
			}
			// Writes with the current token keep working (at most one
			// failure, the one that finds the check gone)...
			failures := 0
			for range 2 {
				if _, err := old.Exec(ctx, "INSERT INTO items(tag) VALUES ('dealloc')", pgx.QueryExecModeSimpleProtocol); err != nil {
					failures++
					t.Logf("write after the trick: %v", err)
				}
			}
			if failures > 1 {
				t.Fatal("the session cannot write with its current token")
			}
			// ...and a stale one is still refused.
			connect(t, p.FenceURL("app", "postgres", "billing", tok+1))
			before := count(t, admin, "SELECT count(*) FROM items WHERE tag = 'dealloc-stale'")
			_, err := old.Exec(ctx, "INSERT INTO items(tag) VALUES ('dealloc-stale')", pgx.QueryExecModeSimpleProtocol)
			if err == nil {
				t.Fatal("stale write accepted")
			}
			if n := count(t, admin, "SELECT count(*) FROM items WHERE tag = 'dealloc-stale'"); n != before {
				t.Fatal("stale write committed")
			}
		})
	}
}
