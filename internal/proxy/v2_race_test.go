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
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

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

// v2RaceShapes are the writes; each writes rows tagged (race, tok).
var v2RaceShapes = []struct {
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

type v2RaceResult struct {
	before, after   int // old-token rows committed before / after the raise
	ended, refused  int // writers whose session ended; reconnects refused with ZF001
	writes, rounds  int
	leftBound       int // backends bound to the old token alive after the raise returned
	unexpectedError []string
}

// v2Race runs rounds of the race. fenced: writers go through proxy A (else
// straight to PostgreSQL).
func v2Race(t *testing.T, e *v2Env, rounds, writers int, fenced bool) v2RaceResult {
	t.Helper()
	ctx := v2Ctx(t)
	var res v2RaceResult
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
					shape := v2RaceShapes[(i+n)%len(v2RaceShapes)]
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
					if err := connectErr(url); v2Code(err) == fence.CodeStale {
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

func v2CheckRace(t *testing.T, res v2RaceResult, writers int) {
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

func TestV2RaceNoStaleCommit(t *testing.T) {
	t.Parallel()
	e := v2StartEnv(t, []string{"race"})
	const writers = 8
	v2CheckRace(t, v2Race(t, e, 10, writers, true), writers)
}

// TestV2RaceNegativeControl: the same history unfenced must show violations.
func TestV2RaceNegativeControl(t *testing.T) {
	t.Parallel()
	e := v2StartEnv(t, []string{"race"})
	res := v2Race(t, e, 4, 8, false)
	t.Logf("unfenced: %d rounds, old-token rows committed before the raise %d, after %d", res.rounds, res.before, res.after)
	for _, u := range res.unexpectedError {
		t.Error(u)
	}
	if res.after == 0 {
		t.Fatal("the negative control saw no violation: the race test cannot detect a broken fence")
	}
}

// TestV2RaceNonSuperuserOwner: the race with the fence schema owned by a
// role with only pg_signal_backend and pg_read_all_stats.
func TestV2RaceNonSuperuserOwner(t *testing.T) {
	t.Parallel()
	e := v2StartEnvOwner(t, []string{"race"}, "fence_owner")
	var super bool
	if err := e.admin.QueryRow(v2Ctx(t), `SELECT r.rolsuper FROM pg_proc p JOIN pg_roles r ON r.oid = p.proowner WHERE p.oid = 'fence.bind(text, bigint, text)'::regprocedure`).Scan(&super); err != nil || super {
		t.Fatalf("fence.bind owned by a superuser (%t) or unknown: %v", super, err)
	}
	const writers = 6
	v2CheckRace(t, v2Race(t, e, 5, writers, true), writers)
}
