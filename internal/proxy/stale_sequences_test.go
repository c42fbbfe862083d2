package proxy_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fenceproxy/fenceproxy/internal/fence"
)

// Regression tests of fencing v2 (issue 10): every message sequence that
// committed a stale row under v1 (DESIGN.md, "Mechanism v2"), replayed against
// v2 the way a late leader would: the stale session (token t, through proxy A)
// drives the sequence up to just before its commit point, a new leader
// connects with t+1 through proxy B (another instance, with its own registry:
// A hears nothing of the raise), then the stale session completes the
// sequence. Asserted, by querying PostgreSQL directly as the superuser:
//
//   - right after the raise returned, the stale session's backend (pid and
//     backend_start) is gone from pg_stat_activity;
//   - no row of the stale token committed after the raise (commit timestamps,
//     track_commit_timestamp), and the stale rows counted right after the raise
//     are all there are at the end (the set does not grow);
//   - the stale client saw no ReadyForQuery after the raise, only a FATAL
//     (ZF001 from a proxy that heard of the raise, 57P01 relayed by one that
//     did not) or a closed connection.
//
// Each sequence runs three ways: through proxy A (hears nothing), through
// proxy AH (LISTENs on the database, so it says ZF001), and as a control,
// connected straight to PostgreSQL, unbound, where the same sequence must
// commit a stale row after the raise: proof that the sequence reaches a
// commit point the test can see. The in-flight variants raise while the
// commit point itself is running: the write at the commit point waits on an
// advisory lock the test holds, the test raises, then releases the lock.
//
// The raw protocol session is in protocol_session_test.go, the cluster and its
// proxies in stale_env_test.go; race_test.go and generated_test.go use them too.

// judgeStaleEnd checks what a stale session's client saw after the raise.
// Allowed: ZF001 from the proxy (a FATAL to an idle client; an ERROR and a
// ReadyForQuery for each unit it waited for or sent afterwards: the proxy
// answers them itself once the backend is gone), the server's 57P01 or the
// proxy's 08006 FATAL from a proxy that did not hear of the raise (deaf), a
// closed connection, the first early ReadyForQuery (units sent before the
// raise that may have completed before it), and the partial output of the
// unit the raise interrupted. Not allowed: any other ReadyForQuery (a unit
// completed after the raise), any other error. A listening proxy must say
// ZF001. It returns how the session ended.
func judgeStaleEnd(rest []wireMsg, listening bool, early int) (string, error) {
	how := "closed"
	var prev wireMsg
	for i, m := range rest {
		switch m.Type {
		case "ReadyForQuery":
			switch {
			case prev.Type == "ErrorResponse" && prev.Err.Code == fence.CodeStale && prev.Err.Severity == "ERROR":
				// The proxy's answer to a unit of the ended session.
			case early > 0:
				early--
			default:
				return "", fmt.Errorf("the stale session completed a unit after the raise (message %d: %s)", i, m.Text)
			}
		case "ErrorResponse":
			e := m.Err
			switch {
			case e.Code == fence.CodeStale:
				if !strings.Contains(e.Message, "stale fencing token") {
					return "", fmt.Errorf("ZF001 without the stale token message: %s", m.Text)
				}
				how = e.Code
			case e.Severity == "FATAL" && (e.Code == "57P01" || e.Code == "08006") && !listening:
				how = e.Code
			default:
				return "", fmt.Errorf("unexpected error after the raise: %s", m.Text)
			}
		}
		prev = m
	}
	if listening && how != fence.CodeStale {
		return "", fmt.Errorf("the proxy that heard of the raise did not say ZF001 (ended: %s)", how)
	}
	return how, nil
}

// probeMsgs is the unit a stale client sends next: a session that the proxy
// ended answers it with ZF001 and closes.
func probeMsgs() []pgproto3.FrontendMessage { return frontendMsgs(queryMsg("SELECT 'v2 probe'")) }

// ---------------------------------------------------------------------
// The regression cases.

// seqCase is one run's context: its resource, the stale token, the advisory
// lock key of the in-flight variant, a large object OID, and the protocol.
type seqCase struct {
	n    int
	res  string
	tok  int64
	key  int64
	lo   int64
	ext  bool // extended protocol
	wait bool // in-flight variant: the write at the commit point waits on key
}

