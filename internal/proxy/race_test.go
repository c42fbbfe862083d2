package proxy_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// raceResult is what one run of the race recorded.
type raceResult struct {
	committedBefore int   // old-token rows that committed before the raise
	violations      int   // old-token rows that committed after the raise
	ended           int64 // writers whose session the raise ended
}

// runRace hammers the database with writers holding the old token of each
// round while a new token is raised, and checks the recorded history: with
// commit timestamps (track_commit_timestamp), no row of the old token may
// have committed after the raise committed. writerURL gives the URL a
// writer uses with token tok. fenced: the writers are fenced sessions, which
// the raise must end (each writer writes until its session ends, with the
// server's FATAL 57P01, ZF001 or a closed connection); otherwise they go on
// writing after the raise until each has committed once more.
func runRace(t *testing.T, admin querier, b *testenv.Proxy, rounds, writers int, fenced bool, writerURL func(tok int64) string) raceResult {
	t.Helper()
	var res raceResult
	for r := 1; r <= rounds; r++ {
		oldTok, newTok := int64(2*r-1), int64(2*r)
		conns := make([]*pgx.Conn, writers)
		for i := range conns {
			conns[i] = connect(t, writerURL(oldTok))
		}
		ctx, stop := context.WithCancel(ctxT(t))
		var wg sync.WaitGroup
		var ended, writing, afterRaise atomic.Int64
		var raised atomic.Bool
		for i, c := range conns {
			wg.Add(1)
			go func() {
				defer wg.Done()
				first := true
				for n := 0; ctx.Err() == nil; n++ {
					var err error
					switch (i + n) % 3 {
					case 0: // extended autocommit
						_, err = c.Exec(ctx, "INSERT INTO history(round, token, writer) VALUES ($1, $2, $3)", r, oldTok, i)
					case 1: // simple autocommit
						_, err = c.PgConn().Exec(ctx, fmt.Sprintf("INSERT INTO history(round, token, writer) VALUES (%d, %d, %d)", r, oldTok, i)).ReadAll()
					case 2: // explicit block
						err = pgx.BeginFunc(ctx, c, func(tx pgx.Tx) error {
							_, err := tx.Exec(ctx, "INSERT INTO history(round, token, writer) VALUES ($1, $2, $3)", r, oldTok, i)
							return err
						})
					}
					switch {
					case err == nil:
						if first {
							first = false
							writing.Add(1)
						}
						if raised.Load() {
							afterRaise.Add(1)
						}
					case ctx.Err() != nil:
						return
					case fenced && endedByRaise(c, err):
						ended.Add(1)
						return
					default:
						t.Errorf("writer %d: unexpected error: %v", i, err)
						return
					}
				}
			}()
		}
		// Every writer is writing: now raise.
		eventually(t, 20*time.Second, "writers started", func() error {
			if n := writing.Load(); n != int64(writers) {
				return fmt.Errorf("%d of %d writing", n, writers)
			}
			return nil
		})
		raised.Store(true)
		nc := connect(t, b.FenceURL("app", "postgres", "race", newTok)) // the raise
		if fenced {
			done := make(chan struct{})
			go func() { wg.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(20 * time.Second):
				t.Errorf("round %d: %d of %d stale writers still write 20 s after the raise", r, int64(writers)-ended.Load(), writers)
			}
		} else {
			eventually(t, 20*time.Second, "writers go on after the raise", func() error {
				if n := afterRaise.Load(); n < int64(writers) {
					return fmt.Errorf("%d of %d went on", n, writers)
				}
				return nil
			})
		}
		stop()
		wg.Wait()
		nc.Close(context.Background())
		for _, c := range conns {
			c.Close(context.Background())
		}
		var before, after int
		err := admin.QueryRow(ctxT(t), `
			WITH raise AS (SELECT pg_xact_commit_timestamp(xmin) AS at FROM fence.tokens WHERE resource = 'race')
			SELECT count(*) FILTER (WHERE pg_xact_commit_timestamp(h.xmin) <= raise.at),
			       count(*) FILTER (WHERE pg_xact_commit_timestamp(h.xmin) > raise.at)
			FROM history h, raise WHERE h.round = $1 AND h.token = $2`, r, oldTok).Scan(&before, &after)
		if err != nil {
			t.Fatal(err)
		}
		res.committedBefore += before
		res.violations += after
		res.ended += ended.Load()
	}
	return res
}

