package proxy_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// A writePath writes rows tagged tag through conn, one way a client can
// write. It calls raise exactly once, at the point where a new leader's
// raise is most interesting for that path (usually in the middle of the
// transaction, before its commit), and returns the error the client sees.
type writePath struct {
	name  string
	write func(ctx context.Context, conn *pgx.Conn, tag string, raise func()) error
	// written reports whether rows (or objects) tagged tag exist; nil: items rows.
	written func(t *testing.T, admin querier, tag string) bool
	// serial: the path runs alone, not in parallel with the others (a
	// prepared transaction anywhere in the database makes every raise fail).
	serial bool
}

func simple(ctx context.Context, conn *pgx.Conn, sql string) error {
	_, err := conn.PgConn().Exec(ctx, sql).ReadAll()
	return err
}

func ins(tag string) string { return fmt.Sprintf("INSERT INTO items(tag) VALUES ('%s')", tag) }

var writePaths = []writePath{
	{name: "simple autocommit", write: func(ctx context.Context, c *pgx.Conn, tag string, raise func()) error {
		raise()
		return simple(ctx, c, ins(tag))
	}},
	{name: "simple multi-statement", write: func(ctx context.Context, c *pgx.Conn, tag string, raise func()) error {
		raise()
		return simple(ctx, c, ins(tag)+"; "+ins(tag)+"; SELECT 1")
	}},
	{name: "simple implicit COMMIT in string", write: func(ctx context.Context, c *pgx.Conn, tag string, raise func()) error {
		raise()
		return simple(ctx, c, ins(tag)+"; COMMIT; "+ins(tag+"-after"))
	}},
	{name: "simple BEGIN..COMMIT in one string", write: func(ctx context.Context, c *pgx.Conn, tag string, raise func()) error {
		raise()
		return simple(ctx, c, "BEGIN; "+ins(tag)+"; COMMIT")
	}},
	{name: "simple block END", write: func(ctx context.Context, c *pgx.Conn, tag string, raise func()) error {
		if err := simple(ctx, c, "BEGIN; "+ins(tag)); err != nil {
			return err
		}
		raise()
		return simple(ctx, c, "END")
	}},
	{name: "simple COMMIT AND CHAIN", write: func(ctx context.Context, c *pgx.Conn, tag string, raise func()) error {
		if err := simple(ctx, c, "BEGIN; "+ins(tag)); err != nil {
			return err
		}
		raise()
		err := simple(ctx, c, "COMMIT AND CHAIN")
		simple(ctx, c, "ROLLBACK") //nolint:errcheck
		return err
	}},
	{name: "PREPARE TRANSACTION", write: func(ctx context.Context, c *pgx.Conn, tag string, raise func()) error {
		if err := simple(ctx, c, "BEGIN; "+ins(tag)); err != nil {
			return err
		}
		raise()
		gid := "gid-" + tag
		if err := simple(ctx, c, "PREPARE TRANSACTION '"+gid+"'"); err != nil {
			return err
		}
		return simple(ctx, c, "COMMIT PREPARED '"+gid+"'")
	}, serial: true},
	{name: "extended autocommit", write: func(ctx context.Context, c *pgx.Conn, tag string, raise func()) error {
		raise()
		_, err := c.Exec(ctx, "INSERT INTO items(tag) VALUES ($1)", tag)
		return err
	}},
	{name: "extended block", write: func(ctx context.Context, c *pgx.Conn, tag string, raise func()) error {
		tx, err := c.Begin(ctx)
		if err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "INSERT INTO items(tag) VALUES ($1)", tag); err != nil {
			return err
		}
		raise()
		return tx.Commit(ctx)
	}},
	{name: "extended REPEATABLE READ", write: func(ctx context.Context, c *pgx.Conn, tag string, raise func()) error {
		tx, err := c.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
		if err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "SELECT count(*) FROM fence.tokens"); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "INSERT INTO items(tag) VALUES ($1)", tag); err != nil {
			return err
		}
		raise()
		return tx.Commit(ctx)
	}},
	{name: "extended SERIALIZABLE", write: func(ctx context.Context, c *pgx.Conn, tag string, raise func()) error {
		tx, err := c.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
		if err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "SELECT count(*) FROM fence.tokens"); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "INSERT INTO items(tag) VALUES ($1)", tag); err != nil {
			return err
		}
		raise()
		return tx.Commit(ctx)
	}},
	{name: "simple REPEATABLE READ", write: func(ctx context.Context, c *pgx.Conn, tag string, raise func()) error {
		if err := simple(ctx, c, "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM fence.tokens; "+ins(tag)); err != nil {
			return err
		}
		raise()
		return simple(ctx, c, "COMMIT")
	}},
	{name: "writable CTE", write: func(ctx context.Context, c *pgx.Conn, tag string, raise func()) error {
		raise()
		_, err := c.Exec(ctx, "WITH x AS (INSERT INTO items(tag) VALUES ($1) RETURNING id) SELECT count(*) FROM x", tag)
		return err
	}},
	{name: "write inside a function", write: func(ctx context.Context, c *pgx.Conn, tag string, raise func()) error {
		raise()
		_, err := c.Exec(ctx, "SELECT add_item($1)", tag)
		return err
	}},
	{name: "COPY FROM STDIN", write: func(ctx context.Context, c *pgx.Conn, tag string, raise func()) error {
		raise()
		_, err := c.CopyFrom(ctx, pgx.Identifier{"items"}, []string{"tag"}, pgx.CopyFromRows([][]any{{tag}, {tag}}))
		return err
	}},
	{name: "CALL in simple protocol", write: func(ctx context.Context, c *pgx.Conn, tag string, raise func()) error {
		raise()
		return simple(ctx, c, "CALL add_item_proc('"+tag+"')")
	}},
	{name: "DO in simple protocol", write: func(ctx context.Context, c *pgx.Conn, tag string, raise func()) error {
		raise()
		return simple(ctx, c, "DO $$BEGIN INSERT INTO items(tag) VALUES ('"+tag+"'); END$$")
	}},
	{name: "pipeline with several Syncs", write: func(ctx context.Context, c *pgx.Conn, tag string, raise func()) error {
		raise()
		p := c.PgConn().StartPipeline(ctx)
		p.SendQueryParams("INSERT INTO items(tag) VALUES ($1)", [][]byte{[]byte(tag)}, nil, nil, nil)
		p.SendPipelineSync()
		p.SendQueryParams("INSERT INTO items(tag) VALUES ($1)", [][]byte{[]byte(tag)}, nil, nil, nil)
		p.SendPipelineSync()
		return pipelineResults(p)
	}},
	{name: "extended write after COMMIT in one unit", write: func(ctx context.Context, c *pgx.Conn, tag string, raise func()) error {
		// The write after the empty block runs in the implicit transaction
		// that the Sync commits.
		raise()
		p := c.PgConn().StartPipeline(ctx)
		p.SendQueryParams("BEGIN", nil, nil, nil, nil)
		p.SendQueryParams("COMMIT", nil, nil, nil, nil)
		p.SendQueryParams("INSERT INTO items(tag) VALUES ($1)", [][]byte{[]byte(tag)}, nil, nil, nil)
		p.SendPipelineSync()
		return pipelineResults(p)
	}},
	{name: "batch", write: func(ctx context.Context, c *pgx.Conn, tag string, raise func()) error {
		raise()
		b := &pgx.Batch{}
		b.Queue("INSERT INTO items(tag) VALUES ($1)", tag)
		b.Queue("INSERT INTO items(tag) VALUES ($1)", tag)
		return c.SendBatch(ctx, b).Close()
	}},
	{name: "DDL", write: func(ctx context.Context, c *pgx.Conn, tag string, raise func()) error {
		raise()
		return simple(ctx, c, `CREATE TABLE "t_`+tag+`" (id int)`)
	}, written: func(t *testing.T, admin querier, tag string) bool {
		return count(t, admin, `SELECT count(*) FROM pg_class WHERE relname = $1`, "t_"+tag) > 0
	}},
	{name: "TRUNCATE", write: func(ctx context.Context, c *pgx.Conn, tag string, raise func()) error {
		if err := simple(ctx, c, `CREATE TABLE "tr_`+tag+`" AS SELECT 1 AS x`); err != nil {
			return err
		}
		raise()
		return simple(ctx, c, `TRUNCATE "tr_`+tag+`"`)
	}, written: func(t *testing.T, admin querier, tag string) bool {
		// "written" means the truncation committed.
		return count(t, admin, `SELECT count(*) FROM "tr_`+tag+`"`) == 0
	}},
	{name: "session tricks do not change the token", write: func(ctx context.Context, c *pgx.Conn, tag string, raise func()) error {
		for _, q := range []string{"SET fence.token = 999999", "SELECT set_config('fence.token', '999999', false)",
			"DISCARD ALL", "DEALLOCATE ALL", "RESET ALL"} {
			if err := simple(ctx, c, q); err != nil {
				return fmt.Errorf("%s: %w", q, err)
			}
		}
		raise()
		// DISCARD ALL dropped pgx's cached statements: describe afresh.
		_, err := c.Exec(ctx, "INSERT INTO items(tag) VALUES ($1)", pgx.QueryExecModeDescribeExec, tag)
		return err
	}},
}

