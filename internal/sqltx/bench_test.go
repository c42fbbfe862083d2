package sqltx_test

import (
	"fmt"
	"strings"
	"testing"

	pg_query "github.com/pganalyze/pg_query_go/v6"

	"github.com/fenceproxy/fenceproxy/internal/sqltx"
)

// Run with
//
//	go test ./internal/sqltx -run '^$' -bench . -benchmem -cpu 1
//
// Measured on the development machine (2 cores, AMD EPYC, shared with other
// jobs: the best of 4-8 runs, ns/op):
//
//	                      select  update  BEGIN;  END;  20 statements
//	PlanQuery               1372    1527    2971  3461          46104
//	Split                   1744    2044    2649  2729          32810
//	Classify                 822    1031    3536  2848              -
//	Cache hit: PlanQuery     107      66      78   120            448
//	Cache hit: Classify       20
//	pg_query.Parse         11005   14412    1699  1688         244534
//	pg_query.IsUtilityStmt   882     978     370   328          10880
//	pg_query.SplitWithParser 910     848     358   345          10664
//	pg_query.Scan           2365    3488     875   996          41760
//	reference (Parse+Scan) 18670   16597    2844  3044         252495
//
// A cache miss of a new SELECT text costs 1.2-1.25 µs (1.45-1.5 µs when
// every text was kept on first sight), an uncached call 1.7 µs (it also
// validates the check). BenchmarkCache/PlanQuery/pgbench_transaction, the
// five texts of one pgbench -N transaction with new literal values: 4.2-4.3
// µs and 27 allocations (5.2-5.3 µs and 33 when kept on first sight),
// 12.1-12.3 µs uncached. BenchmarkPlanQueryParallel: 1.5 µs/op with -cpu 1,
// 0.8 µs/op with -cpu 2 (-benchtime 3s, 1.6 cores busy): this package takes
// no lock outside a Cache, and libpg_query keeps its state per thread.

var benchQueries = []struct {
	name    string
	sql     string
	inBlock bool
}{
	{"select", "SELECT abalance FROM pgbench_accounts WHERE aid = 42;", false},
	{"update", "UPDATE pgbench_accounts SET abalance = abalance + -1234 WHERE aid = 42;", true},
	{"begin", "BEGIN;", false},
	{"end", "END;", true},
	{"20 statements", twentyStatements(), false},
}

// twentyStatements is a string of 20 statements: three pgbench-like
// transactions (BEGIN, five DML, END) minus one statement.
func twentyStatements() string {
	var b strings.Builder
	for i := 0; i < 3; i++ {
		fmt.Fprintf(&b, "BEGIN;\nUPDATE pgbench_accounts SET abalance = abalance + %d WHERE aid = %d;\n", i, 100+i)
		fmt.Fprintf(&b, "SELECT abalance FROM pgbench_accounts WHERE aid = %d;\n", 100+i)
		fmt.Fprintf(&b, "UPDATE pgbench_tellers SET tbalance = tbalance + %d WHERE tid = %d;\n", i, i)
		fmt.Fprintf(&b, "UPDATE pgbench_branches SET bbalance = bbalance + %d WHERE bid = 1;\n", i)
		if i < 2 {
			fmt.Fprintf(&b, "INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (%d, 1, %d, %d, CURRENT_TIMESTAMP);\n", i, 100+i, i)
		}
		b.WriteString("END;\n")
	}
	return b.String()
}

