package sqltx_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/sqltx"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// These tests ask a real PostgreSQL 15 what it does with the strings this
// package plans, so that the rules in doc.go stay measured facts.

const serverSetup = `
CREATE TABLE t (x int);
CREATE TABLE fence_state (stale bool NOT NULL);
INSERT INTO fence_state VALUES (false);
-- A stand-in for fence.check: it fails when the transaction wrote and the
-- token is stale, and costs nothing otherwise.
CREATE FUNCTION fence_check() RETURNS text LANGUAGE plpgsql AS $$
BEGIN
	IF pg_current_xact_id_if_assigned() IS NOT NULL AND (SELECT stale FROM fence_state) THEN
		RAISE EXCEPTION 'stale fencing token' USING ERRCODE = 'ZF001';
	END IF;
	RETURN 'fenceproxy-check';
END $$;
CREATE PROCEDURE p() LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO t VALUES (100);
	COMMIT;
	INSERT INTO t VALUES (101);
END $$;
CREATE FUNCTION ins() RETURNS int LANGUAGE sql AS $$ INSERT INTO t VALUES (7) RETURNING x $$;
CREATE INDEX i ON t (x);
CREATE TABLE pt (x int) PARTITION BY RANGE (x);
CREATE TABLE pt1 PARTITION OF pt FOR VALUES FROM (0) TO (10);
`

const serverCheck = "SELECT fence_check()"

type server struct {
	pg    *testenv.Postgres
	admin *pgconn.PgConn
}

func startServer(t *testing.T) *server {
	t.Helper()
	s := &server{pg: testenv.StartPostgres(t)}
	s.admin = connectServer(t, s.pg)
	s.exec(t, s.admin, serverSetup)
	return s
}

