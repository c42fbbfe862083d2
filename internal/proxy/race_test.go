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
)

// raceResult is what one run of the race recorded.
type raceResult struct {
	committedBefore int // old-token rows that committed before the raise
	violations      int // old-token rows that committed after the raise
	rejected        int64
}

// runRace hammers the database with writers holding the old token of each
// round while a new token is raised, and checks the recorded history: with
// commit timestamps (track_commit_timestamp), no row of the old token may
// have committed after the raise committed. writerURL gives the URL a
// writer of round r uses with token t.
func runRace(t *testing.T, admin querier, b *testenv.Proxy, rounds, writers int, writerURL func(tok int64) string) raceResult {
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
		var rejected atomic.Int64
		for i, c := range conns {
			wg.Add(1)
			go func() {
				defer wg.Done()
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
					if err != nil && sqlstate(err) == fence.CodeStale {
						rejected.Add(1)
					}
					if err != nil && ctx.Err() == nil && sqlstate(err) != fence.CodeStale {
						t.Errorf("writer %d: unexpected error: %v", i, err)
						return
					}
				}
			}()
		}
		time.Sleep(40 * time.Millisecond)
		nc := connect(t, b.FenceURL("app", "postgres", "race", newTok)) // the raise
		time.Sleep(60 * time.Millisecond)
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
		res.rejected += rejected.Load()
	}
	return res
}

func raceDB(t *testing.T) (*testenv.Postgres, querier) {
	pg, admin := fencedDB(t, testenv.WithConf("track_commit_timestamp", "on"))
	mustExec(t, admin, `CREATE TABLE history (id bigserial, round int, token bigint, writer int)`)
	mustExec(t, admin, `GRANT ALL ON history, history_id_seq TO app`)
	return pg, admin
}

// TestRaceNoStaleCommitAfterRaise is the race test of the guarantee, with
// writers behind a proxy instance that never hears of the raise (so only
// the database check protects).
func TestRaceNoStaleCommitAfterRaise(t *testing.T) {
	t.Parallel()
	pg, admin := raceDB(t)
	a := testenv.StartProxy(t, pg, proxy.Config{Resources: []string{"race"}})
	b := testenv.StartProxy(t, pg, proxy.Config{Resources: []string{"race"}})
	res := runRace(t, admin, b, 15, 8, func(tok int64) string { return a.FenceURL("app", "postgres", "race", tok) })
	t.Logf("old-token commits before the raise: %d, after: %d, rejected: %d", res.committedBefore, res.violations, res.rejected)
	if res.violations != 0 {
		t.Fatalf("%d writes of an old token committed after the raise", res.violations)
	}
	if res.committedBefore == 0 || res.rejected == 0 {
		t.Fatalf("the race did not race: %d commits before the raise, %d rejections", res.committedBefore, res.rejected)
	}
}

// TestRaceNegativeControl runs the same history with the check switched off
// (the writers connect straight to PostgreSQL) and must see violations:
// proof that the race test can fail.
func TestRaceNegativeControl(t *testing.T) {
	t.Parallel()
	pg, admin := raceDB(t)
	b := testenv.StartProxy(t, pg, proxy.Config{Resources: []string{"race"}})
	res := runRace(t, admin, b, 5, 8, func(int64) string { return pg.URLWithPassword("app", "app", "postgres") })
	t.Logf("without the check: old-token commits before the raise: %d, after: %d", res.committedBefore, res.violations)
	if res.violations == 0 {
		t.Fatal("negative control saw no violation: the race test cannot detect a broken check")
	}
}
