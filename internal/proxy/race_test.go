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
		pollUntil(t, "writers started", func() bool { return writing.Load() == int64(writers) })
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
			pollUntil(t, "writers go on after the raise", func() bool { return afterRaise.Load() >= int64(writers) })
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

// pollUntil waits until cond holds, failing the test after 20 s.
func pollUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 20 s", what)
		}
		time.Sleep(time.Millisecond)
	}
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