func connectServer(t *testing.T, pg *testenv.Postgres) *pgconn.PgConn {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	conn, err := pgconn.Connect(ctx, pg.AdminURL())
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// exec runs sql and fails the test on any error.
func (s *server) exec(t *testing.T, conn *pgconn.PgConn, sql string) {
	t.Helper()
	if o := run(t, conn, sql); o.err != nil {
		t.Fatalf("%s: %v", sql, o.err)
	}
}

// outcome is what a Query did: one result per statement that completed, the
// error that ended it, and the transaction status after it.
type outcome struct {
	results [][][]string // per statement, its rows
	tags    []string
	err     *pgconn.PgError
	status  byte
}

func (o outcome) code() string {
	if o.err == nil {
		return ""
	}
	return o.err.Code
}

func run(t *testing.T, conn *pgconn.PgConn, sql string) outcome {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	var o outcome
	mrr := conn.Exec(ctx, sql)
	for mrr.NextResult() {
		r := mrr.ResultReader().Read()
		if r.Err != nil {
			continue // the failing statement: no result
		}
		rows := make([][]string, len(r.Rows))
		for i, row := range r.Rows {
			for _, v := range row {
				rows[i] = append(rows[i], string(v))
			}
		}
		o.results = append(o.results, rows)
		o.tags = append(o.tags, r.CommandTag.String())
	}
	if err := mrr.Close(); err != nil {
		if !errors.As(err, &o.err) {
			t.Fatalf("%q: %v", sql, err)
		}
	}
	o.status = conn.TxStatus()
	return o
}

// reset ends conn's block (as the proxy does after a failed check), resolves
// prepared transactions with commit (they would be committed later: what
// they hold must already be safe), and returns the rows of t.
func (s *server) reset(t *testing.T, conn *pgconn.PgConn) []string {
	t.Helper()
	if conn.TxStatus() != 'I' {
		s.exec(t, conn, "ROLLBACK")
	}
	for _, row := range run(t, s.admin, "SELECT gid FROM pg_prepared_xacts").results[0] {
		s.exec(t, s.admin, "COMMIT PREPARED '"+row[0]+"'")
	}
	o := run(t, s.admin, "SELECT x::text FROM t ORDER BY x")
	s.exec(t, s.admin, "TRUNCATE t")
	var xs []string
	for _, row := range o.results[0] {
		xs = append(xs, row[0])
	}
	return xs
}

func (s *server) setStale(t *testing.T, stale bool) {
	t.Helper()
	s.exec(t, s.admin, fmt.Sprintf("UPDATE fence_state SET stale = %v", stale))
}

// enter puts conn in the start state: idle; in a block that wrote and has a
// savepoint s; or in a failed block with a savepoint s.
func (s *server) enter(t *testing.T, conn *pgconn.PgConn, st start) {
	t.Helper()
	switch st {
	case inBlock:
		s.exec(t, conn, "BEGIN; INSERT INTO t VALUES (0); SAVEPOINT s")
	case failedBlock:
		run(t, conn, "BEGIN; SAVEPOINT s; SELECT 1/0")
		if conn.TxStatus() != 'E' {
			t.Fatalf("status %c, want E", conn.TxStatus())
		}
	}
}

func TestServer(t *testing.T) {
	s := startServer(t)
	t.Run("rules", s.testRules)
	t.Run("plans", s.testPlans)
	t.Run("random plans", s.testRandomPlans)
	t.Run("copy", s.testCopy)
	t.Run("no transaction block", s.testNoTxBlock)
	t.Run("lexer settings", s.testLexerSettings)
}

// testRules asserts the PostgreSQL 15 behaviour that PlanQuery relies on.
func (s *server) testRules(t *testing.T) {
	conn := connectServer(t, s.pg)
	other := connectServer(t, s.pg)
	tests := []struct {
		name    string
		start   start
		sql     string
		code    string   // SQLSTATE of the error that ends the string
		status  byte     // after the string
		visible []string // rows another session sees right after the string
		rows    []string // rows after reset (ROLLBACK, COMMIT PREPARED)
	}{
		{name: "begin adopts the implicit transaction", sql: "INSERT INTO t VALUES (1); BEGIN; INSERT INTO t VALUES (2); ROLLBACK", status: 'I'},
		{name: "commit ends the implicit transaction", sql: "INSERT INTO t VALUES (1); COMMIT; INSERT INTO t VALUES (2); SELECT 1/0",
			code: "22012", status: 'I', visible: []string{"1"}, rows: []string{"1"}},
		{name: "commit and chain stays in a block", sql: "BEGIN; INSERT INTO t VALUES (1); COMMIT AND CHAIN; INSERT INTO t VALUES (2)",
			status: 'T', visible: []string{"1"}, rows: []string{"1"}},
		{name: "prepare transaction prepares the implicit transaction", sql: "INSERT INTO t VALUES (1); PREPARE TRANSACTION 'g'",
			status: 'I', rows: []string{"1"}},
		{name: "lone prepare transaction prepares nothing", sql: "PREPARE TRANSACTION 'g'", status: 'I'},
		{name: "an error ends the string", sql: "INSERT INTO t VALUES (1); SELECT 1/0; INSERT INTO t VALUES (2)", code: "22012", status: 'I'},
		{name: "commit and chain outside a block", sql: "INSERT INTO t VALUES (1); COMMIT AND CHAIN", code: "25P01", status: 'I'},
		{name: "rollback and chain outside a block", sql: "INSERT INTO t VALUES (1); ROLLBACK AND CHAIN", code: "25P01", status: 'I'},
		{name: "savepoint outside a block", sql: "INSERT INTO t VALUES (1); SAVEPOINT x", code: "25P01", status: 'I'},
		{name: "call alone commits inside", sql: "CALL p()", status: 'I', visible: []string{"100", "101"}, rows: []string{"100", "101"}},
		{name: "call in a multi-statement string", sql: "CALL p(); SELECT 1", code: "2D000", status: 'I'},
		{name: "call with a check appended", sql: "CALL p()\n;" + serverCheck, code: "2D000", status: 'I'},
		{name: "call in a block", sql: "BEGIN; CALL p()", code: "2D000", status: 'E'},
		{name: "do in a multi-statement string", sql: "DO $$BEGIN INSERT INTO t VALUES (1); COMMIT; END$$; SELECT 1", code: "2D000", status: 'I'},
		{name: "vacuum first in a string", sql: "VACUUM t; SELECT 1", code: "25001", status: 'I'},
		{name: "vacuum last in a string", sql: "SELECT 1; VACUUM t", code: "25001", status: 'I'},
		{name: "commit of a failed block rolls back", start: failedBlock, sql: "COMMIT", status: 'I'},
		{name: "rollback to revives a failed block", start: failedBlock, sql: "ROLLBACK TO s; INSERT INTO t VALUES (1); COMMIT",
			status: 'I', visible: []string{"1"}, rows: []string{"1"}},
		{name: "failed block refuses work", start: failedBlock, sql: "INSERT INTO t VALUES (1); COMMIT", code: "25P02", status: 'E'},
		{name: "backslash is ordinary in standard strings", sql: `INSERT INTO t SELECT length('a\'); INSERT INTO t VALUES (5); --'`,
			status: 'I', visible: []string{"2", "5"}, rows: []string{"2", "5"}},
		{name: "trailing line comment before the appended check", sql: "INSERT INTO t VALUES (1) -- c\n;" + serverCheck,
			status: 'I', visible: []string{"1"}, rows: []string{"1"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s.enter(t, conn, tt.start)
			o := run(t, conn, tt.sql)
			if o.code() != tt.code || o.status != tt.status {
				t.Errorf("%q: error %q, status %c; want %q, %c", tt.sql, o.code(), o.status, tt.code, tt.status)
			}
			vis := run(t, other, "SELECT x::text FROM t ORDER BY x")
			var visible []string
			for _, r := range vis.results[0] {
				visible = append(visible, r[0])
			}
			if !slices.Equal(visible, tt.visible) {
				t.Errorf("%q: another session sees %v, want %v", tt.sql, visible, tt.visible)
			}
			if rows := s.reset(t, conn); !slices.Equal(rows, tt.rows) {
				t.Errorf("%q: rows %v after reset, want %v", tt.sql, rows, tt.rows)
			}
		})
	}
}

// runnable plan tests: those of planTests whose statements exist here.
var serverPlanTests = []struct {
	sql   string
	start start
}{
	{"SELECT 1", idle}, {"SELECT 1;", idle}, {"SELECT 1 -- done", idle}, {"", idle}, {"-- nothing", idle},
	{"INSERT INTO t VALUES (1); INSERT INTO t VALUES (2)", idle},
	{"CALL p()", idle}, {"CALL p()", inBlock},
	{"DO $$BEGIN INSERT INTO t VALUES (1); COMMIT; END$$", idle},
	{"SELECT ins()", idle}, {"SELECT ins()", inBlock},
	{"WITH w AS (INSERT INTO t VALUES (1) RETURNING x) SELECT * FROM w", idle},
	{"COMMIT", idle}, {"COMMIT", inBlock}, {"END;", inBlock}, {"  -- why\nCOMMIT", inBlock}, {"COMMIT", failedBlock},
	{"PREPARE TRANSACTION 'g'", inBlock}, {"INSERT INTO t VALUES (1); PREPARE TRANSACTION 'g'", idle},
	{"COMMIT AND CHAIN", inBlock}, {"COMMIT AND CHAIN", failedBlock},
	{"SAVEPOINT s2; COMMIT", inBlock}, {"/* a */ COMMIT /* b */; /* c */ END", inBlock},
	{"INSERT INTO t VALUES (1); BEGIN; INSERT INTO t VALUES (2); ROLLBACK", idle},
	{"INSERT INTO t VALUES (1); COMMIT; INSERT INTO t VALUES (2); SELECT 1/0", idle},
	{"BEGIN; INSERT INTO t VALUES (1); COMMIT AND CHAIN; INSERT INTO t VALUES (2)", idle},
	{"BEGIN; UPDATE t SET x = 1; END;", idle},
	{"ROLLBACK; INSERT INTO t VALUES (1)", failedBlock},
	{"ROLLBACK TO s; INSERT INTO t VALUES (1); COMMIT", failedBlock},
	{"SELECT 'COMMIT'; INSERT INTO t VALUES (1); COMMIT", inBlock},
	{"INSERT INTO t VALUES (1); VACUUM t", idle},
	{`INSERT INTO t SELECT length('a\'); COMMIT; --'`, inBlock},
	{`INSERT INTO t SELECT length(E'a\'; COMMIT; --')`, inBlock},
	{"CREATE FUNCTION f() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT 1; END; COMMIT", inBlock},
}

// testPlans runs plans of hand-picked strings with a passing and with a
// failing check.
func (s *server) testPlans(t *testing.T) {
	conn := connectServer(t, s.pg)
	for _, tt := range serverPlanTests {
		t.Run(tt.start.String()+"/"+tt.sql, func(t *testing.T) {
			s.checkPlan(t, conn, tt.sql, tt.start)
		})
	}
}

// testRandomPlans does the same for random strings made of fragments that
// control transactions, write, fail, or only look like transaction control.
func (s *server) testRandomPlans(t *testing.T) {
	fragments := []string{
		"INSERT INTO t VALUES (1)", "SELECT ins()", "UPDATE t SET x = x + 1",
		"WITH w AS (INSERT INTO t VALUES (2) RETURNING x) SELECT * FROM w",
		"BEGIN", "START TRANSACTION ISOLATION LEVEL REPEATABLE READ", "COMMIT", "END", "/* c */ commit -- x\n",
		"ROLLBACK", "ABORT", "COMMIT AND CHAIN", "ROLLBACK AND CHAIN", "PREPARE TRANSACTION 'g'",
		"SAVEPOINT s", "RELEASE s", "ROLLBACK TO s", "SELECT 1", "SELECT 1/0", "SELECT 'COMMIT; END'",
		"CALL p()", "DO $$BEGIN INSERT INTO t VALUES (3); COMMIT; END$$", "DO $$BEGIN INSERT INTO t VALUES (4); END$$",
		"SET LOCAL work_mem = '1MB'", `SELECT 'a\'; INSERT INTO t VALUES (5); --'`, `SELECT E'\'; COMMIT; --'`,
		"SELECT $$; COMMIT; $$", "VACUUM t",
	}
	separators := []string{"; ", ";", ";\n-- sep\n", " ;/* s */", ";;"}
	rng := rand.New(rand.NewPCG(15, 17))
	conn := connectServer(t, s.pg)
	n := 250
	if testing.Short() {
		n = 50
	}
	for i := 0; i < n; i++ {
		var b strings.Builder
		for j := 0; j < 1+rng.IntN(5); j++ {
			if j > 0 {
				b.WriteString(separators[rng.IntN(len(separators))])
			}
			b.WriteString(fragments[rng.IntN(len(fragments))])
		}
		sql := b.String()
		st := start(rng.IntN(3))
		s.checkPlan(t, conn, sql, st)
	}
}

// checkPlan runs the plan of sql from state st twice. With a passing check,
// the server must return one result per entry of Ours (fewer only after an
// error), checks where Ours says, and end in the block state the plan
// predicts. With a check that fails whenever the transaction wrote, no row may
// ever commit: this is the fencing guarantee, for this string.
func (s *server) checkPlan(t *testing.T, conn *pgconn.PgConn, sql string, st start) {
	t.Helper()
	inBlk, failed := st.args()
	p, err := sqltx.PlanQuery(sql, inBlk, failed, serverCheck)
	if errors.Is(err, sqltx.ErrNeedsOwnTransaction) {
		return // refused by the proxy (or run alone when SafeWithoutCheck)
	}
	if err != nil {
		t.Fatalf("PlanQuery(%q, %v): %v", sql, st, err)
	}
	var outcomes [2]outcome
	for i, stale := range []bool{false, true} {
		s.setStale(t, stale)
		s.enter(t, conn, st)
		o := run(t, conn, p.Text)
		outcomes[i] = o
		if len(p.Ours) == 0 {
			// An empty query: one EmptyQueryResponse, no statement.
			if o.err != nil || len(o.results) != 1 || o.tags[0] != "" || o.status != conn.TxStatus() {
				t.Fatalf("%v, %q: empty query gave %v %v", st, sql, o.tags, o.err)
			}
			s.reset(t, conn)
			continue
		}
		for j := range o.results {
			isCheck := len(o.results[j]) == 1 && len(o.results[j][0]) == 1 && o.results[j][0][0] == "fenceproxy-check"
			if j >= len(p.Ours) || p.Ours[j] != isCheck {
				t.Fatalf("%v, %q: result %d (%s %v) does not match Ours %v\nplan %q", st, sql, j, o.tags[j], o.results[j], p.Ours, p.Text)
			}
		}
		if o.err == nil {
			if len(o.results) != len(p.Ours) {
				t.Fatalf("%v, %q: %d results, Ours %v\nplan %q", st, sql, len(o.results), p.Ours, p.Text)
			}
			if (o.status != 'I') != p.EndsInBlock {
				t.Fatalf("%v, %q: status %c, EndsInBlock %v\nplan %q", st, sql, o.status, p.EndsInBlock, p.Text)
			}
		}
		rows := s.reset(t, conn)
		if stale && len(rows) > 0 {
			t.Fatalf("%v, %q: rows %v committed under a stale token (error %v)\nplan %q", st, sql, rows, o.err, p.Text)
		}
		if stale && o.err != nil && o.err.Code == "ZF001" && !slices.Contains(p.Ours, true) {
			t.Fatalf("%v, %q: check error without a check", st, sql)
		}
	}
	// A failing check never fails a transaction that wrote nothing: the
	// same string, when none of its statements write (and the start state
	// did not either), behaves the same under both checks.
	if st != inBlock && !writes(sql) && outcomes[0].code() != outcomes[1].code() {
		t.Fatalf("%v, %q: read-only string: error %q with a passing check, %q with a failing one\nplan %q",
			st, sql, outcomes[0].code(), outcomes[1].code(), p.Text)
	}
}

// writes is true for the fragments of these tests that write.
func writes(sql string) bool {
	for _, w := range []string{"INSERT", "UPDATE", "ins()", "CALL"} {
		if strings.Contains(sql, w) {
			return true
		}
	}
	return false
}

// testCopy: COPY FROM STDIN in a string with an appended check. The server
// takes the data, then runs the check in the same implicit transaction.
func (s *server) testCopy(t *testing.T) {
	conn := connectServer(t, s.pg)
	p, err := sqltx.PlanQuery("COPY t FROM STDIN", false, false, serverCheck)
	if err != nil || p.Checks != 1 {
		t.Fatalf("PlanQuery: %+v, %v", p, err)
	}
	for _, stale := range []bool{false, true} {
		s.setStale(t, stale)
		_, err := conn.CopyFrom(t.Context(), strings.NewReader("1\n2\n"), p.Text)
		rows := s.reset(t, conn)
		switch {
		case !stale && (err != nil || !slices.Equal(rows, []string{"1", "2"})):
			t.Errorf("COPY with a passing check: %v, rows %v", err, rows)
		case stale && (err == nil || len(rows) != 0):
			t.Errorf("COPY with a failing check: %v, rows %v", err, rows)
		}
	}
	s.setStale(t, false)
}

// testNoTxBlock asks PostgreSQL whether the statements classified NoTxBlock or
// Maintenance are refused inside a block, and whether some Other ones are not.
func (s *server) testNoTxBlock(t *testing.T) {
	conn := connectServer(t, s.pg)
	tests := []struct {
		sql  string
		kind sqltx.Kind
		// codes PostgreSQL may answer inside a block: 25001
		// (active_sql_transaction) for the refused ones.
		codes []string
		// over: refused only for some options or states (so may run, and
		// commit, in a multi-statement string).
		over bool
	}{
		{"VACUUM", sqltx.Maintenance, []string{"25001"}, false},
		{"VACUUM (ANALYZE) t", sqltx.Maintenance, []string{"25001"}, false},
		{"DISCARD ALL", sqltx.Maintenance, []string{"25001"}, false},
		{"COMMIT PREPARED 'nope'", sqltx.CommitPrepared, []string{"25001"}, false},
		{"ROLLBACK PREPARED 'nope'", sqltx.RollbackPrepared, []string{"25001"}, false},
		{"CREATE DATABASE d", sqltx.NoTxBlock, []string{"25001"}, false},
		{"DROP DATABASE IF EXISTS d", sqltx.NoTxBlock, []string{"25001"}, false},
		{"ALTER DATABASE postgres SET TABLESPACE pg_default", sqltx.NoTxBlock, []string{"25001"}, false},
		{"CREATE TABLESPACE ts LOCATION '/nowhere'", sqltx.NoTxBlock, []string{"25001"}, false},
		{"DROP TABLESPACE ts", sqltx.NoTxBlock, []string{"25001"}, false},
		{"ALTER SYSTEM SET work_mem = '1MB'", sqltx.NoTxBlock, []string{"25001"}, false},
		{"CREATE INDEX CONCURRENTLY i2 ON t (x)", sqltx.NoTxBlock, []string{"25001"}, false},
		{"DROP INDEX CONCURRENTLY i", sqltx.NoTxBlock, []string{"25001"}, false},
		{"REINDEX TABLE CONCURRENTLY t", sqltx.NoTxBlock, []string{"25001"}, false},
		{"REINDEX (CONCURRENTLY) INDEX i", sqltx.NoTxBlock, []string{"25001"}, false},
		{"REINDEX SCHEMA public", sqltx.NoTxBlock, []string{"25001"}, false},
		{"REINDEX DATABASE postgres", sqltx.NoTxBlock, []string{"25001"}, false},
		{"REINDEX SYSTEM postgres", sqltx.NoTxBlock, []string{"25001"}, false},
		{"CLUSTER", sqltx.NoTxBlock, []string{"25001"}, false},
		{"ALTER TABLE pt DETACH PARTITION pt1 CONCURRENTLY", sqltx.NoTxBlock, []string{"25001"}, false},
		{"CREATE SUBSCRIPTION sub CONNECTION 'dbname=nope' PUBLICATION pub", sqltx.NoTxBlock, []string{"25001"}, false},
		// Refused only for some options or states: over-approximated.
		{"CREATE SUBSCRIPTION sub CONNECTION 'dbname=nope' PUBLICATION pub WITH (connect = false)", sqltx.NoTxBlock, []string{"25001", ""}, true},
		{"ALTER SUBSCRIPTION sub REFRESH PUBLICATION", sqltx.NoTxBlock, []string{"25001", "42704", "55000"}, true},
		{"DROP SUBSCRIPTION IF EXISTS sub", sqltx.NoTxBlock, []string{"25001", ""}, true},
		// Accepted in a block.
		{"ANALYZE t", sqltx.Other, []string{""}, false},
		{"DISCARD PLANS", sqltx.Other, []string{""}, false},
		{"CREATE INDEX i3 ON t (x)", sqltx.Other, []string{""}, false},
		{"DROP INDEX i", sqltx.Other, []string{""}, false},
		{"REINDEX TABLE t", sqltx.Other, []string{""}, false},
		{"CLUSTER t USING i", sqltx.Other, []string{""}, false},
		{"ALTER TABLE pt DETACH PARTITION pt1", sqltx.Other, []string{""}, false},
		{"ALTER DATABASE postgres SET work_mem = '1MB'", sqltx.Other, []string{""}, false},
		{"LOCK TABLE t", sqltx.Other, []string{""}, false},
	}
	for _, tt := range tests {
		t.Run(tt.sql, func(t *testing.T) {
			if k, err := sqltx.Classify(tt.sql); err != nil || k != tt.kind {
				t.Fatalf("Classify(%q) = %v, %v; want %v", tt.sql, k, err, tt.kind)
			}
			s.exec(t, conn, "BEGIN")
			o := run(t, conn, tt.sql)
			s.exec(t, conn, "ROLLBACK")
			if !slices.Contains(tt.codes, o.code()) {
				t.Errorf("%q in a block: error %v, want one of %q", tt.sql, o.err, tt.codes)
			}
			// In a multi-statement string (as with an appended check) the
			// refused ones fail the same way.
			if tt.codes[0] == "25001" && !tt.over {
				o := run(t, conn, "SELECT 1; "+tt.sql)
				if o.code() != "25001" {
					t.Errorf("%q after another statement: error %v, want 25001", tt.sql, o.err)
				}
			}
		})
	}
}

// testLexerSettings shows why standard_conforming_strings and client_encoding
// matter, and checks ClientEncodingSafe against the server's encodings.
func (s *server) testLexerSettings(t *testing.T) {
	t.Run("standard_conforming_strings off", func(t *testing.T) {
		conn := connectServer(t, s.pg)
		sql := `SELECT 'a\'; SELECT 2; --'`
		stmts, err := sqltx.Split(sql)
		if err != nil || len(stmts) != 2 {
			t.Fatalf("Split: %v, %v", stmts, err)
		}
		if o := run(t, conn, sql); len(o.results) != 2 {
			t.Fatalf("with standard_conforming_strings on: %d results, want 2", len(o.results))
		}
		s.exec(t, conn, "SET standard_conforming_strings = off")
		if o := run(t, conn, sql); len(o.results) != 1 {
			t.Fatalf("with standard_conforming_strings off: %d results, want 1 (the proxy would see 2)", len(o.results))
		}

		// The other way round: a COMMIT the proxy cannot see. Its plan,
		// inside a block, has no check, yet the server commits.
		hidden := `SELECT 'a\' || ' ; COMMIT; --'`
		if sensitive, err := sqltx.StdStringsSensitive(hidden); err != nil || !sensitive {
			t.Fatalf("StdStringsSensitive(%q) = %v, %v", hidden, sensitive, err)
		}
		p, err := sqltx.PlanQuery(hidden, true, false, serverCheck)
		if err != nil || p.Checks != 0 || len(p.Ours) != 1 {
			t.Fatalf("PlanQuery(%q) = %s, %v", hidden, fmtPlan(p), err)
		}
		s.exec(t, conn, "BEGIN; INSERT INTO t VALUES (1)")
		if o := run(t, conn, p.Text); o.status != 'I' || len(o.tags) != 2 || o.tags[1] != "COMMIT" {
			t.Fatalf("with standard_conforming_strings off: %v, status %c; want a COMMIT", o.tags, o.status)
		}
		if rows := s.reset(t, conn); !slices.Equal(rows, []string{"1"}) {
			t.Fatalf("rows %v, want the row committed past the proxy", rows)
		}
	})
	t.Run("client_encoding SJIS", func(t *testing.T) {
		conn := connectServer(t, s.pg)
		s.exec(t, conn, "SET client_encoding = 'SJIS'")
		// 0x83 0x5C is one SJIS character (katakana SO); its second byte is
		// a backslash to a lexer that reads bytes.
		sql := "SELECT E'\x83\x5C'; SELECT 2"
		if o := run(t, conn, sql); o.err != nil || len(o.results) != 2 {
			t.Fatalf("server: %d results, %v; want 2", len(o.results), o.err)
		}
		if stmts, err := sqltx.Split(sql); err == nil && len(stmts) == 2 {
			t.Fatalf("the proxy's lexer agrees with the server in SJIS: the encoding test is moot")
		}
	})
	t.Run("client_encoding LATIN1", func(t *testing.T) {
		// A safe single-byte encoding: the proxy sees bytes that are not
		// UTF-8, the server converts them, and both split alike.
		conn := connectServer(t, s.pg)
		s.exec(t, conn, "SET client_encoding = 'LATIN1'")
		sql := "SET application_name = 'caf\xe9;'; INSERT INTO t SELECT length('\xe9\xe8'); COMMIT"
		p, err := sqltx.PlanQuery(sql, true, false, serverCheck)
		if err != nil {
			t.Fatal(err)
		}
		s.exec(t, conn, "BEGIN")
		if o := run(t, conn, p.Text); o.err != nil || len(o.results) != len(p.Ours) {
			t.Fatalf("plan %q: %d results, %v; Ours %v", p.Text, len(o.results), o.err, p.Ours)
		}
		if rows := s.reset(t, conn); !slices.Equal(rows, []string{"2"}) {
			t.Fatalf("rows %v, want [2]", rows)
		}
	})
	t.Run("resets return to the session's start value", func(t *testing.T) {
		// RESET, RESET ALL, SET ... TO DEFAULT and DISCARD ALL go back to
		// the value the session started with, even after ALTER ROLE ... SET,
		// which only applies to new sessions: so they are not SetStdStrings.
		conn := connectServer(t, s.pg)
		s.exec(t, s.admin, "ALTER ROLE postgres SET standard_conforming_strings = off")
		t.Cleanup(func() {
			_, _ = s.admin.Exec(context.Background(), "ALTER ROLE postgres RESET standard_conforming_strings").ReadAll()
		})
		for _, reset := range []string{"RESET ALL", "RESET standard_conforming_strings",
			"SET standard_conforming_strings TO DEFAULT", "DISCARD ALL"} {
			s.exec(t, conn, "SET standard_conforming_strings = off")
			if conn.ParameterStatus("standard_conforming_strings") != "off" {
				t.Fatalf("ParameterStatus after SET off: %q", conn.ParameterStatus("standard_conforming_strings"))
			}
			if k, err := sqltx.Classify(reset); err != nil || k.OwnTransaction() && !k.SafeWithoutCheck() || k == sqltx.SetStdStrings {
				t.Fatalf("Classify(%q) = %v, %v", reset, k, err)
			}
			s.exec(t, conn, reset)
			if got := conn.ParameterStatus("standard_conforming_strings"); got != "on" {
				t.Errorf("%s: standard_conforming_strings %q, want on", reset, got)
			}
		}
		// Neither does SET ROLE or SET SESSION AUTHORIZATION apply a role's
		// settings.
		s.exec(t, s.admin, "CREATE ROLE r_off; ALTER ROLE r_off SET standard_conforming_strings = off")
		for _, set := range []string{"SET ROLE r_off", "SET SESSION AUTHORIZATION r_off"} {
			s.exec(t, conn, set+"; RESET ALL")
			if got := conn.ParameterStatus("standard_conforming_strings"); got != "on" {
				t.Errorf("%s: standard_conforming_strings %q, want on", set, got)
			}
			s.exec(t, conn, "RESET SESSION AUTHORIZATION; RESET ROLE")
		}
		// A new session starts with the role's setting, and says so in its
		// startup ParameterStatus: that is where the proxy must look.
		if got := connectServer(t, s.pg).ParameterStatus("standard_conforming_strings"); got != "off" {
			t.Errorf("new session: standard_conforming_strings %q, want off", got)
		}
	})
	t.Run("ClientEncodingSafe", func(t *testing.T) {
		clientOnly := []string{"SJIS", "BIG5", "GBK", "UHC", "GB18030", "JOHAB", "SHIFT_JIS_2004"}
		o := run(t, s.admin, "SELECT pg_encoding_to_char(i) FROM generate_series(0, 63) i WHERE pg_encoding_to_char(i) <> ''")
		if len(o.results[0]) < 40 {
			t.Fatalf("only %d encodings", len(o.results[0]))
		}
		for _, row := range o.results[0] {
			name := row[0]
			if want := !slices.Contains(clientOnly, name); sqltx.ClientEncodingSafe(name) != want {
				t.Errorf("ClientEncodingSafe(%q) = %v, want %v", name, !want, want)
			}
			// Every alias the package accepts must name a server encoding.
			if !sqltx.ClientEncodingSafe(name) {
				continue
			}
			if o := run(t, s.admin, fmt.Sprintf("SET client_encoding = '%s'; RESET client_encoding", name)); o.err != nil &&
				o.err.Code != "0A000" { // conversion not supported is fine
				t.Errorf("SET client_encoding = %q: %v", name, o.err)
			}
		}
		// Every alias the package accepts names a server encoding.
		for _, alias := range sqltx.SafeEncodingNames() {
			o := run(t, s.admin, fmt.Sprintf("SELECT pg_encoding_to_char(pg_char_to_encoding('%s'))", alias))
			if name := o.results[0][0][0]; name == "" || slices.Contains(clientOnly, name) {
				t.Errorf("alias %q is encoding %q for PostgreSQL", alias, name)
			}
		}
	})
}