func setupWritePaths(t *testing.T, admin querier) {
	mustExec(t, admin, `CREATE FUNCTION add_item(t text) RETURNS void LANGUAGE sql AS $$INSERT INTO items(tag) VALUES (t)$$`)
	mustExec(t, admin, `CREATE PROCEDURE add_item_proc(t text) LANGUAGE sql AS $$INSERT INTO items(tag) VALUES (t)$$`)
	mustExec(t, admin, `GRANT EXECUTE ON FUNCTION add_item(text) TO app`)
}

func resourceNames(n int) []string {
	var out []string
	for i := 0; i < n; i++ {
		out = append(out, fmt.Sprintf("r%02d", i))
	}
	return out
}

// pipelineResults flushes p, reads all its results and closes it, returning
// the first error.
func pipelineResults(p *pgconn.Pipeline) error {
	if err := p.Flush(); err != nil {
		return err
	}
	var first error
	for {
		r, err := p.GetResults()
		if err != nil {
			if first == nil {
				first = err
			}
			continue
		}
		switch r := r.(type) {
		case *pgconn.ResultReader:
			if _, err := r.Close(); err != nil && first == nil {
				first = err
			}
		case *pgconn.PipelineSync:
		case nil:
			if err := p.Close(); err != nil && first == nil {
				first = err
			}
			return first
		}
	}
}

