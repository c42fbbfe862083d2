package sqltx_test

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/fenceproxy/fenceproxy/internal/sqltx"
)

// Seed corpora live in testdata/fuzz/Fuzz*/; the table tests add theirs.

// FuzzSplit: Split never panics; statements lie within the text, in order,
// each starting at a token; Split agrees with the slow reference
// implementation, with Classify and with the Cache.
func FuzzSplit(f *testing.F) {
	for _, tt := range splitTests {
		f.Add(tt.sql)
	}
	cache := sqltx.NewCache(64)
	f.Fuzz(func(t *testing.T, sql string) {
		stmts, err := sqltx.Split(sql)
		ref, refErr := sqltx.ReferenceSplit(sql)
		// The reference parses text that is not UTF-8 as Latin-1, two bytes
		// per character, where byte-length checks (a UESCAPE character must
		// be one byte) can reject what the raw bytes pass; boundaries and
		// kinds never differ.
		if (err == nil) != (refErr == nil) && utf8.ValidString(sql) {
			t.Fatalf("Split(%q): %v; reference: %v", sql, err, refErr)
		}
		if refErr != nil {
			ref = stmts
		}
		if err != nil {
			var se *sqltx.SyntaxError
			if !errors.As(err, &se) && !errors.Is(err, sqltx.ErrNUL) {
				t.Fatalf("Split(%q): unexpected error %v (%T)", sql, err, err)
			}
			if _, perr := sqltx.PlanQuery(sql, false, false, testCheck); perr == nil {
				t.Fatalf("Split(%q) failed (%v) but PlanQuery did not", sql, err)
			}
			return
		}
		if fmt.Sprint(stmts) != fmt.Sprint(ref) {
			t.Fatalf("Split(%q) = %v, reference %v", sql, stmts, ref)
		}
		prevEnd := -1
		for i, s := range stmts {
			if s.Start <= prevEnd || s.Start >= s.End || s.End > len(sql) {
				t.Fatalf("Split(%q): statement %d at [%d, %d) after %d", sql, i, s.Start, s.End, prevEnd)
			}
			if c := sql[s.Start]; strings.IndexByte(" \t\n\r\f\v;", c) >= 0 ||
				strings.HasPrefix(sql[s.Start:], "--") || strings.HasPrefix(sql[s.Start:], "/*") {
				t.Fatalf("Split(%q): statement %d starts at %q, not at a token", sql, i, sql[s.Start:])
			}
			if s.End < len(sql) && sql[s.End] != ';' {
				t.Fatalf("Split(%q): statement %d ends at %q, not at a ';'", sql, i, sql[s.End:])
			}
			prevEnd = s.End
		}
		k, cerr := sqltx.Classify(sql)
		switch {
		case len(stmts) > 1 && !errors.Is(cerr, sqltx.ErrMultipleStatements),
			len(stmts) == 1 && (cerr != nil || k != stmts[0].Kind),
			len(stmts) == 0 && (cerr != nil || k != sqltx.Other):
			t.Fatalf("Classify(%q) = %v, %v; Split: %v", sql, k, cerr, stmts)
		}
		if cached, err := cache.Split(sql); err != nil || !slices.Equal(cached, stmts) {
			t.Fatalf("Cache.Split(%q) = %v, %v; want %v", sql, cached, err, stmts)
		}
	})
}

// FuzzPlanQuery: whenever the text splits, its plan's Text splits into one
// statement per entry of Ours, with the check exactly where Ours says and the
// client's statements unchanged and in order.
func FuzzPlanQuery(f *testing.F) {
	for _, tt := range planTests {
		inBlock, failed := tt.start.args()
		f.Add(tt.sql, inBlock, failed)
	}
	f.Fuzz(func(t *testing.T, sql string, inBlock, failed bool) {
		if failed && !inBlock {
			failed = false
		}
		stmts, err := sqltx.Split(sql)
		p, perr := sqltx.PlanQuery(sql, inBlock, failed, testCheck)
		if err != nil {
			if perr == nil {
				t.Fatalf("Split(%q) failed (%v) but PlanQuery did not", sql, err)
			}
			return
		}
		if errors.Is(perr, sqltx.ErrNeedsOwnTransaction) {
			if len(stmts) != 1 || inBlock || !stmts[0].Kind.OwnTransaction() || p.Text != sql {
				t.Fatalf("PlanQuery(%q, %v, %v): ErrNeedsOwnTransaction for %v", sql, inBlock, failed, stmts)
			}
			return
		}
		if perr != nil {
			t.Fatalf("PlanQuery(%q, %v, %v): %v", sql, inBlock, failed, perr)
		}
		planned, err := sqltx.Split(p.Text)
		if err != nil {
			t.Fatalf("plan of %q: Split(%q): %v", sql, p.Text, err)
		}
		if len(planned) != len(p.Ours) {
			t.Fatalf("plan of %q: %q has %d statements, Ours %v", sql, p.Text, len(planned), p.Ours)
		}
		checks, j := 0, 0
		for i, s := range planned {
			text := p.Text[s.Start:s.End]
			if p.Ours[i] {
				checks++
				if text != testCheck {
					t.Fatalf("plan of %q: statement %d is %q, want the check\nplan %q", sql, i, text, p.Text)
				}
				continue
			}
			orig := sql[stmts[j].Start:stmts[j].End]
			// The client's last statement gains the newline before an
			// appended check.
			appended := j == len(stmts)-1 && text == orig+"\n"
			if (text != orig && !appended) || s.Kind != stmts[j].Kind || p.Kinds[j] != s.Kind {
				t.Fatalf("plan of %q: statement %d is %q (%v), want %q (%v)\nplan %q", sql, i, text, s.Kind, orig, stmts[j].Kind, p.Text)
			}
			j++
		}
		if j != len(stmts) || checks != p.Checks {
			t.Fatalf("plan of %q: %d client statements of %d, %d checks (Checks %d)", sql, j, len(stmts), checks, p.Checks)
		}
		if utf8.ValidString(sql) && !utf8.ValidString(p.Text) {
			t.Fatalf("plan of %q is not valid UTF-8", sql)
		}
	})
}
