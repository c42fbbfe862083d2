package proxy_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestGeneratedSequences: random message sequences at the protocol level
// (simple and extended messages; BEGIN, START TRANSACTION, COMMIT, END,
// ROLLBACK, SAVEPOINT, RELEASE, ROLLBACK TO, COMMIT AND CHAIN, PREPARE
// TRANSACTION; writes direct, through functions, procedures and DO blocks that
// commit, and held cursors; large objects; errors; named and unnamed
// statements and portals reused; Close, Describe, Flush, missing Syncs, Query
// between Executes, COPY in and out), each from a seeded PRNG, each run three
// ways:
//
//   - current token: the sequence through a fenced proxy session and through a
//     direct connection, each in a fresh copy of the same schema, must give
//     the same messages (backend pids, cancel keys, table OIDs and tuple
//     positions blanked) and leave the same rows;
//   - stale token: through proxy A (hears nothing of raises) or AH (LISTENs),
//     the sequence is cut at a random message; after the first part, a new
//     leader connects with the next token through proxy B; the rest follows.
//     Once the raise returned: the stale backend is gone, the schema's rows
//     (with their xmin) are what they will be at the end (the set neither grows
//     nor shrinks: no stale commit after the raise), none has a commit
//     timestamp after the raise's, the client never gets the end marker's
//     answer, and a reconnect with the stale token is refused (ZF001). A raise
//     refused because the stale session left a prepared transaction (ZF011,
//     by design) is retried after the test rolls it back.
//
// The bounded run (FENCEPROXY_GEN_ROUNDS, default 48 rounds) is part of
// `make test`; `make gen-long` runs many more. FENCEPROXY_GEN_SEED sets the
// first seed (default 1): round i uses seed+i, and a failure names its seed,
// so FENCEPROXY_GEN_SEED=<seed> FENCEPROXY_GEN_ROUNDS=1 replays it.
func TestGeneratedSequences(t *testing.T) {
	t.Parallel()
	rounds := genEnvInt(t, "FENCEPROXY_GEN_ROUNDS", 48)
	first := uint64(genEnvInt(t, "FENCEPROXY_GEN_SEED", 1))
	const workers = 4
	ge := startGenEnv(t, workers)
	var stats genStats
	runs := make([]*parallelRun, workers)
	for w := range runs {
		runs[w] = &parallelRun{name: fmt.Sprintf("worker %d", w)}
	}
	var failures atomic.Int64
	start := time.Now()
	runParallel(workers, runs, func(w int, r *parallelRun) {
		for i := w; i < rounds; i += workers {
			if failures.Load() >= 5 {
				r.logf("stopped after 5 failed rounds")
				return
			}
			seed := first + uint64(i)
			rr := &parallelRun{name: fmt.Sprintf("seed %d", seed)}
			runParallel(1, []*parallelRun{rr}, func(int, *parallelRun) { ge.round(rr, w, seed, &stats) })
			if len(rr.fails) > 0 {
				failures.Add(1)
				for _, f := range rr.fails {
					r.errorf("seed %d (replay: FENCEPROXY_GEN_SEED=%d FENCEPROXY_GEN_ROUNDS=1): %s", seed, seed, f)
				}
			}
		}
	})
	t.Logf("%d rounds (seeds %d-%d) in %v: %s", rounds, first, first+uint64(rounds)-1, time.Since(start).Round(time.Millisecond), stats.String())
	for _, r := range runs {
		r.report(t)
	}

	// The negative control: sequences of the next seeds with the stale session
	// connected straight to PostgreSQL (unbound). The same checks must see its
	// rows change after the raise in some of them: proof that they can.
	const controls = 16
	var detected atomic.Int64
	var cstats genStats
	cruns := make([]*parallelRun, workers)
	for w := range cruns {
		cruns[w] = &parallelRun{name: fmt.Sprintf("control worker %d", w)}
	}
	runParallel(workers, cruns, func(w int, r *parallelRun) {
		for i := w; i < controls; i += workers {
			seed := first + uint64(rounds) + uint64(i)
			if ge.staleRound(r, w, seed, genSequence(seed), rand.New(rand.NewPCG(seed, 7)), true, &cstats) {
				detected.Add(1)
			}
		}
	})
	for _, r := range cruns {
		r.report(t)
	}
	t.Logf("negative control: unbound, the checks saw stale rows change after the raise in %d of %d sequences", detected.Load(), controls)
	if detected.Load() == 0 {
		t.Errorf("negative control: the checks saw no stale commit after the raise in %d unbound sequences: they cannot detect one", controls)
	}
}