// TestStaleWritesNeverCommit runs every write path under an old token
// while a newer one is raised through another proxy instance, in two set-ups:
// "database ends it", where the old session's proxy never hears of the raise
// (no LISTEN), so only the database stands between the stale write and its
// commit: the raise ends the old session's backend before it commits, and the
// client sees the server's FATAL 57P01; and "proxy learns of it", where the
// old session's proxy hears of the raise by LISTEN and tells the client ZF001.
// Either way the stale session is over and nothing it sends after the raise
// commits.
func TestStaleWritesNeverCommit(t *testing.T) {
	pg, admin := fencedDB(t)
	setupWritePaths(t, admin)
	names := resourceNames(len(writePaths))
	setups := []struct {
		name   string
		listen bool
		code   string // what the stale session's client is told
	}{{"database ends it", false, wire.CodeAdminShutdown}, {"proxy learns of it", true, fence.CodeStale}}
	for _, setup := range setups {
		t.Run(setup.name, func(t *testing.T) {
			cfgA := proxy.Config{Resources: names}
			if setup.listen {
				cfgA.ControlDatabase = pg.AdminURL()
			}
			a := testenv.StartProxy(t, pg, cfgA)
			b := testenv.StartProxy(t, pg, proxy.Config{Resources: names})
			for i, p := range writePaths {
				res := names[i]
				prefix := strings.ReplaceAll(setup.name, " ", "") + fmt.Sprint(i)
				t.Run(p.name, func(t *testing.T) {
					if !p.serial {
						t.Parallel()
					}
					written := p.written
					if written == nil {
						written = func(t *testing.T, admin querier, tag string) bool {
							return count(t, admin, "SELECT count(*) FROM items WHERE tag LIKE $1", tag+"%") > 0
						}
					}
					base := 100 * int64(i+1)
					if setup.listen {
						base += 10
					}
					ctx := ctxT(t)
					oldConn := connect(t, a.FenceURL("app", "postgres", res, base+1))
					// A current token writes fine.
					if err := p.write(ctx, oldConn, prefix+"cur", func() {}); err != nil {
						t.Fatalf("write with the current token failed: %v", err)
					}
					if !written(t, admin, prefix+"cur") {
						t.Fatal("write with the current token is missing")
					}
					raised := false
					err := p.write(ctx, oldConn, prefix+"stale", func() {
						raised = true
						// The bind of the higher token raises it: it ends the
						// old session's backend before it commits.
						connect(t, b.FenceURL("app", "postgres", res, base+2))
						if setup.listen {
							waitStale(t, a, "postgres", res, base+2)
						}
					})
					if !raised {
						t.Fatal("path did not call raise")
					}
					wantEnded(t, oldConn, err, setup.code)
					if written(t, admin, prefix+"stale") {
						t.Fatal("a write of the stale token committed")
					}
					// The new leader writes.
					newConn := connect(t, b.FenceURL("app", "postgres", res, base+2))
					if err := p.write(ctx, newConn, prefix+"new", func() {}); err != nil {
						t.Fatalf("new leader's write failed: %v", err)
					}
					if !written(t, admin, prefix+"new") {
						t.Fatal("new leader's write is missing")
					}
				})
			}
		})
	}
}