// w is a write of a stale row from inside a query; at the commit point of the
// in-flight variant it waits on the test's advisory lock after writing.
func (c seqCase) w(tag string) string {
	if c.wait {
		return fmt.Sprintf("public.v2_write_wait('%s', %d, '%s', %d)", c.res, c.tok, tag, c.key)
	}
	return c.wnow(tag)
}

// wnow is a write that never waits.
func (c seqCase) wnow(tag string) string {
	return fmt.Sprintf("public.v2_write('%s', %d, '%s')", c.res, c.tok, tag)
}

func (c seqCase) insert(tag string) string {
	return fmt.Sprintf("INSERT INTO public.v2_rows (resource, token, tag) VALUES ('%s', %d, '%s')", c.res, c.tok, tag)
}

// seqStep is a group of messages and what to read after them.
type seqStep struct {
	msgs  []pgproto3.FrontendMessage
	rfq   int    // ReadyForQuery messages that end the step
	until string // with rfq 0: the message type that ends it
	fail  bool   // the step must fail (an ErrorResponse)
}

// stmt is sql on its own: a Query, or Parse, Bind, Execute and Sync.
func (c seqCase) stmt(sql string) seqStep {
	if c.ext {
		return seqStep{msgs: frontendMsgs(parseBindExecute("", "", sql), &pgproto3.Sync{}), rfq: 1}
	}
	return seqStep{msgs: frontendMsgs(queryMsg(sql)), rfq: 1}
}

func (c seqCase) bad(sql string) seqStep {
	s := c.stmt(sql)
	s.fail = true
	return s
}

// unit is sqls in one Query, or in one Sync unit.
func (c seqCase) unit(sqls ...string) seqStep {
	if !c.ext {
		return seqStep{msgs: frontendMsgs(queryMsg(strings.Join(sqls, "; "))), rfq: 1}
	}
	var msgs []pgproto3.FrontendMessage
	for _, s := range sqls {
		msgs = append(msgs, parseBindExecute("", "", s)...)
	}
	return seqStep{msgs: append(msgs, &pgproto3.Sync{}), rfq: 1}
}

func rawUnitStep(rfq int, fail bool, parts ...any) seqStep {
	return seqStep{msgs: frontendMsgs(parts...), rfq: rfq, fail: fail}
}

// staleSequence is one sequence of the Why list.
type staleSequence struct {
	name string
	// protos: which protocols to run it in (false: simple, true: extended).
	protos []bool
	// idle: raise while the stale session waits before its commit point;
	// inflight: raise while the commit point runs (it must block on c.key).
	idle, inflight bool
	// setup prepares a run (as the superuser) before the stale session starts.
	setup func(ctx context.Context, admin *pgxpool.Pool, c seqCase) error
	// build returns the steps up to the commit point and the commit point.
	build func(c seqCase) (before, commit []seqStep)
	// rows lists the xmin of every stale row ($1: the resource); default
	// defaultStaleRows.
	rows func(c seqCase) string
	// fenced is how many stale rows a fenced run commits before the raise
	// (nil: 0).
	fenced func(c seqCase) int
	// state, when set, is the stale backend's pg_stat_activity state just
	// before the raise.
	state string
	// early is how many units of the commit point complete before it blocks
	// (in-flight variant).
	early int
}

var (
	bothProtocols = []bool{false, true}
	extendedOnly  = []bool{true}
)

// vacuumSetup creates the table of the expression-index cases: owned by
// app, three rows, and an index on an IMMUTABLE function that writes a stale
// row (through a volatile one) whenever it runs as app: at VACUUM FULL,
// ANALYZE, or an index build.
func vacuumSetup(ctx context.Context, admin *pgxpool.Pool, c seqCase) error {
	sql := fmt.Sprintf(`
CREATE TABLE public.v2_vac_%[1]d (x int);
INSERT INTO public.v2_vac_%[1]d VALUES (1), (2), (3);
CREATE FUNCTION public.v2_idx_%[1]d(x int) RETURNS int LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN current_user = 'app' THEN %[2]s ELSE 0 END + x
$$;
CREATE INDEX ON public.v2_vac_%[1]d (public.v2_idx_%[1]d(x));
ALTER TABLE public.v2_vac_%[1]d OWNER TO app;
`, c.n, c.w("expression index"))
	_, err := admin.Exec(ctx, sql, pgx.QueryExecModeSimpleProtocol)
	return err
}