func genEnvInt(t *testing.T, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		t.Fatalf("%s=%q: want a number", name, v)
	}
	return n
}

type genStats struct {
	rounds, sequences, messages, compared    atomic.Int64
	raises, refusedPrepared, staleRowsAtRise atomic.Int64
	endedZF001, ended57P01, endedClosed      atomic.Int64
	endedBeforeRaise, reconnectsRefused      atomic.Int64
}

func (s *genStats) String() string {
	return fmt.Sprintf("%d sequences (%d messages sent; %d answers compared between proxy and direct); %d raises (%d refused first for a prepared transaction); "+
		"stale rows committed before the raises %d, after 0; stale sessions ended with ZF001 %d, 57P01 %d, closed or 08006 %d (by their own sequence %d); stale reconnects refused %d",
		s.sequences.Load(), s.messages.Load(), s.compared.Load(), s.raises.Load(), s.refusedPrepared.Load(), s.staleRowsAtRise.Load(),
		s.endedZF001.Load(), s.ended57P01.Load(), s.endedClosed.Load(), s.endedBeforeRaise.Load(), s.reconnectsRefused.Load())
}

// ---------------------------------------------------------------------
// The environment: databases gen_cur (current-token runs) and gen_stale
// (stale runs: a prepared transaction anywhere in a database refuses every
// raise there, so the current runs' must not stand in the stale runs' way).

type genEnv struct {
	staleEnv
	cur, stale *pgxpool.Pool
}

func startGenEnv(t *testing.T, workers int) *genEnv {
	t.Helper()
	var resources []string
	for w := range workers {
		resources = append(resources, fmt.Sprintf("gc%d", w), fmt.Sprintf("gs%d", w))
	}
	pg := testenv.StartPostgres(t, testenv.WithConf("track_commit_timestamp", "on"), testenv.WithConf("max_prepared_transactions", "100"))
	pg.CreateRole(t, "app", "app")
	ge := &genEnv{}
	ge.pg = pg
	ge.admin = newPool(t, pg.AdminURL())
	for _, db := range []string{"gen_cur", "gen_stale"} {
		pg.Exec(t, "CREATE DATABASE "+db)
		url := pg.URLWithPassword(testenv.AdminUser, testenv.AdminPassword, db)
		testenv.Migrate(t, url)
		pool := newPool(t, url)
		if db == "gen_cur" {
			ge.cur = pool
		} else {
			ge.stale = pool
		}
	}
	cfg := proxy.Config{Resources: resources}
	ge.a = testenv.StartProxy(t, pg, cfg)
	cfgH := cfg
	cfgH.ControlDatabase = pg.URLWithPassword(testenv.AdminUser, testenv.AdminPassword, "gen_stale")
	ge.ah = testenv.StartProxy(t, pg, cfgH)
	ge.b = testenv.StartProxy(t, pg, cfg)
	// Store token 1 of every resource now: a bind that stores a new token is a
	// raise, which another worker's prepared transaction would refuse.
	for w := range workers {
		testenv.Connect(t, ge.a.FenceURL("app", "gen_cur", fmt.Sprintf("gc%d", w), 1)).Close(context.Background())
		testenv.Connect(t, ge.a.FenceURL("app", "gen_stale", fmt.Sprintf("gs%d", w), 1)).Close(context.Background())
	}
	return ge
}

const genSchema = `
CREATE TABLE t (id serial PRIMARY KEY, v int NOT NULL);
CREATE TABLE u (id int PRIMARY KEY);
CREATE FUNCTION w(n int) RETURNS int LANGUAGE plpgsql AS $$BEGIN INSERT INTO t (v) VALUES (n); RETURN n; END$$;
CREATE PROCEDURE p(n int) LANGUAGE plpgsql AS $$BEGIN INSERT INTO t (v) VALUES (n); COMMIT; INSERT INTO t (v) VALUES (n + 1); END$$;
`

// setup creates schema g<seed> in pool's database, owned by app.
func genSetup(ctx context.Context, pool *pgxpool.Pool, seed uint64) error {
	s := fmt.Sprintf("g%d", seed)
	_, err := pool.Exec(ctx, fmt.Sprintf("CREATE SCHEMA %[1]s AUTHORIZATION app; BEGIN; SET LOCAL ROLE app; SET LOCAL search_path = %[1]s; %[2]s COMMIT", s, genSchema),
		pgx.QueryExecModeSimpleProtocol)
	return err
}