// endedByRaise reports whether err is how a fenced writer's session ends
// when a raise ends its backend: FATAL 57P01 from the server (relayed by a
// proxy that did not hear of the raise), FATAL ZF001 from one that did, or a
// connection found closed before the error could be read.
func endedByRaise(c *pgx.Conn, err error) bool {
	if !c.IsClosed() {
		return false
	}
	pe := pgErrorOf(err)
	return pe == nil || pe.Severity == wire.SeverityFatal && (pe.Code == wire.CodeAdminShutdown || pe.Code == fence.CodeStale)
}

func raceDB(t *testing.T) (*testenv.Postgres, querier) {
	pg, admin := fencedDB(t, testenv.WithConf("track_commit_timestamp", "on"))
	mustExec(t, admin, `CREATE TABLE history (id bigserial, round int, token bigint, writer int)`)
	mustExec(t, admin, `GRANT ALL ON history, history_id_seq TO app`)
	return pg, admin
}

// TestRaceNoStaleCommitAfterRaise is the race test of the guarantee, with
// writers behind a proxy instance that never hears of the raise (so only
// the database protects: the raise ends their backends before it commits).
func TestRaceNoStaleCommitAfterRaise(t *testing.T) {
	t.Parallel()
	pg, admin := raceDB(t)
	a := testenv.StartProxy(t, pg, proxy.Config{Resources: []string{"race"}})
	b := testenv.StartProxy(t, pg, proxy.Config{Resources: []string{"race"}})
	const rounds, writers = 15, 8
	res := runRace(t, admin, b, rounds, writers, true, func(tok int64) string { return a.FenceURL("app", "postgres", "race", tok) })
	t.Logf("old-token commits before the raise: %d, after: %d, sessions ended: %d", res.committedBefore, res.violations, res.ended)
	if res.violations != 0 {
		t.Fatalf("%d writes of an old token committed after the raise", res.violations)
	}
	if res.committedBefore == 0 {
		t.Fatal("the race did not race: no commits before the raise")
	}
	if res.ended != rounds*writers {
		t.Fatalf("the raise ended %d of %d stale sessions", res.ended, rounds*writers)
	}
}

// TestRaceNegativeControl runs the same history with fencing out of the way
// (the writers connect straight to PostgreSQL, their backends bound to no
// token) and must see violations: proof that the race test can fail.
func TestRaceNegativeControl(t *testing.T) {
	t.Parallel()
	pg, admin := raceDB(t)
	b := testenv.StartProxy(t, pg, proxy.Config{Resources: []string{"race"}})
	res := runRace(t, admin, b, 5, 8, false, func(int64) string { return pg.URLWithPassword("app", "app", "postgres") })
	t.Logf("without fencing: old-token commits before the raise: %d, after: %d", res.committedBefore, res.violations)
	if res.violations == 0 {
		t.Fatal("negative control saw no violation: the race test cannot detect a broken fence")
	}
}

// The race test of fencing v2: writers hold the old token of each round and
// write as fast as they can, in every shape a client writes (extended and
// simple autocommit, blocks, a held cursor whose query writes at COMMIT, a
// function, a procedure that commits inside, a multi-statement Query), through
// proxy A, which never hears of the raise; a new leader connects through
// proxy B with the next token. The recorded history must show no row of the
// old token whose commit timestamp (track_commit_timestamp) is after the
// raise's commit, and no backend bound to the old token alive once the raise
// returned. Every writer must see its session end, and a reconnect with its
// old token must be refused (ZF001).
//
// The negative control runs the same history with writers connected straight
// to PostgreSQL (unbound): it must see old-token commits after the raise,
// proof that the history can show a violation. A third run repeats the race
// with the fence schema owned by a role that is not a superuser (only
// pg_signal_backend and pg_read_all_stats), as the README asks deployments to.