func largeObjectRows(c seqCase) string {
	return fmt.Sprintf(`SELECT xmin FROM pg_largeobject_metadata WHERE oid = %d`, c.lo)
}

// loExpr creates the run's large object; in the in-flight variant it then
// waits on the test's lock.
func (c seqCase) loExpr() string {
	if c.wait {
		return fmt.Sprintf("CASE WHEN lo_from_bytea(%d, 'stale') > 0 THEN public.v2_wait(%d) END", c.lo, c.key)
	}
	return fmt.Sprintf("lo_from_bytea(%d, 'stale')", c.lo)
}

// noSyncThen: a write Executed without Sync, then a Query (sql), with BEGIN
// first when block. In the in-flight variant the Execute goes with the Query.
func noSyncThen(block bool, query string) func(c seqCase) (before, commit []seqStep) {
	return func(c seqCase) (before, commit []seqStep) {
		if block {
			before = append(before, rawUnitStep(1, false, queryMsg("BEGIN")))
		}
		exec := parseBindExecute("", "", "SELECT "+c.w("executed without sync"))
		if c.wait {
			return before, []seqStep{rawUnitStep(1, false, exec, queryMsg(query))}
		}
		before = append(before, seqStep{msgs: frontendMsgs(exec, &pgproto3.Flush{}), until: "CommandComplete"})
		return before, []seqStep{rawUnitStep(1, false, queryMsg(query))}
	}
}

