package sqltx_test

import (
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/sqltx"
)

// testCheck stands for the proxy's check in these tests.
const testCheck = "SELECT 'fenceproxy-check'"

type start int

const (
	idle start = iota
	inBlock
	failedBlock
)

func (s start) String() string { return [...]string{"idle", "in block", "failed block"}[s] }

func (s start) args() (inBlock, failed bool) { return s != idle, s == failedBlock }

// In the expected Ours: ck is one of the proxy's checks, cl a client statement.
const (
	ck = true
	cl = false
)

var planTests = []struct {
	name    string
	sql     string
	start   start
	text    string // "" means unchanged
	ours    []bool
	inBlock bool // EndsInBlock
	err     error
}{
	{name: "empty", sql: "", ours: []bool{}},
	{name: "comment only", sql: "-- only a comment", ours: []bool{}},
	{name: "semicolons in block", sql: ";;", start: inBlock, ours: []bool{}, inBlock: true},

	// Autocommit: the implicit transaction commits at the end of the message.
	{name: "select", sql: "SELECT 1", text: "SELECT 1\n;" + testCheck, ours: []bool{cl, ck}},
	{name: "trailing semicolon", sql: "SELECT 1;", text: "SELECT 1;\n;" + testCheck, ours: []bool{cl, ck}},
	{name: "trailing line comment", sql: "SELECT 1 -- done", text: "SELECT 1 -- done\n;" + testCheck, ours: []bool{cl, ck}},
	{name: "two statements", sql: "INSERT INTO t VALUES (1); INSERT INTO t VALUES (2)",
		text: "INSERT INTO t VALUES (1); INSERT INTO t VALUES (2)\n;" + testCheck, ours: []bool{cl, cl, ck}},
	{name: "call", sql: "CALL p()", text: "CALL p()\n;" + testCheck, ours: []bool{cl, ck}},
	{name: "do", sql: "DO $$BEGIN COMMIT; END$$", text: "DO $$BEGIN COMMIT; END$$\n;" + testCheck, ours: []bool{cl, ck}},

	// Inside a block nothing commits until the block ends.
	{name: "select in block", sql: "SELECT 1", start: inBlock, ours: []bool{cl}, inBlock: true},
	{name: "select in failed block", sql: "SELECT 1", start: failedBlock, ours: []bool{cl}, inBlock: true},
	{name: "begin", sql: "BEGIN", ours: []bool{cl}, inBlock: true},
	{name: "begin in block", sql: "BEGIN", start: inBlock, ours: []bool{cl}, inBlock: true},

	// Commit points.
	{name: "commit", sql: "COMMIT", start: inBlock, text: testCheck + "; COMMIT", ours: []bool{ck, cl}},
	{name: "end;", sql: "END;", start: inBlock, text: testCheck + "; END;", ours: []bool{ck, cl}},
	{name: "commit after comment", sql: "  -- why\nCOMMIT", start: inBlock, text: "  -- why\n" + testCheck + "; COMMIT", ours: []bool{ck, cl}},
	{name: "commit in failed block", sql: "COMMIT", start: failedBlock, ours: []bool{cl}},
	{name: "lone commit commits nothing", sql: "COMMIT", ours: []bool{cl}},
	{name: "rollback", sql: "ROLLBACK", start: inBlock, ours: []bool{cl}},
	{name: "prepare transaction", sql: "PREPARE TRANSACTION 'g'", start: inBlock, text: testCheck + "; PREPARE TRANSACTION 'g'", ours: []bool{ck, cl}},
	{name: "prepare implicit transaction", sql: "INSERT INTO t VALUES (1); PREPARE TRANSACTION 'g'",
		text: "INSERT INTO t VALUES (1); " + testCheck + "; PREPARE TRANSACTION 'g'", ours: []bool{cl, ck, cl}},
	{name: "commit and chain", sql: "COMMIT AND CHAIN", start: inBlock, text: testCheck + "; COMMIT AND CHAIN", ours: []bool{ck, cl}, inBlock: true},
	{name: "commit and chain in failed block", sql: "COMMIT AND CHAIN", start: failedBlock, ours: []bool{cl}, inBlock: true},
	{name: "savepoint then commit", sql: "SAVEPOINT s; COMMIT", start: inBlock, text: "SAVEPOINT s; " + testCheck + "; COMMIT", ours: []bool{cl, ck, cl}},
	{name: "second end commits nothing", sql: "/* a */ COMMIT /* b */; /* c */ END", start: inBlock,
		text: "/* a */ " + testCheck + "; COMMIT /* b */; /* c */ END", ours: []bool{ck, cl, cl}},

	// The rules measured on PostgreSQL 15 (see doc.go).
	{name: "begin adopts the implicit transaction", sql: "INSERT INTO t VALUES (1); BEGIN; INSERT INTO t VALUES (2); ROLLBACK",
		ours: []bool{cl, cl, cl, cl}},
	{name: "commit ends the implicit transaction", sql: "INSERT INTO t VALUES (1); COMMIT; INSERT INTO t VALUES (2); SELECT 1/0",
		text: "INSERT INTO t VALUES (1); " + testCheck + "; COMMIT; INSERT INTO t VALUES (2); SELECT 1/0\n;" + testCheck,
		ours: []bool{cl, ck, cl, cl, cl, ck}},
	{name: "commit and chain stays in a block", sql: "BEGIN; INSERT INTO t VALUES (1); COMMIT AND CHAIN; INSERT INTO t VALUES (2)",
		text: "BEGIN; INSERT INTO t VALUES (1); " + testCheck + "; COMMIT AND CHAIN; INSERT INTO t VALUES (2)",
		ours: []bool{cl, cl, ck, cl, cl}, inBlock: true},
	{name: "whole transaction", sql: "BEGIN; UPDATE t SET x = 1; END;",
		text: "BEGIN; UPDATE t SET x = 1; " + testCheck + "; END;", ours: []bool{cl, cl, ck, cl}},
	{name: "rollback of failed block then work", sql: "ROLLBACK; INSERT INTO t VALUES (1)", start: failedBlock,
		text: "ROLLBACK; INSERT INTO t VALUES (1)\n;" + testCheck, ours: []bool{cl, cl, ck}},
	{name: "rollback to revives a failed block", sql: "ROLLBACK TO s; COMMIT", start: failedBlock,
		text: "ROLLBACK TO s; " + testCheck + "; COMMIT", ours: []bool{cl, ck, cl}},
	{name: "commit in a string literal", sql: "SELECT 'COMMIT'; COMMIT", start: inBlock,
		text: "SELECT 'COMMIT'; " + testCheck + "; COMMIT", ours: []bool{cl, ck, cl}},

	// Statements that run only outside a block.
	{name: "vacuum alone", sql: "VACUUM", ours: []bool{cl}, err: sqltx.ErrNeedsOwnTransaction},
	{name: "create database alone", sql: "CREATE DATABASE d", ours: []bool{cl}, err: sqltx.ErrNeedsOwnTransaction},
	{name: "commit prepared alone", sql: "COMMIT PREPARED 'g'", ours: []bool{cl}, err: sqltx.ErrNeedsOwnTransaction},
	{name: "vacuum in block", sql: "VACUUM", start: inBlock, ours: []bool{cl}, inBlock: true},
	{name: "vacuum among others", sql: "VACUUM; SELECT 1", text: "VACUUM; SELECT 1\n;" + testCheck, ours: []bool{cl, cl, ck}},
}