func BenchmarkSplit(b *testing.B) {
	for _, q := range benchQueries {
		b.Run(q.name, func(b *testing.B) {
			for b.Loop() {
				if _, err := sqltx.Split(q.sql); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkPlanQuery(b *testing.B) {
	for _, q := range benchQueries {
		b.Run(q.name, func(b *testing.B) {
			for b.Loop() {
				if _, err := sqltx.PlanQuery(q.sql, q.inBlock, false, testCheck); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkClassify(b *testing.B) {
	for _, q := range benchQueries[:4] {
		b.Run(q.name, func(b *testing.B) {
			for b.Loop() {
				if _, err := sqltx.Classify(q.sql); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkCache measures hits: the same text again and again, as with
// prepared statements parsed by many connections or BEGIN/END.
func BenchmarkCache(b *testing.B) {
	for _, q := range benchQueries {
		b.Run("PlanQuery/"+q.name, func(b *testing.B) {
			c := sqltx.NewCache(1024)
			for b.Loop() {
				if _, err := c.PlanQuery(q.sql, q.inBlock, false, testCheck); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	b.Run("Classify/select", func(b *testing.B) {
		c := sqltx.NewCache(1024)
		for b.Loop() {
			if _, err := c.Classify(benchQueries[0].sql); err != nil {
				b.Fatal(err)
			}
		}
	})
	// Misses: every text new (pgbench's simple protocol sends literal values),
	// so the cache only adds its bookkeeping.
	b.Run("PlanQuery/select miss", func(b *testing.B) {
		c := sqltx.NewCache(1024)
		i := 0
		for b.Loop() {
			i++
			sql := fmt.Sprintf("SELECT abalance FROM pgbench_accounts WHERE aid = %d;", i)
			if _, err := c.PlanQuery(sql, false, false, testCheck); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("PlanQuery/select miss uncached", func(b *testing.B) {
		i := 0
		for b.Loop() {
			i++
			sql := fmt.Sprintf("SELECT abalance FROM pgbench_accounts WHERE aid = %d;", i)
			if _, err := sqltx.PlanQuery(sql, false, false, testCheck); err != nil {
				b.Fatal(err)
			}
		}
	})
	// What a fenced session of pgbench -N -M simple asks per transaction:
	// BEGIN and END (the same texts every time) and three statements with
	// new literal values.
	for _, cached := range []bool{true, false} {
		name := "PlanQuery/pgbench transaction"
		var c *sqltx.Cache
		if cached {
			c = sqltx.NewCache(4096)
		} else {
			name += " uncached"
		}
		b.Run(name, func(b *testing.B) {
			i := 0
			for b.Loop() {
				i++
				for j, q := range pgbenchTransaction(i) {
					if _, err := c.PlanQuery(q, j > 0, false, testCheck); err != nil {
						b.Fatal(err)
					}
				}
			}
		})
	}
}

// pgbenchTransaction returns the texts of pgbench's -N script, the i-th time.
func pgbenchTransaction(i int) [5]string {
	aid, tid, bid, delta := 1+i%1000000, 1+i%100, 1+i%10, i%10001-5000
	return [5]string{
		"BEGIN;",
		fmt.Sprintf("UPDATE pgbench_accounts SET abalance = abalance + %d WHERE aid = %d;", delta, aid),
		fmt.Sprintf("SELECT abalance FROM pgbench_accounts WHERE aid = %d;", aid),
		fmt.Sprintf("INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (%d, %d, %d, %d, CURRENT_TIMESTAMP);", tid, bid, aid, delta),
		"END;",
	}
}

// BenchmarkPlanQueryParallel runs analyses in parallel (pg_query keeps its
// state per thread; compare -cpu 1,2 on an idle machine).
func BenchmarkPlanQueryParallel(b *testing.B) {
	q := benchQueries[0]
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := sqltx.PlanQuery(q.sql, false, false, testCheck); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

// BenchmarkApproach measures the pg_query entry points that an exact split
// could be built on, and the reference implementation (one full parse tree).
func BenchmarkApproach(b *testing.B) {
	for _, q := range benchQueries {
		b.Run("Parse/"+q.name, func(b *testing.B) {
			for b.Loop() {
				if _, err := pg_query.Parse(q.sql); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run("IsUtilityStmt/"+q.name, func(b *testing.B) {
			for b.Loop() {
				if _, err := pg_query.IsUtilityStmt(q.sql); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run("SplitWithParser/"+q.name, func(b *testing.B) {
			for b.Loop() {
				if _, err := pg_query.SplitWithParser(q.sql, false); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run("Scan/"+q.name, func(b *testing.B) {
			for b.Loop() {
				if _, err := pg_query.Scan(q.sql); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run("ReferenceSplit/"+q.name, func(b *testing.B) {
			for b.Loop() {
				if _, err := sqltx.ReferenceSplit(q.sql); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