// teardown removes what a run of seed left: its prepared transactions, large
// objects and schema.
func genTeardown(ctx context.Context, pool *pgxpool.Pool, seed uint64) error {
	if err := genRollbackPrepared(ctx, pool, seed); err != nil {
		return err
	}
	lo := genLO(seed)
	_, err := pool.Exec(ctx, fmt.Sprintf(`SELECT lo_unlink(oid) FROM pg_largeobject_metadata WHERE oid BETWEEN %d AND %d; DROP SCHEMA g%d CASCADE`, lo, lo+3, seed),
		pgx.QueryExecModeSimpleProtocol)
	return err
}

func genRollbackPrepared(ctx context.Context, pool *pgxpool.Pool, seed uint64) error {
	rows, err := pool.Query(ctx, `SELECT gid FROM pg_prepared_xacts WHERE database = current_database() AND gid LIKE $1`, fmt.Sprintf("g%d\\_%%", seed))
	if err != nil {
		return err
	}
	gids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return err
	}
	for _, g := range gids {
		if _, err := pool.Exec(ctx, "ROLLBACK PREPARED '"+g+"'"); err != nil {
			return err
		}
	}
	return nil
}

func genLO(seed uint64) int64 { return 5000000 + int64(seed%100000)*4 }

// genState is the run's rows; withXmin for the stale runs, whose snapshots
// must match row for row, transaction for transaction.
func genState(ctx context.Context, pool *pgxpool.Pool, seed uint64, withXmin bool) (string, error) {
	x := ""
	if withXmin {
		x = "|| ':' || xmin::text"
	}
	lo := genLO(seed)
	q := fmt.Sprintf(`SELECT
	    (SELECT coalesce(string_agg(id || ':' || v %[1]s, ',' ORDER BY id), '') FROM g%[2]d.t) || ' | ' ||
	    (SELECT coalesce(string_agg(id::text %[1]s, ',' ORDER BY id), '') FROM g%[2]d.u) || ' | ' ||
	    (SELECT coalesce(string_agg(oid::text %[1]s, ',' ORDER BY oid), '') FROM pg_largeobject_metadata WHERE oid BETWEEN %[3]d AND %[4]d) || ' | ' ||
	    (SELECT coalesce(string_agg(gid, ',' ORDER BY gid), '') FROM pg_prepared_xacts WHERE database = current_database() AND gid LIKE 'g%[2]d\_%%')`,
		x, seed, lo, lo+3)
	var s string
	err := pool.QueryRow(ctx, q).Scan(&s)
	return s, err
}

// genRows counts the rows and large objects of a genState.
func genRows(state string) int {
	n := 0
	for i, part := range strings.Split(state, " | ") {
		if i < 3 && part != "" {
			n += strings.Count(part, ",") + 1
		}
	}
	return n
}

// genAfterRaise counts the run's rows whose commit timestamp is after that of
// the resource's current token.
func genAfterRaise(ctx context.Context, pool *pgxpool.Pool, seed uint64, res string) (int, error) {
	lo := genLO(seed)
	q := fmt.Sprintf(`SELECT count(*) FROM (
	    SELECT xmin FROM g%[1]d.t UNION ALL SELECT xmin FROM g%[1]d.u
	    UNION ALL SELECT xmin FROM pg_largeobject_metadata WHERE oid BETWEEN %[2]d AND %[3]d) AS x(x)
	  WHERE pg_xact_commit_timestamp(x.x) > (SELECT pg_xact_commit_timestamp(xmin) FROM fence.tokens WHERE resource = $1)`, seed, lo, lo+3)
	var n int
	err := pool.QueryRow(ctx, q, res).Scan(&n)
	return n, err
}

// ---------------------------------------------------------------------
// One round: the sequence of seed with a current token (direct and proxied),
// then with a stale one.