func TestPlanQuery(t *testing.T) {
	cache := sqltx.NewCache(16)
	for _, tt := range planTests {
		t.Run(tt.name+"/"+tt.start.String(), func(t *testing.T) {
			inBlock, failed := tt.start.args()
			want := sqltx.QueryPlan{Text: tt.text, Ours: tt.ours, EndsInBlock: tt.inBlock}
			if want.Text == "" {
				want.Text = tt.sql
			}
			for _, o := range tt.ours {
				if o {
					want.Checks++
				}
			}
			stmts, err := sqltx.Split(tt.sql)
			if err != nil {
				t.Fatal(err)
			}
			for _, s := range stmts {
				want.Kinds = append(want.Kinds, s.Kind)
			}
			for _, c := range []*sqltx.Cache{nil, cache, cache, cache} { // kept the second time, from the cache the third
				p, err := c.PlanQuery(tt.sql, inBlock, failed, testCheck)
				if !errors.Is(err, tt.err) {
					t.Fatalf("PlanQuery(%q): %v, want %v", tt.sql, err, tt.err)
				}
				if !equalPlans(p, want) {
					t.Fatalf("PlanQuery(%q, %s)\n got %s\nwant %s", tt.sql, tt.start, fmtPlan(p), fmtPlan(want))
				}
			}
			if err == nil {
				checkPlanSplits(t, want)
			}
		})
	}
}