// wantEnded checks that err is how a stale session's write failed: the
// session was ended with an error of SQLSTATE code (a FATAL, or for ZF001 the
// ERROR with which the proxy answers the unit the client was waiting for when
// it learned of the raise), or the client found its connection closed before
// it read that error (pgx's CopyFrom writes while the FATAL arrives); either
// way the session is over (wantSessionOver).
func wantEnded(t *testing.T, conn *pgx.Conn, err error, code string) {
	t.Helper()
	if err == nil {
		t.Fatal("the stale session's write succeeded")
	}
	pe := pgErrorOf(err)
	if pe == nil {
		t.Logf("the client found its connection closed: %v", err)
		wantSessionOver(t, conn, code)
		return
	}
	if pe.Code != code || pe.Severity != wire.SeverityFatal && (code != fence.CodeStale || pe.Severity != wire.SeverityError) {
		t.Fatalf("want FATAL %s (or ERROR ZF001), got %s: %v", code, pe.Severity, err)
	}
	if code == fence.CodeStale && !strings.Contains(pe.Message, "stale fencing token") {
		t.Fatalf("message %q does not begin with 'stale fencing token'", pe.Message)
	}
	if code == wire.CodeAdminShutdown && !strings.Contains(pe.Hint, "fenceproxy") {
		t.Fatalf("the server's 57P01 was relayed without the proxy's hint: %q", pe.Hint)
	}
	wantSessionOver(t, conn, code)
}

func waitStale(t *testing.T, p *testenv.Proxy, database, res string, tok int64) {
	t.Helper()
	eventually(t, 10*time.Second, fmt.Sprintf("proxy learns of token %d for %s", tok, res), func() error {
		if h := p.Registry.Highest(database, res); h < tok {
			return fmt.Errorf("it knows %d", h)
		}
		return nil
	})
}