var staleSequences = []staleSequence{
	// 1. Held cursors whose query writes: it runs inside COMMIT.
	{name: "held cursor in a block", protos: bothProtocols, idle: true, inflight: true,
		build: func(c seqCase) ([]seqStep, []seqStep) {
			return []seqStep{c.stmt("BEGIN"), c.stmt("DECLARE c CURSOR WITH HOLD FOR SELECT " + c.w("held cursor"))},
				[]seqStep{c.stmt("COMMIT")}
		}},
	{name: "held cursor in autocommit", protos: bothProtocols, idle: true, inflight: true,
		build: func(c seqCase) ([]seqStep, []seqStep) {
			return nil, []seqStep{c.stmt("DECLARE c CURSOR WITH HOLD FOR SELECT " + c.w("held cursor"))}
		}},
	{name: "held cursor of lo_from_bytea in a block", protos: bothProtocols, idle: true, inflight: true, rows: largeObjectRows,
		build: func(c seqCase) ([]seqStep, []seqStep) {
			return []seqStep{c.stmt("BEGIN"), c.stmt("DECLARE c CURSOR WITH HOLD FOR SELECT " + c.loExpr())},
				[]seqStep{c.stmt("COMMIT")}
		}},
	{name: "held cursor of lo_from_bytea in autocommit", protos: bothProtocols, idle: true, inflight: true, rows: largeObjectRows,
		build: func(c seqCase) ([]seqStep, []seqStep) {
			return nil, []seqStep{c.stmt("DECLARE c CURSOR WITH HOLD FOR SELECT " + c.loExpr())}
		}},
	// 2. A block failed after a SAVEPOINT, then ROLLBACK TO, a write and COMMIT
	// in one Sync unit (one Query in the simple protocol).
	{name: "ROLLBACK TO a failed savepoint, write and COMMIT in one unit", protos: bothProtocols, idle: true, inflight: true,
		state: "idle in transaction (aborted)",
		build: func(c seqCase) ([]seqStep, []seqStep) {
			return []seqStep{c.stmt("BEGIN"), c.stmt("SAVEPOINT s"), c.bad("SELECT 1/0")},
				[]seqStep{c.unit("ROLLBACK TO s", "SELECT "+c.w("after rollback to"), "COMMIT")}
		}},
	// 3. Execute of a write without Sync, then a Query.
	{name: "Execute without Sync then Query COMMIT in a block", protos: extendedOnly, idle: true, inflight: true,
		build: noSyncThen(true, "COMMIT")},
	{name: "Execute without Sync then Query COMMIT", protos: extendedOnly, idle: true, inflight: true,
		build: noSyncThen(false, "COMMIT")},
	{name: "Execute without Sync then a comment-only Query", protos: extendedOnly, idle: true, inflight: true,
		build: noSyncThen(false, "-- nothing but a comment")},
	{name: "Execute without Sync then an empty Query", protos: extendedOnly, idle: true, inflight: true,
		build: noSyncThen(false, "")},
	// 4. Statement names and portals that still mean COMMIT on the server.
	{name: "named statement whose re-Parse failed with 42P05", protos: extendedOnly, idle: true,
		build: func(c seqCase) ([]seqStep, []seqStep) {
			return []seqStep{
					rawUnitStep(1, false, &pgproto3.Parse{Name: "s1", Query: "COMMIT"}, &pgproto3.Sync{}),
					rawUnitStep(1, true, &pgproto3.Parse{Name: "s1", Query: "SELECT 1"}, &pgproto3.Sync{}),
					rawUnitStep(1, false, queryMsg("BEGIN")),
					rawUnitStep(1, false, queryMsg("SELECT "+c.w("before statement s1"))),
				},
				[]seqStep{rawUnitStep(1, false, &pgproto3.Bind{PreparedStatement: "s1"}, &pgproto3.Execute{}, &pgproto3.Sync{})}
		}},
	{name: "named statement whose Close and re-Parse were skipped after an error", protos: extendedOnly, idle: true,
		build: func(c seqCase) ([]seqStep, []seqStep) {
			return []seqStep{
					rawUnitStep(1, false, &pgproto3.Parse{Name: "s1", Query: "COMMIT"}, &pgproto3.Sync{}),
					rawUnitStep(1, true, parseBindExecute("", "", "SELECT 1/0"), &pgproto3.Close{ObjectType: 'S', Name: "s1"},
						&pgproto3.Parse{Name: "s1", Query: "SELECT 1"}, &pgproto3.Sync{}),
					rawUnitStep(1, false, queryMsg("BEGIN")),
					rawUnitStep(1, false, queryMsg("SELECT "+c.w("before statement s1"))),
				},
				[]seqStep{rawUnitStep(1, false, &pgproto3.Bind{PreparedStatement: "s1"}, &pgproto3.Execute{}, &pgproto3.Sync{})}
		}},
	{name: "portal rebound in a failed savepoint", protos: extendedOnly, idle: true,
		build: func(c seqCase) ([]seqStep, []seqStep) {
			return []seqStep{
					rawUnitStep(1, false, queryMsg("BEGIN")),
					rawUnitStep(1, false, &pgproto3.Parse{Name: "sc", Query: "COMMIT"}, &pgproto3.Bind{DestinationPortal: "p", PreparedStatement: "sc"}, &pgproto3.Sync{}),
					rawUnitStep(1, false, queryMsg("SAVEPOINT s")),
					rawUnitStep(1, true, queryMsg("SELECT 1/0")),
					rawUnitStep(1, true, &pgproto3.Parse{Name: "s2", Query: "SELECT 1"}, &pgproto3.Bind{DestinationPortal: "p", PreparedStatement: "s2"}, &pgproto3.Sync{}),
					rawUnitStep(1, false, queryMsg("ROLLBACK TO s")),
					rawUnitStep(1, false, queryMsg("SELECT "+c.w("before portal p"))),
				},
				[]seqStep{rawUnitStep(1, false, &pgproto3.Execute{Portal: "p"}, &pgproto3.Sync{})}
		}},
	// 5. v1's prepared check replaced from PL/pgSQL; user code run by VACUUM
	// FULL and ANALYZE through an expression index.
	{name: "prepared statements replaced from PL/pgSQL", protos: bothProtocols, idle: true,
		build: func(c seqCase) ([]seqStep, []seqStep) {
			return []seqStep{c.stmt("BEGIN"), c.stmt("SELECT " + c.w("before DEALLOCATE")),
					c.stmt(`DO $$BEGIN EXECUTE 'DEALLOCATE ALL'; EXECUTE 'PREPARE __fenceproxy_check AS SELECT 1'; END$$`)},
				[]seqStep{c.stmt("COMMIT")}
		}},
	{name: "VACUUM FULL through an expression index", protos: bothProtocols, idle: true, inflight: true, setup: vacuumSetup,
		build: func(c seqCase) ([]seqStep, []seqStep) {
			return nil, []seqStep{c.stmt(fmt.Sprintf("VACUUM FULL public.v2_vac_%d", c.n))}
		}},
	{name: "ANALYZE through an expression index in a block", protos: bothProtocols, idle: true, setup: vacuumSetup,
		build: func(c seqCase) ([]seqStep, []seqStep) {
			return []seqStep{c.stmt("BEGIN"), c.stmt(fmt.Sprintf("ANALYZE public.v2_vac_%d", c.n))}, []seqStep{c.stmt("COMMIT")}
		}},
	{name: "ANALYZE through an expression index in autocommit", protos: bothProtocols, inflight: true, setup: vacuumSetup,
		build: func(c seqCase) ([]seqStep, []seqStep) {
			return nil, []seqStep{c.stmt(fmt.Sprintf("ANALYZE public.v2_vac_%d", c.n))}
		}},
	// Commit points inside a statement, the plain idle-in-transaction case,
	// and a pipeline.
	{name: "procedure that commits inside", protos: bothProtocols, idle: true, inflight: true,
		fenced: func(c seqCase) int {
			if c.wait {
				return 1 // its first COMMIT ran before the raise
			}
			return 0
		},
		build: func(c seqCase) ([]seqStep, []seqStep) {
			return nil, []seqStep{c.stmt(fmt.Sprintf("CALL public.v2_proc('%s', %d, %d)", c.res, c.tok, c.key))}
		}},
	{name: "DO block that commits inside", protos: bothProtocols, idle: true, inflight: true,
		fenced: func(c seqCase) int {
			if c.wait {
				return 1
			}
			return 0
		},
		build: func(c seqCase) ([]seqStep, []seqStep) {
			return nil, []seqStep{c.stmt(fmt.Sprintf(`DO $$BEGIN PERFORM %s; COMMIT; PERFORM %s; END$$`, c.wnow("do 1"), c.w("do 2")))}
		}},
	{name: "idle in transaction", protos: bothProtocols, idle: true, state: "idle in transaction",
		build: func(c seqCase) ([]seqStep, []seqStep) {
			return []seqStep{c.stmt("BEGIN"), c.stmt(c.insert("idle in transaction"))}, []seqStep{c.stmt("COMMIT")}
		}},
	// 6. Execute (error), Query, Sync once desynchronised v1's session; then a
	// block idle in transaction.
	{name: "block after Execute error, Query, Sync", protos: bothProtocols, idle: true, state: "idle in transaction",
		build: func(c seqCase) ([]seqStep, []seqStep) {
			return []seqStep{rawUnitStep(1, true, parseBindExecute("", "", "SELECT 1/0"), queryMsg("SELECT 1"), &pgproto3.Sync{}),
					c.stmt("BEGIN"), c.stmt(c.insert("after the desync"))},
				[]seqStep{c.stmt("COMMIT")}
		}},
	{name: "COMMIT AND CHAIN", protos: bothProtocols, idle: true,
		build: func(c seqCase) ([]seqStep, []seqStep) {
			return []seqStep{c.stmt("BEGIN"), c.stmt(c.insert("chain"))}, []seqStep{c.stmt("COMMIT AND CHAIN")}
		}},
	{name: "pipeline of three Sync units", protos: extendedOnly, idle: true, inflight: true, early: 1,
		build: func(c seqCase) ([]seqStep, []seqStep) {
			return nil, []seqStep{rawUnitStep(3, false,
				parseBindExecute("", "", "BEGIN"), &pgproto3.Sync{},
				parseBindExecute("", "", "SELECT "+c.w("pipeline")), &pgproto3.Sync{},
				parseBindExecute("", "", "COMMIT"), &pgproto3.Sync{})}
		}},
	{name: "multi-statement Query with COMMIT in the middle", protos: []bool{false}, idle: true, inflight: true,
		build: func(c seqCase) ([]seqStep, []seqStep) {
			return []seqStep{c.stmt("BEGIN")},
				[]seqStep{rawUnitStep(1, false, queryMsg("SELECT "+c.w("multi 1")+"; COMMIT; SELECT "+c.wnow("multi 2")))}
		}},
}