func equalPlans(a, b sqltx.QueryPlan) bool {
	return a.Text == b.Text && slices.Equal(a.Ours, b.Ours) && a.EndsInBlock == b.EndsInBlock &&
		a.Checks == b.Checks && slices.Equal(a.Kinds, b.Kinds)
}

func fmtPlan(p sqltx.QueryPlan) string {
	return fmt.Sprintf("{Text: %q, Ours: %v, EndsInBlock: %v, Checks: %d, Kinds: %v}", p.Text, p.Ours, p.EndsInBlock, p.Checks, p.Kinds)
}

// checkPlanSplits asserts that a plan's text splits into one statement per
// entry of Ours, with the checks where Ours says.
func checkPlanSplits(t *testing.T, p sqltx.QueryPlan) {
	t.Helper()
	stmts, err := sqltx.Split(p.Text)
	if err != nil {
		t.Fatalf("Split(plan %q): %v", p.Text, err)
	}
	if len(stmts) != len(p.Ours) {
		t.Fatalf("plan %q has %d statements, Ours has %d", p.Text, len(stmts), len(p.Ours))
	}
	j := 0
	for i, s := range stmts {
		text := p.Text[s.Start:s.End]
		if p.Ours[i] {
			if text != testCheck {
				t.Fatalf("plan %q: statement %d is %q, want the check", p.Text, i, text)
			}
			continue
		}
		if s.Kind != p.Kinds[j] {
			t.Fatalf("plan %q: statement %d is %v, want %v", p.Text, i, s.Kind, p.Kinds[j])
		}
		j++
	}
}

func TestPlanQueryErrors(t *testing.T) {
	var se *sqltx.SyntaxError
	if _, err := sqltx.PlanQuery("SELECT 1; COMMI", true, false, testCheck); !errors.As(err, &se) {
		t.Errorf("syntax error: %v, want a *SyntaxError", err)
	}
	if _, err := sqltx.PlanQuery("SELECT 1", false, true, testCheck); err == nil {
		t.Errorf("failed outside a block: no error")
	}
	for _, check := range []string{
		"SELECT fence.check('eu--billing', 7)", "SELECT 'a;b', '/*'", `SELECT "--"`, "SELECT 1 - -1",
	} {
		for _, c := range []*sqltx.Cache{nil, sqltx.NewCache(4)} {
			p, err := c.PlanQuery("COMMIT", true, false, check)
			if err != nil || p.Text != check+"; COMMIT" {
				t.Errorf("check %q: %q, %v", check, p.Text, err)
			}
		}
	}
	for _, check := range []string{
		"", "  ", "SELECT 1; SELECT 2", "SELECT 1;", "SELECT 1 -- x", "SELECT /* x */ 1", "SELECT 1 --",
		"COMMIT", "SET x = 1", "SELECT 'abc", `SELECT "abc`, "SELECT $$abc", "SELEC 1", "SELECT 1\x00",
	} {
		for _, c := range []*sqltx.Cache{nil, sqltx.NewCache(4)} {
			if _, err := c.PlanQuery("COMMIT", true, false, check); !errors.Is(err, sqltx.ErrInvalidCheck) {
				t.Errorf("check %q: %v, want ErrInvalidCheck", check, err)
			}
		}
	}
}

