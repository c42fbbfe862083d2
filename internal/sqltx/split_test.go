package sqltx_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/sqltx"
)

// stmt is a statement as a test expects it: its kind and its text from Start to
// End.
type stmt struct {
	kind sqltx.Kind
	text string
}

func (s stmt) String() string { return fmt.Sprintf("%v %q", s.kind, s.text) }

func got(sql string, stmts []sqltx.Statement) []stmt {
	out := make([]stmt, len(stmts))
	for i, s := range stmts {
		out[i] = stmt{s.Kind, sql[s.Start:s.End]}
	}
	return out
}

func one(k sqltx.Kind, text string) []stmt { return []stmt{{k, text}} }

// splitTests is shared by the Split, Cache, reference and fuzz-seed tests.
var splitTests = []struct {
	name string
	sql  string
	want []stmt
}{
	// Empty strings.
	{"empty", "", nil},
	{"blank", " \t\r\n\f\v ", nil},
	{"line comment only", "-- COMMIT", nil},
	{"block comment only", "/* COMMIT; */", nil},
	{"semicolons", ";;;", nil},
	{"semicolons and comments", " ; /* a */ ; -- b\n ;", nil},

	// Statement boundaries.
	{"one", "SELECT 1", one(sqltx.Other, "SELECT 1")},
	{"trailing semicolon", "SELECT 1;", one(sqltx.Other, "SELECT 1")},
	{"trailing blank", "SELECT 1 ;  \n", one(sqltx.Other, "SELECT 1 ")},
	{"leading comments", "  /* c */ -- d\n\tCOMMIT", one(sqltx.Commit, "COMMIT")},
	{"two", "SELECT 1;COMMIT", []stmt{{sqltx.Other, "SELECT 1"}, {sqltx.Commit, "COMMIT"}}},
	{"empty statements between", "SELECT 1;;; /*x*/ ; END;", []stmt{{sqltx.Other, "SELECT 1"}, {sqltx.Commit, "END"}}},
	{"comment before semicolon stays", "COMMIT /* why */;ROLLBACK -- bye",
		[]stmt{{sqltx.Commit, "COMMIT /* why */"}, {sqltx.Rollback, "ROLLBACK -- bye"}}},
	{"pgbench transaction", "BEGIN; UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = 1; END;",
		[]stmt{{sqltx.Begin, "BEGIN"}, {sqltx.Other, "UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = 1"}, {sqltx.Commit, "END"}}},

	// Text that looks like a COMMIT and is not one.
	{"string literal", "SELECT 'COMMIT; END;'", one(sqltx.Other, "SELECT 'COMMIT; END;'")},
	{"doubled quote", "SELECT 'it''s; COMMIT'", one(sqltx.Other, "SELECT 'it''s; COMMIT'")},
	{"line comment", "SELECT 1 -- ; COMMIT", one(sqltx.Other, "SELECT 1 -- ; COMMIT")},
	{"block comment", "SELECT /* ; COMMIT; */ 1", one(sqltx.Other, "SELECT /* ; COMMIT; */ 1")},
	{"nested block comment", "/* a /* b */ COMMIT; */ SELECT 1", one(sqltx.Other, "SELECT 1")},
	{"comment opener in string", "SELECT '/*'; COMMIT; SELECT '*/'",
		[]stmt{{sqltx.Other, "SELECT '/*'"}, {sqltx.Commit, "COMMIT"}, {sqltx.Other, "SELECT '*/'"}}},
	{"dollar quote", "SELECT $$; COMMIT; $$", one(sqltx.Other, "SELECT $$; COMMIT; $$")},
	{"tagged dollar quote", "SELECT $a$ $$; COMMIT; $$ $a$", one(sqltx.Other, "SELECT $a$ $$; COMMIT; $$ $a$")},
	{"quoted identifier", `SELECT 1 AS "commit; COMMIT"`, one(sqltx.Other, `SELECT 1 AS "commit; COMMIT"`)},
	{"identifier named commit", `CREATE TABLE "commit" ("end" int)`, one(sqltx.Other, `CREATE TABLE "commit" ("end" int)`)},
	{"E string with escaped quote", `SELECT E'\'; COMMIT; --'`, one(sqltx.Other, `SELECT E'\'; COMMIT; --'`)},
	// With standard_conforming_strings on (what the proxy enforces) a
	// backslash is an ordinary character in '...'.
	{"standard string ends at quote", `SELECT 'a\'; COMMIT; --'`,
		[]stmt{{sqltx.Other, `SELECT 'a\'`}, {sqltx.Commit, "COMMIT"}}},
	{"unicode string", `SELECT U&'d\0061t\+000061'; COMMIT`, []stmt{{sqltx.Other, `SELECT U&'d\0061t\+000061'`}, {sqltx.Commit, "COMMIT"}}},
	{"plpgsql body", "CREATE FUNCTION f() RETURNS void LANGUAGE plpgsql AS $$BEGIN COMMIT; END$$",
		one(sqltx.Other, "CREATE FUNCTION f() RETURNS void LANGUAGE plpgsql AS $$BEGIN COMMIT; END$$")},
	// A SQL-standard function body holds top-level-looking ';' and END:
	// only the grammar knows they belong to the CREATE FUNCTION.
	{"begin atomic body", "CREATE FUNCTION f() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT 1; SELECT 2; END; COMMIT",
		[]stmt{{sqltx.Other, "CREATE FUNCTION f() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT 1; SELECT 2; END"}, {sqltx.Commit, "COMMIT"}}},
	{"non-ASCII", "SELECT 'é;ü' AS \"ß\"; COMMIT", []stmt{{sqltx.Other, "SELECT 'é;ü' AS \"ß\""}, {sqltx.Commit, "COMMIT"}}},
	// Bytes that are not UTF-8 (a LATIN1 client, say) lex like any other
	// byte from 0x80 up, in utility statements too.
	{"latin1 bytes", "SET application_name = 'caf\xe9'; COMMIT", []stmt{{sqltx.Other, "SET application_name = 'caf\xe9'"}, {sqltx.Commit, "COMMIT"}}},
	{"latin1 dollar tag", "DO $\xe9$BEGIN COMMIT; END$\xe9$; END", []stmt{{sqltx.Do, "DO $\xe9$BEGIN COMMIT; END$\xe9$"}, {sqltx.Commit, "END"}}},
	{"latin1 identifier", "CREATE TABLE \xe9t\xe9 (x int); COMMIT", []stmt{{sqltx.Other, "CREATE TABLE \xe9t\xe9 (x int)"}, {sqltx.Commit, "COMMIT"}}},

	// Transaction control in its spellings.
	{"commit lower", "commit", one(sqltx.Commit, "commit")},
	{"commit mixed", "CoMmIt WoRk", one(sqltx.Commit, "CoMmIt WoRk")},
	{"commit transaction", "COMMIT TRANSACTION AND NO CHAIN", one(sqltx.Commit, "COMMIT TRANSACTION AND NO CHAIN")},
	{"end", "END", one(sqltx.Commit, "END")},
	{"end work", "end work", one(sqltx.Commit, "end work")},
	{"commit and chain", "COMMIT AND CHAIN", one(sqltx.CommitChain, "COMMIT AND CHAIN")},
	{"end and chain", "END AND CHAIN", one(sqltx.CommitChain, "END AND CHAIN")},
	{"rollback", "ROLLBACK", one(sqltx.Rollback, "ROLLBACK")},
	{"abort", "ABORT", one(sqltx.Rollback, "ABORT")},
	{"rollback and chain", "ROLLBACK WORK AND CHAIN", one(sqltx.RollbackChain, "ROLLBACK WORK AND CHAIN")},
	{"abort and chain", "abort and chain", one(sqltx.RollbackChain, "abort and chain")},
	{"begin", "BEGIN", one(sqltx.Begin, "BEGIN")},
	{"begin modes", "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY", one(sqltx.Begin, "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")},
	{"start transaction", "START TRANSACTION ISOLATION LEVEL SERIALIZABLE", one(sqltx.Begin, "START TRANSACTION ISOLATION LEVEL SERIALIZABLE")},
	{"prepare transaction", "PREPARE TRANSACTION 'g1'", one(sqltx.PrepareTransaction, "PREPARE TRANSACTION 'g1'")},
	{"commit prepared", "COMMIT PREPARED 'g1'", one(sqltx.CommitPrepared, "COMMIT PREPARED 'g1'")},
	{"rollback prepared", "ROLLBACK PREPARED 'g1'", one(sqltx.RollbackPrepared, "ROLLBACK PREPARED 'g1'")},
	{"savepoint", "SAVEPOINT s", one(sqltx.Savepoint, "SAVEPOINT s")},
	{"release", "RELEASE s", one(sqltx.Release, "RELEASE s")},
	{"release savepoint", "RELEASE SAVEPOINT s", one(sqltx.Release, "RELEASE SAVEPOINT s")},
	{"rollback to", "ROLLBACK TO s", one(sqltx.RollbackTo, "ROLLBACK TO s")},
	{"rollback transaction to savepoint", "ROLLBACK TRANSACTION TO SAVEPOINT s", one(sqltx.RollbackTo, "ROLLBACK TRANSACTION TO SAVEPOINT s")},

	// Statements that are not transaction control.
	{"prepare statement", "PREPARE q AS SELECT 1", one(sqltx.Other, "PREPARE q AS SELECT 1")},
	{"prepare insert", "PREPARE q (int) AS INSERT INTO t VALUES ($1)", one(sqltx.Other, "PREPARE q (int) AS INSERT INTO t VALUES ($1)")},
	{"execute", "EXECUTE q", one(sqltx.Other, "EXECUTE q")},
	{"explain", "EXPLAIN ANALYZE INSERT INTO t VALUES (1)", one(sqltx.Other, "EXPLAIN ANALYZE INSERT INTO t VALUES (1)")},
	{"writable cte", "WITH x AS (INSERT INTO t VALUES (1) RETURNING *) SELECT * FROM x",
		one(sqltx.Other, "WITH x AS (INSERT INTO t VALUES (1) RETURNING *) SELECT * FROM x")},
	{"copy from stdin", "COPY t FROM STDIN", one(sqltx.CopyIn, "COPY t FROM STDIN")},
	{"copy from file", "COPY t FROM '/tmp/x'", one(sqltx.Other, "COPY t FROM '/tmp/x'")},
	{"copy to stdout", "COPY t TO STDOUT", one(sqltx.Other, "COPY t TO STDOUT")},
	{"copy to", "COPY (SELECT 1) TO STDOUT", one(sqltx.Other, "COPY (SELECT 1) TO STDOUT")},
	{"merge", "MERGE INTO t USING s ON t.x = s.x WHEN MATCHED THEN DELETE", one(sqltx.Other, "MERGE INTO t USING s ON t.x = s.x WHEN MATCHED THEN DELETE")},
	{"lock", "LOCK TABLE t", one(sqltx.Other, "LOCK TABLE t")},
	{"set transaction", "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE", one(sqltx.Other, "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")},
	{"set other", "SET search_path = app, public", one(sqltx.Other, "SET search_path = app, public")},
	{"show", "SHOW standard_conforming_strings", one(sqltx.Other, "SHOW standard_conforming_strings")},
	{"set_config is invisible", "SELECT set_config('standard_conforming_strings', 'off', false)",
		one(sqltx.Other, "SELECT set_config('standard_conforming_strings', 'off', false)")},

	// CALL and DO.
	{"call", "CALL p(1, 'x')", one(sqltx.Call, "CALL p(1, 'x')")},
	{"do", "DO $$BEGIN COMMIT; END$$", one(sqltx.Do, "DO $$BEGIN COMMIT; END$$")},
	{"do language", "DO LANGUAGE plpgsql 'BEGIN NULL; END'", one(sqltx.Do, "DO LANGUAGE plpgsql 'BEGIN NULL; END'")},

	// Statements that cannot run in a transaction block.
	{"vacuum", "VACUUM", one(sqltx.Maintenance, "VACUUM")},
	{"vacuum full", "VACUUM FULL t", one(sqltx.Maintenance, "VACUUM FULL t")},
	{"vacuum options", "VACUUM (ANALYZE, VERBOSE) t", one(sqltx.Maintenance, "VACUUM (ANALYZE, VERBOSE) t")},
	{"vacuum analyze", "VACUUM ANALYZE", one(sqltx.Maintenance, "VACUUM ANALYZE")},
	{"analyze", "ANALYZE t", one(sqltx.Other, "ANALYZE t")},
	{"discard all", "DISCARD ALL", one(sqltx.Maintenance, "DISCARD ALL")},
	{"discard plans", "DISCARD PLANS", one(sqltx.Other, "DISCARD PLANS")},
	{"discard temp", "DISCARD TEMP", one(sqltx.Other, "DISCARD TEMP")},
	{"create database", "CREATE DATABASE d", one(sqltx.NoTxBlock, "CREATE DATABASE d")},
	{"drop database", "DROP DATABASE IF EXISTS d", one(sqltx.NoTxBlock, "DROP DATABASE IF EXISTS d")},
	{"alter database tablespace", "ALTER DATABASE d SET TABLESPACE pg_default", one(sqltx.NoTxBlock, "ALTER DATABASE d SET TABLESPACE pg_default")},
	{"alter database set", "ALTER DATABASE d SET work_mem = '1MB'", one(sqltx.Other, "ALTER DATABASE d SET work_mem = '1MB'")},
	{"alter database option", "ALTER DATABASE d CONNECTION LIMIT 5", one(sqltx.Other, "ALTER DATABASE d CONNECTION LIMIT 5")},
	{"create tablespace", "CREATE TABLESPACE ts LOCATION '/nowhere'", one(sqltx.NoTxBlock, "CREATE TABLESPACE ts LOCATION '/nowhere'")},
	{"drop tablespace", "DROP TABLESPACE ts", one(sqltx.NoTxBlock, "DROP TABLESPACE ts")},
	{"alter system", "ALTER SYSTEM SET work_mem = '1MB'", one(sqltx.NoTxBlock, "ALTER SYSTEM SET work_mem = '1MB'")},
	{"alter system reset", "ALTER SYSTEM RESET ALL", one(sqltx.NoTxBlock, "ALTER SYSTEM RESET ALL")},
	{"create index concurrently", "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS i ON t (x)", one(sqltx.NoTxBlock, "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS i ON t (x)")},
	{"create index", "CREATE INDEX i ON t (x)", one(sqltx.Other, "CREATE INDEX i ON t (x)")},
	{"drop index concurrently", "DROP INDEX CONCURRENTLY i", one(sqltx.NoTxBlock, "DROP INDEX CONCURRENTLY i")},
	{"drop index", "DROP INDEX i", one(sqltx.Other, "DROP INDEX i")},
	{"reindex concurrently", "REINDEX TABLE CONCURRENTLY t", one(sqltx.NoTxBlock, "REINDEX TABLE CONCURRENTLY t")},
	{"reindex concurrently option", "REINDEX (CONCURRENTLY) INDEX i", one(sqltx.NoTxBlock, "REINDEX (CONCURRENTLY) INDEX i")},
	{"reindex table", "REINDEX TABLE t", one(sqltx.Other, "REINDEX TABLE t")},
	{"reindex schema", "REINDEX SCHEMA public", one(sqltx.NoTxBlock, "REINDEX SCHEMA public")},
	{"reindex database", "REINDEX DATABASE postgres", one(sqltx.NoTxBlock, "REINDEX DATABASE postgres")},
	{"reindex system", "REINDEX SYSTEM postgres", one(sqltx.NoTxBlock, "REINDEX SYSTEM postgres")},
	{"cluster all", "CLUSTER", one(sqltx.NoTxBlock, "CLUSTER")},
	{"cluster table", "CLUSTER t USING i", one(sqltx.Other, "CLUSTER t USING i")},
	{"detach concurrently", "ALTER TABLE t DETACH PARTITION p CONCURRENTLY", one(sqltx.NoTxBlock, "ALTER TABLE t DETACH PARTITION p CONCURRENTLY")},
	{"detach", "ALTER TABLE t DETACH PARTITION p", one(sqltx.Other, "ALTER TABLE t DETACH PARTITION p")},
	{"create subscription", "CREATE SUBSCRIPTION s CONNECTION 'dbname=x' PUBLICATION p", one(sqltx.NoTxBlock, "CREATE SUBSCRIPTION s CONNECTION 'dbname=x' PUBLICATION p")},
	{"alter subscription", "ALTER SUBSCRIPTION s REFRESH PUBLICATION", one(sqltx.NoTxBlock, "ALTER SUBSCRIPTION s REFRESH PUBLICATION")},
	{"drop subscription", "DROP SUBSCRIPTION s", one(sqltx.NoTxBlock, "DROP SUBSCRIPTION s")},

	// Settings that change lexing.
	{"scs off", "SET standard_conforming_strings = off", one(sqltx.SetStdStrings, "SET standard_conforming_strings = off")},
	{"scs false", "SET standard_conforming_strings TO false", one(sqltx.SetStdStrings, "SET standard_conforming_strings TO false")},
	{"scs 0", "SET standard_conforming_strings = 0", one(sqltx.SetStdStrings, "SET standard_conforming_strings = 0")},
	{"scs 'of'", "SET standard_conforming_strings = 'of'", one(sqltx.SetStdStrings, "SET standard_conforming_strings = 'of'")},
	{"scs session", "SET SESSION standard_conforming_strings = 'off'", one(sqltx.SetStdStrings, "SET SESSION standard_conforming_strings = 'off'")},
	{"scs local", "SET LOCAL standard_conforming_strings TO no", one(sqltx.SetStdStrings, "SET LOCAL standard_conforming_strings TO no")},
	{"scs quoted name", `SET "Standard_Conforming_Strings" = off`, one(sqltx.SetStdStrings, `SET "Standard_Conforming_Strings" = off`)},
	{"scs from current", "SET standard_conforming_strings FROM CURRENT", one(sqltx.SetStdStrings, "SET standard_conforming_strings FROM CURRENT")},
	{"scs on", "SET standard_conforming_strings = on", one(sqltx.Other, "SET standard_conforming_strings = on")},
	{"scs true", "SET standard_conforming_strings TO TRUE", one(sqltx.Other, "SET standard_conforming_strings TO TRUE")},
	{"scs 1", "SET standard_conforming_strings = 1", one(sqltx.Other, "SET standard_conforming_strings = 1")},
	{"scs 'Yes'", "SET standard_conforming_strings = 'Yes'", one(sqltx.Other, "SET standard_conforming_strings = 'Yes'")},
	{"scs default", "SET standard_conforming_strings TO DEFAULT", one(sqltx.Other, "SET standard_conforming_strings TO DEFAULT")},
	{"scs reset", "RESET standard_conforming_strings", one(sqltx.Other, "RESET standard_conforming_strings")},
	{"reset all", "RESET ALL", one(sqltx.Other, "RESET ALL")},
	{"client encoding sjis", "SET client_encoding = 'SJIS'", one(sqltx.SetClientEncoding, "SET client_encoding = 'SJIS'")},
	{"names big5", "SET NAMES 'big5'", one(sqltx.SetClientEncoding, "SET NAMES 'big5'")},
	{"client encoding local gbk", "SET LOCAL client_encoding TO gbk", one(sqltx.SetClientEncoding, "SET LOCAL client_encoding TO gbk")},
	{"client encoding unknown", "SET client_encoding = 'klingon'", one(sqltx.SetClientEncoding, "SET client_encoding = 'klingon'")},
	{"client encoding utf8", "SET client_encoding = 'UTF8'", one(sqltx.Other, "SET client_encoding = 'UTF8'")},
	{"names utf-8", "SET NAMES 'utf-8'", one(sqltx.Other, "SET NAMES 'utf-8'")},
	{"client encoding latin1", "SET client_encoding TO latin1", one(sqltx.Other, "SET client_encoding TO latin1")},
	{"client encoding default", "SET client_encoding TO DEFAULT", one(sqltx.Other, "SET client_encoding TO DEFAULT")},
	{"client encoding reset", "RESET client_encoding", one(sqltx.Other, "RESET client_encoding")},
}