type seqMode int

const (
	viaA      seqMode = iota // through proxy A, which hears nothing of the raise
	viaAH                    // through proxy AH, which LISTENs for raises
	viaDirect                // control: straight to PostgreSQL, unbound
)

func (m seqMode) String() string {
	return [...]string{"proxy", "listening proxy", "direct control"}[m]
}

type seqVariant struct {
	cs   staleSequence
	c    seqCase
	mode seqMode
}

func (v seqVariant) name() string {
	proto := "simple"
	if v.c.ext {
		proto = "extended"
	}
	when := "raise before the commit point"
	if v.c.wait {
		when = "raise during the commit point"
	}
	return fmt.Sprintf("%s/%s/%s/%s", v.cs.name, proto, when, v.mode)
}

// TestStaleSequencesCommitNothingAfterTheRaise runs every case of staleSequences in every protocol, variant and
// mode (see the top of this file).
func TestStaleSequencesCommitNothingAfterTheRaise(t *testing.T) {
	t.Parallel()
	var variants []seqVariant
	n := 0
	for _, cs := range staleSequences {
		for _, ext := range cs.protos {
			for _, wait := range []bool{false, true} {
				if (wait && !cs.inflight) || (!wait && !cs.idle) {
					continue
				}
				for _, mode := range []seqMode{viaA, viaAH, viaDirect} {
					n++
					c := seqCase{n: n, res: fmt.Sprintf("v2r%d", n), tok: 1, key: 7700000 + int64(n), lo: 4200000 + int64(n), ext: ext, wait: wait}
					variants = append(variants, seqVariant{cs: cs, c: c, mode: mode})
				}
			}
		}
	}
	resources := make([]string, len(variants))
	for i, v := range variants {
		resources[i] = v.c.res
	}
	e := startStaleEnv(t, resources)
	runs := make([]*parallelRun, len(variants))
	for i, v := range variants {
		runs[i] = &parallelRun{name: v.name()}
	}
	start := time.Now()
	runParallel(12, runs, func(i int, r *parallelRun) { e.runCase(r, variants[i]) })
	t.Logf("%d runs (%d cases) in %v", len(runs), len(staleSequences), time.Since(start).Round(time.Millisecond))
	for _, r := range runs {
		t.Run(r.name, r.report)
	}
}

