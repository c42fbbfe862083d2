package sqltx_test

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/sqltx"
)

// TestCacheAgrees: whatever order texts come in and whichever call cached
// them, a Cache answers like the package-level functions.
func TestCacheAgrees(t *testing.T) {
	orders := map[string][]string{
		"classify first": {"Classify", "PlanQuery", "Split", "PlanQuery"},
		"plan first":     {"PlanQuery", "Classify", "Split", "Classify"},
		"split first":    {"Split", "PlanQuery", "Classify"},
	}
	for name, order := range orders {
		t.Run(name, func(t *testing.T) {
			c := sqltx.NewCache(8) // small: evictions happen too
			for _, tt := range splitTests {
				for _, call := range order {
					if err := compareCached(c, call, tt.sql); err != nil {
						t.Fatal(err)
					}
				}
			}
		})
	}
}

func compareCached(c *sqltx.Cache, call, sql string) error {
	switch call {
	case "Classify":
		k1, err1 := sqltx.Classify(sql)
		k2, err2 := c.Classify(sql)
		if k1 != k2 || !errors.Is(err2, err1) && fmt.Sprint(err1) != fmt.Sprint(err2) {
			return fmt.Errorf("Classify(%q): %v, %v; cached %v, %v", sql, k1, err1, k2, err2)
		}
	case "Split":
		s1, err1 := sqltx.Split(sql)
		s2, err2 := c.Split(sql)
		if !slices.Equal(s1, s2) || fmt.Sprint(err1) != fmt.Sprint(err2) {
			return fmt.Errorf("Split(%q): %v, %v; cached %v, %v", sql, s1, err1, s2, err2)
		}
	case "PlanQuery":
		for _, st := range []start{idle, inBlock, failedBlock} {
			inBlock, failed := st.args()
			p1, err1 := sqltx.PlanQuery(sql, inBlock, failed, testCheck)
			p2, err2 := c.PlanQuery(sql, inBlock, failed, testCheck)
			if !equalPlans(p1, p2) || fmt.Sprint(err1) != fmt.Sprint(err2) {
				return fmt.Errorf("PlanQuery(%q, %v): %s, %v; cached %s, %v", sql, st, fmtPlan(p1), err1, fmtPlan(p2), err2)
			}
		}
	}
	return nil
}

func TestCacheBounds(t *testing.T) {
	c := sqltx.NewCache(3)
	for i := 0; i < 10; i++ {
		for range 2 { // a text is kept the second time it is seen
			if _, err := c.Classify(fmt.Sprintf("SELECT %d", i)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if c.Len() != 3 {
		t.Errorf("Len = %d after 10 texts, want 3", c.Len())
	}
	long := "SELECT '" + strings.Repeat("x", sqltx.MaxCachedText) + "'"
	for range 3 {
		if _, err := c.Split(long); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Classify("SELECT 1; SELECT 2"); err == nil {
			t.Fatal("no error for two statements")
		}
		if _, err := c.Classify("SELEC 1"); err == nil {
			t.Fatal("no error for a syntax error")
		}
	}
	if c.Len() != 3 {
		t.Errorf("Len = %d, want 3: long texts and errors are not cached", c.Len())
	}
	if sqltx.NewCache(0) == nil || (*sqltx.Cache)(nil).Len() != 0 {
		t.Error("NewCache(0) or nil Cache")
	}
}

// TestCacheAdmission: a text is cached the second time it is seen, so texts
// that never come again (literal values) neither fill the cache nor evict
// the texts that do (BEGIN, END, prepared statements).
func TestCacheAdmission(t *testing.T) {
	c := sqltx.NewCache(4)
	plan := func(sql string, inBlock bool) {
		t.Helper()
		if _, err := c.PlanQuery(sql, inBlock, false, testCheck); err != nil {
			t.Fatal(err)
		}
	}
	plan("BEGIN;", false)
	if c.Len() != 0 {
		t.Fatalf("Len = %d after one text, want 0: kept on first sight", c.Len())
	}
	plan("BEGIN;", false)
	if _, err := c.Classify("SELECT abalance FROM pgbench_accounts WHERE aid = $1"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Classify("SELECT abalance FROM pgbench_accounts WHERE aid = $1"); err != nil {
		t.Fatal(err)
	}
	if c.Len() != 2 {
		t.Fatalf("Len = %d after two texts seen twice, want 2", c.Len())
	}
	for i := range 1000 { // pgbench's simple protocol: every text new
		plan(fmt.Sprintf("UPDATE pgbench_accounts SET abalance = abalance + %d WHERE aid = %d;", i, i), true)
		plan("END;", true)
	}
	if c.Len() != 3 {
		t.Errorf("Len = %d after 1000 new texts and END, want 3 (BEGIN, the prepared text, END)", c.Len())
	}
	for range 8 { // hits, which evict nothing
		plan("BEGIN;", false)
	}
	if c.Len() != 3 {
		t.Errorf("Len = %d, want 3", c.Len())
	}
}

// TestCacheCopies: changing what a Cache returned changes nothing in it.
func TestCacheCopies(t *testing.T) {
	c := sqltx.NewCache(4)
	sql := "BEGIN; INSERT INTO t VALUES (1); COMMIT"
	s1, _ := c.Split(sql)
	s1[0].Kind = sqltx.Commit
	p1, _ := c.PlanQuery(sql, false, false, testCheck)
	p1.Ours[0], p1.Kinds[0] = true, sqltx.Rollback
	s2, _ := c.Split(sql)
	p2, _ := c.PlanQuery(sql, false, false, testCheck)
	if s2[0].Kind != sqltx.Begin || p2.Ours[0] || p2.Kinds[0] != sqltx.Begin {
		t.Errorf("the cache kept a caller's change: %v, %s", s2, fmtPlan(p2))
	}
}

// TestCacheConcurrent is for -race.
func TestCacheConcurrent(t *testing.T) {
	c := sqltx.NewCache(16)
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Go(func() {
			for i := 0; i < 200; i++ {
				tt := splitTests[(g*31+i)%len(splitTests)]
				call := []string{"Classify", "Split", "PlanQuery"}[i%3]
				if err := compareCached(c, call, tt.sql); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
}