// writeShapes are the writes; each writes rows tagged (race, tok).
var writeShapes = []struct {
	name  string
	write func(ctx context.Context, c *pgx.Conn, tok int64, tag string) error
}{
	{"extended autocommit", func(ctx context.Context, c *pgx.Conn, tok int64, tag string) error {
		_, err := c.Exec(ctx, `INSERT INTO public.v2_rows (resource, token, tag) VALUES ('race', $1, $2)`, tok, tag)
		return err
	}},
	{"simple autocommit", func(ctx context.Context, c *pgx.Conn, tok int64, tag string) error {
		_, err := c.PgConn().Exec(ctx, fmt.Sprintf(`INSERT INTO public.v2_rows (resource, token, tag) VALUES ('race', %d, '%s')`, tok, tag)).ReadAll()
		return err
	}},
	{"block", func(ctx context.Context, c *pgx.Conn, tok int64, tag string) error {
		return pgx.BeginFunc(ctx, c, func(tx pgx.Tx) error {
			for range 2 {
				if _, err := tx.Exec(ctx, `INSERT INTO public.v2_rows (resource, token, tag) VALUES ('race', $1, $2)`, tok, tag); err != nil {
					return err
				}
			}
			return nil
		})
	}},
	{"held cursor", func(ctx context.Context, c *pgx.Conn, tok int64, tag string) error {
		_, err := c.PgConn().Exec(ctx, fmt.Sprintf(`BEGIN; DECLARE c CURSOR WITH HOLD FOR SELECT public.v2_write('race', %d, '%s') FROM generate_series(1, 2); COMMIT; CLOSE c`, tok, tag)).ReadAll()
		return err
	}},
	{"function", func(ctx context.Context, c *pgx.Conn, tok int64, tag string) error {
		_, err := c.Exec(ctx, `SELECT public.v2_write('race', $1, $2)`, tok, tag)
		return err
	}},
	{"procedure committing inside", func(ctx context.Context, c *pgx.Conn, tok int64, tag string) error {
		_, err := c.Exec(ctx, `CALL public.v2_proc('race', $1, 0)`, tok) // lock 0 is never held
		return err
	}},
	{"multi-statement Query", func(ctx context.Context, c *pgx.Conn, tok int64, tag string) error {
		ins := fmt.Sprintf(`INSERT INTO public.v2_rows (resource, token, tag) VALUES ('race', %d, '%s')`, tok, tag)
		_, err := c.PgConn().Exec(ctx, ins+"; "+ins+"; COMMIT; "+ins).ReadAll()
		return err
	}},
}

type shapesRaceResult struct {
	before, after   int // old-token rows committed before / after the raise
	ended, refused  int // writers whose session ended; reconnects refused with ZF001
	writes, rounds  int
	leftBound       int // backends bound to the old token alive after the raise returned
	unexpectedError []string
}

// raceWriteShapes runs rounds of the race. fenced: writers go through proxy A (else
// straight to PostgreSQL).
func raceWriteShapes(t *testing.T, e *staleEnv, rounds, writers int, fenced bool) shapesRaceResult {
	t.Helper()
	ctx := ctxEnv(t)
	var res shapesRaceResult
	for r := 1; r <= rounds; r++ {
		oldTok, newTok := int64(2*r-1), int64(2*r)
		url := e.pg.URL("app", "postgres")
		if fenced {
			url = e.a.FenceURL("app", "postgres", "race", oldTok)
		}
		conns := make([]*pgx.Conn, writers)
		for i := range conns {
			conns[i] = testenv.Connect(t, url)
		}
		wctx, stop := context.WithTimeout(ctx, 20*time.Second)
		var raising atomic.Bool
		var wg sync.WaitGroup
		var mu sync.Mutex
		var ended, refused, writes int
		var unexpected []string
		for i, c := range conns {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for n := 0; wctx.Err() == nil; n++ {
					shape := writeShapes[(i+n)%len(writeShapes)]
					err := shape.write(wctx, c, oldTok, fmt.Sprintf("round %d writer %d", r, i))
					if err == nil {
						mu.Lock()
						writes++
						mu.Unlock()
						continue
					}
					if wctx.Err() != nil {
						return
					}
					mu.Lock()
					defer mu.Unlock()
					if !raising.Load() {
						unexpected = append(unexpected, fmt.Sprintf("round %d writer %d (%s) before the raise: %v", r, i, shape.name, err))
						return
					}
					ended++
					// A reconnect with the old token is refused.
					if err := connectErr(url); sqlstate(err) == fence.CodeStale {
						refused++
					} else {
						unexpected = append(unexpected, fmt.Sprintf("round %d writer %d: reconnect with token %d: %v, want ZF001", r, i, oldTok, err))
					}
					return
				}
			}()
		}
		time.Sleep(50 * time.Millisecond)
		raising.Store(true)
		if err := e.raise(ctx, "postgres", "race", newTok); err != nil {
			stop()
			wg.Wait()
			t.Fatalf("round %d: raise: %v", r, err)
		}
		var left int
		if err := e.admin.QueryRow(ctx, `SELECT count(*) FROM fence.bindings b JOIN pg_stat_activity a USING (pid, backend_start)
			WHERE b.resource = 'race' AND b.token < $1`, newTok).Scan(&left); err != nil {
			t.Fatal(err)
		}
		if !fenced {
			time.Sleep(100 * time.Millisecond) // the unbound writers go on writing
			stop()
		}
		wg.Wait()
		stop()
		for _, c := range conns {
			c.Close(context.Background())
		}
		var before, after int
		if err := e.admin.QueryRow(ctx, `
			WITH raise AS (SELECT pg_xact_commit_timestamp(xmin) AS at FROM fence.tokens WHERE resource = 'race')
			SELECT count(*) FILTER (WHERE pg_xact_commit_timestamp(h.xmin) <= raise.at),
			       count(*) FILTER (WHERE pg_xact_commit_timestamp(h.xmin) > raise.at)
			FROM public.v2_rows h, raise WHERE h.resource = 'race' AND h.token = $1`, oldTok).Scan(&before, &after); err != nil {
			t.Fatal(err)
		}
		res.before += before
		res.after += after
		res.ended += ended
		res.refused += refused
		res.writes += writes
		res.leftBound += left
		res.unexpectedError = append(res.unexpectedError, unexpected...)
		res.rounds++
	}
	return res
}