func TestSplit(t *testing.T) {
	for _, tt := range splitTests {
		t.Run(tt.name, func(t *testing.T) {
			stmts, err := sqltx.Split(tt.sql)
			if err != nil {
				t.Fatalf("Split(%q): %v", tt.sql, err)
			}
			if g := got(tt.sql, stmts); fmt.Sprint(g) != fmt.Sprint(tt.want) {
				t.Errorf("Split(%q)\n got %v\nwant %v", tt.sql, g, tt.want)
			}
			ref, err := sqltx.ReferenceSplit(tt.sql)
			if err != nil {
				t.Fatalf("referenceSplit(%q): %v", tt.sql, err)
			}
			if fmt.Sprint(ref) != fmt.Sprint(stmts) {
				t.Errorf("Split(%q) = %v, reference %v", tt.sql, stmts, ref)
			}
		})
	}
}

func TestSplitErrors(t *testing.T) {
	tests := []struct {
		name string
		sql  string
		want error // nil: a *SyntaxError
	}{
		{"typo", "SELEC 1", nil},
		{"unterminated string", "SELECT 'abc", nil},
		{"unterminated comment", "SELECT 1 /* abc", nil},
		{"unterminated dollar quote", "SELECT $$abc", nil},
		{"unterminated identifier", `SELECT "abc`, nil},
		{"second statement bad", "INSERT INTO t VALUES (1); COMMI", nil},
		{"commit prepared without gid", "COMMIT PREPARED", nil},
		{"lone backslash", `SELECT 1 \`, nil},
		{"trailing junk after number", "SELECT 1abc", nil}, // accepted by PostgreSQL 15, refused by 17's grammar
		{"NUL", "SELECT 1;\x00COMMIT", sqltx.ErrNUL},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			stmts, err := sqltx.Split(tt.sql)
			if err == nil {
				t.Fatalf("Split(%q) = %v, want an error", tt.sql, stmts)
			}
			if tt.want != nil {
				if !errors.Is(err, tt.want) {
					t.Fatalf("Split(%q): %v, want %v", tt.sql, err, tt.want)
				}
				return
			}
			var se *sqltx.SyntaxError
			if !errors.As(err, &se) || se.SQLState() != "42601" || se.Message == "" {
				t.Fatalf("Split(%q): %v (%T), want a *SyntaxError", tt.sql, err, err)
			}
		})
	}
}

func TestClassify(t *testing.T) {
	tests := []struct {
		sql     string
		want    sqltx.Kind
		wantErr error
	}{
		{"", sqltx.Other, nil},
		{" -- nothing", sqltx.Other, nil},
		{"SELECT abalance FROM pgbench_accounts WHERE aid = $1", sqltx.Other, nil},
		{"COMMIT;", sqltx.Commit, nil},
		{"/* c */ end and chain", sqltx.CommitChain, nil},
		{"PREPARE TRANSACTION 'x'", sqltx.PrepareTransaction, nil},
		{"CALL p($1)", sqltx.Call, nil},
		{"VACUUM t", sqltx.Maintenance, nil},
		{"CREATE INDEX CONCURRENTLY i ON t (x)", sqltx.NoTxBlock, nil},
		{"SET standard_conforming_strings = off", sqltx.SetStdStrings, nil},
		{"SELECT 1; SELECT 2", sqltx.Other, sqltx.ErrMultipleStatements},
		{"SELECT 'x;y'; COMMIT", sqltx.Other, sqltx.ErrMultipleStatements},
		{"SELECT \x00", sqltx.Other, sqltx.ErrNUL},
	}
	for _, tt := range tests {
		t.Run(tt.sql, func(t *testing.T) {
			k, err := sqltx.Classify(tt.sql)
			if !errors.Is(err, tt.wantErr) || k != tt.want {
				t.Errorf("Classify(%q) = %v, %v; want %v, %v", tt.sql, k, err, tt.want, tt.wantErr)
			}
		})
	}
	var se *sqltx.SyntaxError
	if _, err := sqltx.Classify("COMMIT PREPARED"); !errors.As(err, &se) {
		t.Errorf("Classify(COMMIT PREPARED): %v, want a *SyntaxError", err)
	}
	// Classify agrees with Split on every one-statement case.
	for _, tt := range splitTests {
		if len(tt.want) != 1 {
			continue
		}
		if k, err := sqltx.Classify(tt.sql); err != nil || k != tt.want[0].kind {
			t.Errorf("Classify(%q) = %v, %v; want %v", tt.sql, k, err, tt.want[0].kind)
		}
	}
}

func TestSplitLong(t *testing.T) {
	// Many statements, and a statement longer than any buffer.
	var b strings.Builder
	var want []stmt
	for i := 0; i < 500; i++ {
		s := fmt.Sprintf("INSERT INTO t VALUES (%d, '%s')", i, strings.Repeat("x;", i))
		b.WriteString(s + ";\n")
		want = append(want, stmt{sqltx.Other, s})
		if i%100 == 99 {
			b.WriteString("COMMIT;")
			want = append(want, stmt{sqltx.Commit, "COMMIT"})
		}
	}
	sql := b.String()
	stmts, err := sqltx.Split(sql)
	if err != nil {
		t.Fatal(err)
	}
	if g := got(sql, stmts); fmt.Sprint(g) != fmt.Sprint(want) {
		t.Errorf("Split of %d statements differs", len(want))
	}
}