// runCase runs one variant (see the top of this file).
func (e *staleEnv) runCase(r *parallelRun, v seqVariant) {
	cs, c, mode := v.cs, v.c, v.mode
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	if cs.setup != nil {
		if err := cs.setup(ctx, e.admin, c); err != nil {
			r.fatalf("setup: %v", err)
		}
	}
	rows := defaultStaleRows
	if cs.rows != nil {
		rows = cs.rows(c)
	}
	before, commit := cs.build(c)
	fenced := mode != viaDirect
	addr, params := addrOf(e.pg.Host, e.pg.Port), fenceParams("postgres", "", 0)
	switch mode {
	case viaA:
		addr, params = addrOf(e.a.Host, e.a.Port), fenceParams("postgres", c.res, c.tok)
	case viaAH:
		addr, params = addrOf(e.ah.Host, e.ah.Port), fenceParams("postgres", c.res, c.tok)
	}
	s, err := dialSession(addr, params)
	if err != nil {
		r.fatalf("connect: %v", err)
	}
	defer s.Close()
	started, err := backendStart(ctx, e.admin, s.PID)
	if err != nil {
		r.fatalf("backend_start of %d: %v", s.PID, err)
	}
	step := func(i int, st seqStep, what string) {
		msgs, err := s.untilRFQ(st.rfq, st.until, 20*time.Second)
		if err != nil {
			r.fatalf("%s step %d: %v; transcript:%s", what, i, err, s.transcript())
		}
		failed := false
		for _, m := range msgs {
			failed = failed || m.Type == "ErrorResponse"
		}
		if failed != st.fail {
			r.fatalf("%s step %d: error %t, want %t; transcript:%s", what, i, failed, st.fail, s.transcript())
		}
	}
	for i, st := range before {
		if err := s.send(st.msgs...); err != nil {
			r.fatalf("before step %d: send: %v", i, err)
		}
		step(i, st, "before")
	}
	if cs.state != "" {
		var state string
		if err := e.admin.QueryRow(ctx, `SELECT state FROM pg_stat_activity WHERE pid = $1`, int32(s.PID)).Scan(&state); err != nil {
			r.fatalf("state: %v", err)
		}
		if state != cs.state {
			r.fatalf("stale backend state before the raise: %q, want %q", state, cs.state)
		}
	}

	var lock *pgxpool.Conn
	unlock := func() {
		if lock != nil {
			if _, err := lock.Exec(ctx, `SELECT pg_advisory_unlock($1)`, c.key); err != nil {
				r.errorf("unlock: %v", err)
			}
			lock.Release()
			lock = nil
		}
	}
	defer unlock()
	var commitMsgs []pgproto3.FrontendMessage
	for _, st := range commit {
		commitMsgs = append(commitMsgs, st.msgs...)
	}
	if c.wait {
		if lock, err = e.admin.Acquire(ctx); err != nil {
			r.fatalf("acquire: %v", err)
		}
		if _, err := lock.Exec(ctx, `SELECT pg_advisory_lock($1)`, c.key); err != nil {
			r.fatalf("lock: %v", err)
		}
		if err := s.send(commitMsgs...); err != nil {
			r.fatalf("commit point: send: %v", err)
		}
		deadline := time.Now().Add(20 * time.Second)
		for {
			var ev *string
			if err := e.admin.QueryRow(ctx, `SELECT wait_event FROM pg_stat_activity WHERE pid = $1`, int32(s.PID)).Scan(&ev); err != nil {
				r.fatalf("wait_event: %v", err)
			}
			if ev != nil && *ev == "advisory" {
				break
			}
			if time.Now().After(deadline) {
				s.untilRFQ(1, "", 100*time.Millisecond) //nolint:errcheck // for the transcript
				r.fatalf("the commit point did not reach its wait within 20 s; transcript:%s", s.transcript())
			}
			time.Sleep(5 * time.Millisecond)
		}
	}

	if err := e.raise(ctx, "postgres", c.res, c.tok+1); err != nil {
		r.fatalf("raise: %v", err)
	}
	if fenced {
		alive, err := backendAlive(ctx, e.admin, s.PID, started)
		if err != nil {
			r.fatalf("pg_stat_activity: %v", err)
		}
		if alive {
			r.fatalf("the stale backend %d is still in pg_stat_activity after the raise returned", s.PID)
		}
	}
	atRaise, _, err := staleRows(ctx, e.admin, rows, c.res)
	if err != nil {
		r.fatalf("stale rows: %v", err)
	}
	if c.wait {
		unlock()
	} else {
		s.send(commitMsgs...) //nolint:errcheck // the stale session's connection may be closed already
	}

	if fenced {
		s.send(probeMsgs()...) //nolint:errcheck // closed, most likely
		rest, err := s.finish(20*time.Second, 5)
		if err != nil {
			r.fatalf("%v; transcript:%s", err, s.transcript())
		}
		early := 0
		if c.wait {
			early = cs.early
		}
		how, err := judgeStaleEnd(rest, mode == viaAH, early)
		if err != nil {
			r.fatalf("%v; transcript:%s", err, s.transcript())
		}
		total, after, err := staleRows(ctx, e.admin, rows, c.res)
		if err != nil {
			r.fatalf("stale rows: %v", err)
		}
		want := 0
		if cs.fenced != nil {
			want = cs.fenced(c)
		}
		if after != 0 {
			r.errorf("VIOLATION: %d stale rows committed after the raise; transcript:%s", after, s.transcript())
		}
		if total != atRaise {
			r.errorf("the stale rows grew after the raise: %d right after it, %d at the end", atRaise, total)
		}
		if total != want {
			r.errorf("%d stale rows committed, want %d", total, want)
		}
		r.logf("stale session ended (%s) after %d messages; stale rows %d, after the raise %d", how, s.sent, total, after)
		return
	}
	// The control: the same sequence, unfenced, commits after the raise.
	for i, st := range commit {
		step(i, st, "commit")
	}
	total, after, err := staleRows(ctx, e.admin, rows, c.res)
	if err != nil {
		r.fatalf("stale rows: %v", err)
	}
	if after == 0 {
		r.errorf("control: unfenced, the sequence committed no row after the raise (%d in all): it does not reach the commit point it should test; transcript:%s", total, s.transcript())
	}
	r.logf("control: %d stale rows, %d committed after the raise", total, after)
}