// TestTokensPerDatabase: tokens are per database.
func TestTokensPerDatabase(t *testing.T) {
	t.Parallel()
	e := startStaleEnv(t, []string{"billing"})
	ctx := ctxEnv(t)
	if _, err := e.admin.Exec(ctx, `CREATE DATABASE v2other`); err != nil {
		t.Fatal(err)
	}
	otherURL := e.pg.URLWithPassword(testenv.AdminUser, testenv.AdminPassword, "v2other")
	testenv.Migrate(t, otherURL)
	e.pg.Exec(t, "GRANT ALL ON DATABASE v2other TO app")
	other := testenv.Connect(t, otherURL)
	if _, err := other.Exec(ctx, `CREATE TABLE w (token bigint); GRANT ALL ON w TO app`, pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatal(err)
	}
	if _, err := e.admin.Exec(ctx, `CREATE TABLE w (token bigint); GRANT ALL ON w TO app`, pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatal(err)
	}
	write := func(c *pgx.Conn, tok int64) error {
		_, err := c.Exec(ctx, fmt.Sprintf("INSERT INTO w VALUES (%d)", tok))
		return err
	}
	// 18 in postgres, then 7 in v2other, through the same proxy instance.
	p18 := testenv.Connect(t, e.a.FenceURL("app", "postgres", "billing", 18))
	o7 := testenv.Connect(t, e.a.FenceURL("app", "v2other", "billing", 7))
	if err := write(p18, 18); err != nil {
		t.Fatal(err)
	}
	if err := write(o7, 7); err != nil {
		t.Fatalf("token 7 in v2other after 18 in postgres: %v", err)
	}
	// 19 in postgres ends p18, not o7.
	if err := e.raise(ctx, "postgres", "billing", 19); err != nil {
		t.Fatal(err)
	}
	if err := write(p18, 18); err == nil {
		t.Fatal("the session of token 18 wrote after 19 was admitted in its database")
	}
	if err := write(o7, 7); err != nil {
		t.Fatalf("a raise in postgres ended a session of v2other: %v", err)
	}
	p19 := testenv.Connect(t, e.b.FenceURL("app", "postgres", "billing", 19))
	// 8 in v2other ends o7, not p19.
	if err := e.raise(ctx, "v2other", "billing", 8); err != nil {
		t.Fatal(err)
	}
	if err := write(o7, 7); err == nil {
		t.Fatal("the session of token 7 wrote after 8 was admitted in its database")
	}
	if err := write(p19, 19); err != nil {
		t.Fatalf("a raise in v2other ended a session of postgres: %v", err)
	}
	// Stale tokens are refused at connect, per database.
	if err := connectErr(e.a.FenceURL("app", "postgres", "billing", 18)); sqlstate(err) != fence.CodeStale {
		t.Fatalf("18 in postgres: %v, want ZF001", err)
	}
	if err := connectErr(e.a.FenceURL("app", "v2other", "billing", 7)); sqlstate(err) != fence.CodeStale {
		t.Fatalf("7 in v2other: %v, want ZF001", err)
	}
	if err := connectErr(e.a.FenceURL("app", "v2other", "billing", 8)); err != nil {
		t.Fatalf("8 in v2other: %v", err)
	}
	var n18, n7 int
	e.admin.QueryRow(ctx, `SELECT count(*) FROM w WHERE token = 18`).Scan(&n18) //nolint:errcheck
	other.QueryRow(ctx, `SELECT count(*) FROM w WHERE token = 7`).Scan(&n7)     //nolint:errcheck
	if n18 != 1 || n7 != 2 {
		t.Fatalf("rows: %d of 18 in postgres (want 1), %d of 7 in v2other (want 2)", n18, n7)
	}
}