func (ge *genEnv) round(r *parallelRun, w int, seed uint64, stats *genStats) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	seq := genSequence(seed)
	stats.rounds.Add(1)
	rng := rand.New(rand.NewPCG(seed, 7))
	nonce := fmt.Sprintf("gen-end-%d", seed)
	params := func(db string, res string, tok int64) map[string]string {
		return fenceParams(db, res, tok, "search_path", fmt.Sprintf("g%d", seed), "lock_timeout", "300ms", "application_name", "gen")
	}

	// Current token.
	type result struct {
		lines []string
		state string
	}
	run := func(addr string, p map[string]string) result {
		if err := genSetup(ctx, ge.cur, seed); err != nil {
			r.fatalf("setup: %v", err)
		}
		s, err := dialSession(addr, p)
		if err != nil {
			r.fatalf("connect: %v", err)
		}
		lines, err := sessionTranscript(s, seq.msgs, nonce, time.Minute)
		s.Close()
		stats.sequences.Add(1)
		stats.messages.Add(int64(len(seq.msgs)))
		if err != nil {
			r.fatalf("%v after %d messages\nsequence:%s", err, len(lines), seq.listing())
		}
		state, err := genState(ctx, ge.cur, seed, false)
		if err != nil {
			r.fatalf("state: %v", err)
		}
		if err := genTeardown(ctx, ge.cur, seed); err != nil {
			r.fatalf("teardown: %v", err)
		}
		return result{lines, state}
	}
	d := run(addrOf(ge.pg.Host, ge.pg.Port), params("gen_cur", "", 0))
	px := ge.a
	if rng.IntN(2) == 0 {
		px = ge.ah
	}
	p := run(addrOf(px.Host, px.Port), params("gen_cur", fmt.Sprintf("gc%d", w), 1))
	if strings.Join(d.lines, "\n") != strings.Join(p.lines, "\n") {
		r.fatalf("current token: the proxy's session differs from a direct one:\n%s\nsequence:%s", diffLines(d.lines, p.lines), seq.listing())
	}
	if d.state != p.state {
		r.fatalf("current token: rows differ: direct %q, proxy %q\nsequence:%s", d.state, p.state, seq.listing())
	}
	stats.compared.Add(int64(len(d.lines)))

	ge.staleRound(r, w, seed, seq, rng, false, stats)
}