func checkShapesRace(t *testing.T, res shapesRaceResult, writers int) {
	t.Helper()
	t.Logf("%d rounds of %d writers: %d writes answered, old-token rows committed before the raise %d, after %d; sessions ended %d, reconnects refused %d, bound backends left %d",
		res.rounds, writers, res.writes, res.before, res.after, res.ended, res.refused, res.leftBound)
	for _, u := range res.unexpectedError {
		t.Error(u)
	}
	if res.after != 0 {
		t.Errorf("VIOLATION: %d writes of an old token committed after the raise", res.after)
	}
	if res.leftBound != 0 {
		t.Errorf("%d backends bound to an old token were alive after the raise returned", res.leftBound)
	}
	if res.before == 0 || res.ended != res.rounds*writers || res.refused != res.ended {
		t.Errorf("the race did not race: %d commits before the raise, %d of %d sessions ended, %d reconnects refused", res.before, res.ended, res.rounds*writers, res.refused)
	}
}

func TestRaceEveryWriteShapeNoStaleCommit(t *testing.T) {
	t.Parallel()
	e := startStaleEnv(t, []string{"race"})
	const writers = 8
	checkShapesRace(t, raceWriteShapes(t, e, 10, writers, true), writers)
}

// TestRaceEveryWriteShapeNegativeControl: the same history unfenced must show violations.
func TestRaceEveryWriteShapeNegativeControl(t *testing.T) {
	t.Parallel()
	e := startStaleEnv(t, []string{"race"})
	res := raceWriteShapes(t, e, 4, 8, false)
	t.Logf("unfenced: %d rounds, old-token rows committed before the raise %d, after %d", res.rounds, res.before, res.after)
	for _, u := range res.unexpectedError {
		t.Error(u)
	}
	if res.after == 0 {
		t.Fatal("the negative control saw no violation: the race test cannot detect a broken fence")
	}
}

// TestRaceEveryWriteShapeNonSuperuserOwner: the race with the fence schema owned by a
// role with only pg_signal_backend and pg_read_all_stats.
func TestRaceEveryWriteShapeNonSuperuserOwner(t *testing.T) {
	t.Parallel()
	e := startStaleEnvOwner(t, []string{"race"}, "fence_owner")
	var super bool
	if err := e.admin.QueryRow(ctxEnv(t), `SELECT r.rolsuper FROM pg_proc p JOIN pg_roles r ON r.oid = p.proowner WHERE p.oid = 'fence.bind(text, bigint, text)'::regprocedure`).Scan(&super); err != nil || super {
		t.Fatalf("fence.bind owned by a superuser (%t) or unknown: %v", super, err)
	}
	const writers = 6
	checkShapesRace(t, raceWriteShapes(t, e, 5, writers, true), writers)
}
