package proxy_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
)

// deallocWrites reach a commit the three ways that place the check
// differently: appended to an autocommit simple Query, ahead of a lone
// COMMIT Query, and before the Sync of an extended-protocol statement.
var deallocWrites = []struct {
	name  string
	write func(ctx context.Context, c *pgx.Conn, tag string) error
}{
	{"simple autocommit", func(ctx context.Context, c *pgx.Conn, tag string) error {
		_, err := c.Exec(ctx, "INSERT INTO items(tag) VALUES ('"+tag+"')", pgx.QueryExecModeSimpleProtocol)
		return err
	}},
	{"simple block", func(ctx context.Context, c *pgx.Conn, tag string) error {
		for _, q := range []string{"BEGIN", "INSERT INTO items(tag) VALUES ('" + tag + "')", "COMMIT"} {
			if err := simple(ctx, c, q); err != nil {
				return err
			}
		}
		return nil
	}},
	{"extended", func(ctx context.Context, c *pgx.Conn, tag string) error {
		_, err := c.Exec(ctx, "INSERT INTO items(tag) VALUES ($1)", pgx.QueryExecModeExec, tag)
		return err
	}},
}

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
		// hidden: the proxy cannot see the deallocation (it happens inside
		// a function), so the first commit after it finds the check gone.
		hidden bool
	}{
		{"DEALLOCATE ALL in a string", func(c *pgx.Conn) error { return simple(ctx, c, "SELECT 1; DEALLOCATE ALL; SELECT 2") }, false},
		{"DEALLOCATE by name", func(c *pgx.Conn) error { return simple(ctx, c, "DEALLOCATE __fenceproxy_check") }, false},
		{"DISCARD ALL", func(c *pgx.Conn) error { return simple(ctx, c, "DISCARD ALL") }, false},
		{"DEALLOCATE ALL extended", func(c *pgx.Conn) error {
			_, err := c.PgConn().ExecParams(ctx, "DEALLOCATE ALL", nil, nil, nil, nil).Close()
			return err
		}, false},
		{"DEALLOCATE inside a function", func(c *pgx.Conn) error {
			return simple(ctx, c, "BEGIN; DO $$BEGIN EXECUTE 'DEALLOCATE ALL'; END$$; COMMIT")
		}, true},
		{"DEALLOCATE inside a function, extended", func(c *pgx.Conn) error {
			// The COMMIT's check is a Bind of the prepared check, which fails:
			// the COMMIT fails, the block is rolled back, and the session
			// sends the check's text from then on.
			for _, q := range []string{"BEGIN", "DO $$BEGIN EXECUTE 'DEALLOCATE ALL'; END$$", "COMMIT"} {
				if _, err := c.PgConn().ExecParams(ctx, q, nil, nil, nil, nil).Close(); err != nil {
					return err
				}
			}
			return nil
		}, true},
	}
	for i, tt := range tricks {
		t.Run(tt.name, func(t *testing.T) {
			tok := int64(10 * (i + 1))
			old := connect(t, p.FenceURL("app", "postgres", "billing", tok))
			if err := tt.do(old); err != nil {
				t.Logf("the trick itself: %v", err)
			}
			if st := old.PgConn().TxStatus(); st != 'I' {
				t.Fatalf("after the trick the session is in state %q, want idle", st)
			}
			// Writes with the current token keep working, whichever way
			// they reach their commit (after a hidden deallocation, at most
			// one failure: the one that finds the check gone)...
			failures := 0
			for range 2 {
				for _, w := range deallocWrites {
					if err := w.write(ctx, old, "dealloc"); err != nil {
						failures++
						t.Logf("%s after the trick: %v", w.name, err)
					}
				}
			}
			if allowed := map[bool]int{false: 0, true: 1}[tt.hidden]; failures > allowed {
				t.Fatalf("%d writes with the current token failed, want at most %d", failures, allowed)
			}
			// ...and a stale one is still refused.
			connect(t, p.FenceURL("app", "postgres", "billing", tok+1))
			before := count(t, admin, "SELECT count(*) FROM items WHERE tag = 'dealloc-stale'")
			for _, w := range deallocWrites {
				if err := w.write(ctx, old, "dealloc-stale"); err == nil {
					t.Fatalf("%s: stale write accepted", w.name)
				}
			}
			if n := count(t, admin, "SELECT count(*) FROM items WHERE tag = 'dealloc-stale'"); n != before {
				t.Fatal("stale write committed")
			}
		})
	}
}