func TestKindMethods(t *testing.T) {
	tests := []struct {
		k                       sqltx.Kind
		ends, commit, own, safe bool
	}{
		{k: sqltx.Other},
		{k: sqltx.Begin},
		{k: sqltx.Commit, ends: true, commit: true},
		{k: sqltx.CommitChain, commit: true},
		{k: sqltx.Rollback, ends: true},
		{k: sqltx.RollbackChain},
		{k: sqltx.PrepareTransaction, ends: true, commit: true},
		{k: sqltx.CommitPrepared, own: true, safe: true},
		{k: sqltx.RollbackPrepared, own: true, safe: true},
		{k: sqltx.Savepoint},
		{k: sqltx.Release},
		{k: sqltx.RollbackTo},
		{k: sqltx.Call},
		{k: sqltx.Do},
		{k: sqltx.NoTxBlock, own: true},
		{k: sqltx.SetStdStrings},
		{k: sqltx.Maintenance, own: true, safe: true},
		{k: sqltx.SetClientEncoding},
	}
	seen := map[string]bool{}
	for _, tt := range tests {
		t.Run(tt.k.String(), func(t *testing.T) {
			if tt.k.EndsBlock() != tt.ends || tt.k.CommitPoint() != tt.commit ||
				tt.k.OwnTransaction() != tt.own || tt.k.SafeWithoutCheck() != tt.safe {
				t.Errorf("%v: EndsBlock %v CommitPoint %v OwnTransaction %v SafeWithoutCheck %v",
					tt.k, tt.k.EndsBlock(), tt.k.CommitPoint(), tt.k.OwnTransaction(), tt.k.SafeWithoutCheck())
			}
			if seen[tt.k.String()] {
				t.Errorf("%v: name not unique", tt.k)
			}
			seen[tt.k.String()] = true
		})
	}
	if s := sqltx.Kind(200).String(); s != "Kind(200)" {
		t.Errorf("Kind(200).String() = %q", s)
	}
}

func TestClientEncodingSafe(t *testing.T) {
	for name, want := range map[string]bool{
		"UTF8": true, "utf-8": true, "Unicode": true, "SQL_ASCII": true, "LATIN1": true, "iso-8859-15": true,
		"WIN1252": true, "windows-1251": true, "EUC_JP": true, "KOI8-R": true, "MULE_INTERNAL": true,
		"SJIS": false, "Shift_JIS": false, "SHIFT_JIS_2004": false, "mskanji": false, "BIG5": false,
		"GBK": false, "UHC": false, "GB18030": false, "JOHAB": false, "win932": false, "WIN936": false,
		"": false, "klingon": false, "utf8utf8utf8utf8utf8utf8utf8": false,
	} {
		if got := sqltx.ClientEncodingSafe(name); got != want {
			t.Errorf("ClientEncodingSafe(%q) = %v, want %v", name, got, want)
		}
	}
}

func TestStdStringsSensitive(t *testing.T) {
	tests := []struct {
		sql  string
		want bool
	}{
		{"SELECT 1", false},
		{`SELECT E'a\'b'`, false},
		{`SELECT e'\\'`, false},
		{`SELECT 'a' -- \ in a comment`, false},
		{`SELECT 'a' /* \' */`, false},
		{`SELECT $$a\$$`, false},
		{`SELECT $q$'\'$q$`, false},
		{`SELECT U&'\0041'`, false},
		{`SELECT B'01', X'1F', 'x'`, false},
		{`SELECT "a\b"`, false},
		{`SELECT 'a\'`, true},
		{`SELECT 'a\' || ' ; COMMIT; --'`, true},
		{`SELECT N'a\b'`, true},
		{"SELECT 'a'\n'b\\'", true},
		{`SET standard_conforming_strings = off; SELECT 'C:\temp'`, true},
	}
	for _, tt := range tests {
		if got, err := sqltx.StdStringsSensitive(tt.sql); err != nil || got != tt.want {
			t.Errorf("StdStringsSensitive(%q) = %v, %v; want %v", tt.sql, got, err, tt.want)
		}
	}
	for _, sql := range []string{`SELECT 'open \`, "SELECT '\\'\x00"} {
		if got, err := sqltx.StdStringsSensitive(sql); err == nil || !got {
			t.Errorf("StdStringsSensitive(%q) = %v, %v; want true and an error", sql, got, err)
		}
	}
}