// staleRound runs seq with the stale token of worker w, cut at a random
// message by the raise. unfenced (the negative control): the stale session
// is connected straight to PostgreSQL, unbound, and staleRound reports whether
// the checks saw its rows change after the raise.
func (ge *genEnv) staleRound(r *parallelRun, w int, seed uint64, seq *genSeq, rng *rand.Rand, unfenced bool, stats *genStats) (detected bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	nonce := fmt.Sprintf("gen-end-%d", seed)
	params := func(db string, res string, tok int64) map[string]string {
		return fenceParams(db, res, tok, "search_path", fmt.Sprintf("g%d", seed), "lock_timeout", "300ms", "application_name", "gen")
	}
	res := fmt.Sprintf("gs%d", w)
	var tok int64
	if err := ge.stale.QueryRow(ctx, `SELECT token FROM fence.tokens WHERE resource = $1`, res).Scan(&tok); err != nil {
		r.fatalf("token: %v", err)
	}
	if err := genSetup(ctx, ge.stale, seed); err != nil {
		r.fatalf("setup: %v", err)
	}
	listening := rng.IntN(2) == 0
	px := ge.a
	if listening {
		px = ge.ah
	}
	addr, p := addrOf(px.Host, px.Port), params("gen_stale", res, tok)
	if unfenced {
		addr, p = addrOf(ge.pg.Host, ge.pg.Port), params("gen_stale", "", 0)
	}
	s, err := dialSession(addr, p)
	if err != nil {
		r.fatalf("stale connect with %d: %v", tok, err)
	}
	defer s.Close()
	started, err := backendStart(ctx, ge.admin, s.PID)
	if err != nil {
		r.fatalf("backend_start: %v", err)
	}
	cut := rng.IntN(len(seq.msgs) + 1)
	if err := s.send(seq.msgs[:cut]...); err != nil {
		r.fatalf("send: %v", err)
	}
	if d := rng.IntN(20); d > 0 {
		time.Sleep(time.Duration(d) * time.Millisecond)
	}
	alive, err := backendAlive(ctx, ge.admin, s.PID, started)
	if err != nil {
		r.fatalf("pg_stat_activity: %v", err)
	}
	// refused: a raise attempt failed after ending the stale backend (another
	// worker's transaction was prepared between fence.end_stale's two checks,
	// P4). Nothing was raised then, so a listening proxy, asking the database
	// at the backend's end, rightly saw no higher token and relayed the
	// server's 57P01 with its hint.
	refused := false
	for attempt := 0; ; attempt++ {
		err := ge.raise(ctx, "gen_stale", res, tok+1)
		if err == nil {
			break
		}
		refused = true
		if sqlstate(err) != fence.CodeRaiseFailed || !strings.Contains(err.Error(), "prepared transactions exist") || attempt == 500 {
			r.fatalf("raise to %d (attempt %d): %v\nsequence (cut before message %d):%s", tok+1, attempt, err, cut, seq.listing())
		}
		// By design: roll back the stale session's, wait for other workers'.
		stats.refusedPrepared.Add(1)
		if err := genRollbackPrepared(ctx, ge.stale, seed); err != nil {
			r.fatalf("rollback prepared: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	stats.raises.Add(1)
	atRaise, err := genState(ctx, ge.stale, seed, true)
	if err != nil {
		r.fatalf("state: %v", err)
	}
	if unfenced {
		// The unbound session goes on; its prepared transactions stay
		// prepared, so that the rows of the sequence are compared as they are.
		if _, err := sessionTranscript(s, seq.msgs[cut:], nonce, time.Minute); err != nil {
			r.fatalf("unfenced: %v", err)
		}
		s.Close()
		atEnd, err := genState(ctx, ge.stale, seed, true)
		if err != nil {
			r.fatalf("state: %v", err)
		}
		after, err := genAfterRaise(ctx, ge.stale, seed, res)
		if err != nil {
			r.fatalf("commit timestamps: %v", err)
		}
		if err := genTeardown(ctx, ge.stale, seed); err != nil {
			r.fatalf("teardown: %v", err)
		}
		return atEnd != atRaise || after > 0
	}
	if alive, err := backendAlive(ctx, ge.admin, s.PID, started); err != nil || alive {
		r.fatalf("the stale backend %d is alive after the raise returned (%v)\nsequence (cut before message %d):%s", s.PID, err, cut, seq.listing())
	}
	s.send(append(append([]pgproto3.FrontendMessage(nil), seq.msgs[cut:]...), terminatorMsgs(nonce)...)...) //nolint:errcheck // closed, most likely
	rest, err := s.finish(20*time.Second, 5)
	stats.sequences.Add(1)
	stats.messages.Add(int64(s.sent))
	if err != nil {
		r.fatalf("stale session: %v; transcript:%s\nsequence (cut before message %d):%s", err, s.transcript(), cut, seq.listing())
	}
	how := "closed"
	for _, m := range rest {
		if m.Type == "DataRow" && strings.Contains(m.Text, nonce) {
			r.fatalf("the stale session answered the end marker after the raise; transcript:%s\nsequence (cut before message %d):%s", s.transcript(), cut, seq.listing())
		}
		if m.Type == "ErrorResponse" && (m.Err.Severity == "FATAL" || m.Err.Code == fence.CodeStale) {
			how = m.Err.Code
		}
	}
	// The sequence may end its session itself (e.g. 08P01 "protocol
	// synchronization was lost": a message other than COPY data while the
	// server was in COPY IN), before the raise or while it runs: the same
	// happens direct, and a FATAL of the server's own is not a raise's.
	ownEnd := !alive || (how != fence.CodeStale && how != "57P01" && how != "08006" && how != "closed")
	switch {
	case ownEnd:
		stats.endedBeforeRaise.Add(1)
	case how == fence.CodeStale:
		stats.endedZF001.Add(1)
	case how == "57P01" && (!listening || refused):
		stats.ended57P01.Add(1)
	case (how == "08006" || how == "closed") && !listening:
		stats.endedClosed.Add(1) // the backend ended without a word (08006: the proxy says so)
	default:
		r.errorf("stale session through the %s proxy ended with %s; transcript:%s\nsequence (cut before message %d):%s",
			map[bool]string{true: "listening", false: "deaf"}[listening], how, s.transcript(), cut, seq.listing())
	}
	if len(rest) > 0 && listening && !ownEnd && !refused {
		// ZF001 last: a FATAL, or an ERROR and the proxy's ReadyForQuery.
		last := rest[len(rest)-1]
		if last.Type == "ReadyForQuery" && len(rest) > 1 {
			last = rest[len(rest)-2]
		}
		if last.Type != "ErrorResponse" || last.Err.Code != fence.CodeStale {
			r.errorf("the listening proxy's stale session did not end with ZF001: last message %s", last.Text)
		}
	}
	atEnd, err := genState(ctx, ge.stale, seed, true)
	if err != nil {
		r.fatalf("state: %v", err)
	}
	if atEnd != atRaise {
		r.errorf("VIOLATION: the stale session's rows changed after the raise:\n  at the raise: %s\n  at the end:   %s\ntranscript:%s\nsequence (cut before message %d):%s",
			atRaise, atEnd, s.transcript(), cut, seq.listing())
	}
	after, err := genAfterRaise(ctx, ge.stale, seed, res)
	if err != nil {
		r.fatalf("commit timestamps: %v", err)
	}
	if after != 0 {
		r.errorf("VIOLATION: %d stale rows have a commit timestamp after the raise's\nsequence (cut before message %d):%s", after, cut, seq.listing())
	}
	stats.staleRowsAtRise.Add(int64(genRows(atRaise)))
	if again, err := dialSession(addrOf(ge.a.Host, ge.a.Port), params("gen_stale", res, tok)); sqlstate(err) != fence.CodeStale {
		if again != nil {
			again.Close()
		}
		r.errorf("a reconnect with the stale token %d: %v, want ZF001", tok, err)
	} else {
		stats.reconnectsRefused.Add(1)
	}
	if err := genTeardown(ctx, ge.stale, seed); err != nil {
		r.fatalf("teardown: %v", err)
	}
	return false
}

// ---------------------------------------------------------------------
// The generator.

type genStmt struct {
	sql    string
	params int
	copyIn bool
}

type genSeq struct {
	msgs []pgproto3.FrontendMessage
}

type gen struct {
	rng     *rand.Rand
	seed    uint64
	lo      int64
	stmts   map[string]genStmt // what the generator believes each statement name holds
	portals map[string]genStmt
	gids    int
	lastGid string
	out     []pgproto3.FrontendMessage
	// unnamedPortal: the unnamed portal may be referenced, which is only
	// between a Bind that creates it and the end of its Sync unit (if the
	// Bind fails, the rest of the unit is skipped). PostgreSQL 15.18 crashes (signal 11, reading freed
	// memory) when the unnamed portal of a simple Query that failed in a
	// transaction block is executed after a later Query: Query "BEGIN",
	// Query "MOVE 1 IN c1" (fails), Query "SELECT 'aaa…'; SELECT 'bbb…';
	// SELECT 1" (fails: aborted), Execute "" - straight to the server, no
	// proxy involved. The crash would restart every backend of the cluster,
	// so the generator never touches a remnant of a Query.
	unnamedPortal bool
}

// genSequence returns the sequence of seed: 4 to 31 items (a Query, a Parse,
// Bind and Execute, a reuse of a statement or portal, Close, Describe, COPY),
// each followed by a Sync, a Flush or nothing.
func genSequence(seed uint64) *genSeq {
	g := &gen{rng: rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15)), seed: seed, lo: genLO(seed),
		stmts: map[string]genStmt{}, portals: map[string]genStmt{}}
	items := 4 + g.rng.IntN(28)
	for range items {
		switch k := g.rng.IntN(100); {
		case k < 25:
			g.query()
		case k < 58:
			g.extended()
		case k < 65:
			g.bindAgain()
		case k < 70:
			g.executeAgain()
		case k < 74:
			g.emit(&pgproto3.Parse{Name: g.pick("s1", "s2"), Query: g.sql().sql})
		case k < 79:
			if g.rng.IntN(2) == 0 {
				name := g.pick("", "s1", "s2")
				delete(g.stmts, name)
				g.emit(&pgproto3.Close{ObjectType: 'S', Name: name})
			} else {
				name := g.portal()
				delete(g.portals, name)
				g.emit(&pgproto3.Close{ObjectType: 'P', Name: name})
			}
		case k < 82:
			if g.rng.IntN(2) == 0 {
				g.emit(&pgproto3.Describe{ObjectType: 'S', Name: g.pick("", "s1", "s2")})
			} else {
				g.emit(&pgproto3.Describe{ObjectType: 'P', Name: g.portal()})
			}
		case k < 91:
			g.copy()
		default:
			g.emit(queryMsg(g.pick("", "-- only a comment", ";")))
		}
		switch k := g.rng.IntN(100); {
		case k < 40:
			g.emit(&pgproto3.Sync{})
		case k < 50:
			g.emit(&pgproto3.Flush{})
		}
	}
	return &genSeq{msgs: g.out}
}

func (g *gen) emit(m ...pgproto3.FrontendMessage) {
	for _, m := range m {
		switch m := m.(type) {
		case *pgproto3.Query, *pgproto3.Sync:
			g.unnamedPortal = false
		case *pgproto3.Bind:
			if m.DestinationPortal == "" {
				g.unnamedPortal = true
			}
		}
	}
	g.out = append(g.out, m...)
}

// portal picks a portal name to reuse: the unnamed one only in the Sync unit
// of its Bind (see unnamedPortal).
func (g *gen) portal() string {
	if p := g.pick("", "p1"); p == "p1" || g.unnamedPortal {
		return p
	}
	return "p1"
}

func (g *gen) pick(opts ...string) string { return opts[g.rng.IntN(len(opts))] }

func (g *gen) query() {
	n := 1 + g.rng.IntN(3)
	parts := make([]string, n)
	for i := range parts {
		parts[i] = g.sql().sql // parameters make no sense here: errors, deterministic
	}
	g.emit(queryMsg(strings.Join(parts, "; ")))
}

func (g *gen) bindParams(st genStmt) [][]byte {
	var ps [][]byte
	for range st.params {
		ps = append(ps, []byte(strconv.Itoa(g.rng.IntN(100))))
	}
	return ps
}

func (g *gen) extended() {
	name := g.pick("", "", "", "s1", "s2")
	portal := g.pick("", "", "", "p1")
	st := g.sql()
	if g.rng.IntN(16) == 0 {
		st = genStmt{sql: "COPY t (v) FROM STDIN", copyIn: true}
	}
	g.emit(&pgproto3.Parse{Name: name, Query: st.sql})
	if _, ok := g.stmts[name]; !ok || name == "" {
		g.stmts[name] = st // a named statement that exists keeps its text (42P05)
	}
	g.execute(name, portal, g.stmts[name])
}

// execute binds name to portal and executes it, with COPY data after a COPY
// FROM STDIN.
func (g *gen) execute(name, portal string, st genStmt) {
	g.emit(&pgproto3.Bind{DestinationPortal: portal, PreparedStatement: name, Parameters: g.bindParams(st)})
	g.portals[portal] = st
	if g.rng.IntN(4) == 0 {
		g.emit(&pgproto3.Describe{ObjectType: 'P', Name: portal})
	}
	g.emitExecute(portal, st)
}

func (g *gen) emitExecute(portal string, st genStmt) {
	var max uint32
	if g.rng.IntN(6) == 0 {
		max = 1
	}
	g.emit(&pgproto3.Execute{Portal: portal, MaxRows: max})
	if st.copyIn {
		g.copyData()
	}
}

func (g *gen) bindAgain() {
	name := g.pick("", "s1", "s2")
	g.execute(name, g.pick("", "p1"), g.stmts[name])
}

func (g *gen) executeAgain() {
	portal := g.portal()
	g.emitExecute(portal, g.portals[portal])
}

func (g *gen) copyData() {
	g.emit(&pgproto3.CopyData{Data: []byte(fmt.Sprintf("%d\n%d\n", g.rng.IntN(100), g.rng.IntN(100)))})
	if g.rng.IntN(8) == 0 {
		g.emit(&pgproto3.CopyData{Data: []byte("not a number\n")})
	}
	if g.rng.IntN(6) == 0 {
		g.emit(&pgproto3.CopyFail{Message: "generated CopyFail"})
	} else {
		g.emit(&pgproto3.CopyDone{})
	}
}

func (g *gen) copy() {
	out := g.rng.IntN(3) == 0
	sql := "COPY t (v) FROM STDIN"
	if out {
		sql = "COPY (SELECT id, v FROM t ORDER BY id) TO STDOUT"
	}
	if g.rng.IntN(2) == 0 {
		g.emit(queryMsg(sql))
		if !out {
			g.copyData()
		}
		return
	}
	st := genStmt{sql: sql, copyIn: !out}
	g.emit(&pgproto3.Parse{Query: sql})
	g.stmts[""] = st
	g.execute("", "", st)
}

// sql returns a statement: transaction control, a write (direct, through a
// function, a procedure or DO block that commits, a large object, NOTIFY on
// the seed's own channel: runs of other seeds share the database),
// a cursor, a read, an error or something else.
func (g *gen) sql() genStmt {
	n := g.rng.IntN(1000)
	s := func(sql string, args ...any) genStmt { return genStmt{sql: fmt.Sprintf(sql, args...)} }
	lit := func(sql string) genStmt { return genStmt{sql: sql} }
	switch k := g.rng.IntN(100); {
	case k < 28:
		if g.rng.IntN(12) == 0 && g.gids < 3 {
			g.gids++
			g.lastGid = fmt.Sprintf("g%d_%d", g.seed, g.gids)
			return s("PREPARE TRANSACTION '%s'", g.lastGid)
		}
		if g.lastGid != "" && g.rng.IntN(5) == 0 {
			return s("%s PREPARED '%s'", g.pick("COMMIT", "ROLLBACK"), g.lastGid)
		}
		return lit(g.pick("BEGIN", "BEGIN", "START TRANSACTION", "START TRANSACTION ISOLATION LEVEL REPEATABLE READ",
			"COMMIT", "COMMIT", "END", "ROLLBACK", "ABORT", "SAVEPOINT s1", "SAVEPOINT s2", "RELEASE s1",
			"RELEASE SAVEPOINT s2", "ROLLBACK TO s1", "ROLLBACK TO SAVEPOINT s2", "COMMIT AND CHAIN", "ROLLBACK AND CHAIN"))
	case k < 58:
		switch g.rng.IntN(14) {
		case 0:
			return s("INSERT INTO t (v) VALUES (%d)", n)
		case 1:
			return genStmt{sql: "INSERT INTO t (v) VALUES ($1)", params: 1}
		case 2:
			return s("INSERT INTO t (v) VALUES (%d) RETURNING id", n)
		case 3:
			return s("UPDATE t SET v = v + 1 WHERE id = (SELECT min(id) FROM t)")
		case 4:
			return s("DELETE FROM t WHERE id = (SELECT max(id) FROM t)")
		case 5:
			return s("SELECT w(%d)", n)
		case 6:
			return s("SELECT w(%d) FROM generate_series(1, 2)", n)
		case 7:
			return s("INSERT INTO u VALUES (%d)", n%4)
		case 8:
			return s("CALL p(%d)", n)
		case 9:
			return s("DO $$BEGIN INSERT INTO t (v) VALUES (%d); COMMIT; INSERT INTO t (v) VALUES (%d); END$$", n, n+1)
		case 10:
			return s("SELECT lo_from_bytea(%d, 'x')", g.lo+int64(n%4))
		case 11:
			return s("SELECT lo_unlink(%d)", g.lo+int64(n%4))
		case 12:
			return s("NOTIFY ch%d, '%d'", g.seed, n)
		default:
			return s("SELECT pg_notify('ch%d', '%d'), w(%d)", g.seed, n, n)
		}
	case k < 68:
		return lit(g.pick(
			fmt.Sprintf("DECLARE c1 CURSOR WITH HOLD FOR SELECT w(%d) FROM generate_series(1, 2)", n),
			fmt.Sprintf("DECLARE c1 CURSOR WITH HOLD FOR SELECT lo_from_bytea(%d, 'y')", g.lo+int64(n%4)),
			"DECLARE c2 CURSOR FOR SELECT id, v FROM t ORDER BY id",
			"FETCH 1 FROM c1", "FETCH ALL FROM c2", "MOVE 1 IN c1", "CLOSE c1", "CLOSE ALL"))
	case k < 78:
		if g.rng.IntN(5) == 0 {
			return genStmt{sql: "SELECT $1::int + 1", params: 1}
		}
		return lit(g.pick("SELECT count(*) FROM t", "SELECT id, v FROM t ORDER BY id", "SELECT 1", "SELECT generate_series(1, 3)", "SELECT count(*) FROM u"))
	case k < 90:
		return lit(g.pick("SELECT 1/0", "SELECT * FROM nosuch", "SELEC 1", "INSERT INTO t (id, v) VALUES (1, 0)", "SELECT w(NULL)", "INSERT INTO u VALUES (0)"))
	default:
		return lit(g.pick("ANALYZE t", "VACUUM t", fmt.Sprintf("SET application_name = 'gen %d'", n), "RESET application_name",
			fmt.Sprintf("LISTEN ch%d", g.seed), "UNLISTEN *", "SHOW transaction_isolation", "SET LOCAL lock_timeout = '200ms'"))
	}
}

// listing renders the sequence for a failure report.
func (q *genSeq) listing() string {
	var b strings.Builder
	for i, m := range q.msgs {
		fmt.Fprintf(&b, "\n    %3d ", i)
		switch m := m.(type) {
		case *pgproto3.Query:
			fmt.Fprintf(&b, "Query %q", m.String)
		case *pgproto3.Parse:
			fmt.Fprintf(&b, "Parse %q %q", m.Name, m.Query)
		case *pgproto3.Bind:
			fmt.Fprintf(&b, "Bind %q <- %q %q", m.DestinationPortal, m.PreparedStatement, m.Parameters)
		case *pgproto3.Execute:
			fmt.Fprintf(&b, "Execute %q max %d", m.Portal, m.MaxRows)
		case *pgproto3.Describe:
			fmt.Fprintf(&b, "Describe %c %q", m.ObjectType, m.Name)
		case *pgproto3.Close:
			fmt.Fprintf(&b, "Close %c %q", m.ObjectType, m.Name)
		case *pgproto3.CopyData:
			fmt.Fprintf(&b, "CopyData %q", m.Data)
		case *pgproto3.CopyFail:
			fmt.Fprintf(&b, "CopyFail %q", m.Message)
		default:
			fmt.Fprintf(&b, "%T", m)
		}
	}
	return b.String()
}
