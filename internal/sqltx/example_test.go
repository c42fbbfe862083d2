package sqltx_test

import (
	"errors"
	"fmt"

	"github.com/fenceproxy/fenceproxy/internal/sqltx"
)

func ExampleSplit() {
	sql := "SELECT 'COMMIT;' AS x; /* END; */ commit"
	stmts, err := sqltx.Split(sql)
	if err != nil {
		panic(err)
	}
	for _, s := range stmts {
		fmt.Printf("%s: %q\n", s.Kind, sql[s.Start:s.End])
	}
	// Output:
	// other statement: "SELECT 'COMMIT;' AS x"
	// COMMIT: "commit"
}

func ExampleClassify() {
	for _, sql := range []string{"END AND CHAIN", "PREPARE q AS SELECT 1", "CREATE INDEX CONCURRENTLY i ON t (x)"} {
		k, err := sqltx.Classify(sql)
		fmt.Println(k, err, k.CommitPoint(), k.OwnTransaction())
	}
	// Output:
	// COMMIT AND CHAIN <nil> true false
	// other statement <nil> false false
	// statement that cannot run inside a transaction block <nil> false true
}

func ExamplePlanQuery() {
	const check = "SELECT fence.check('billing', 42)"

	// Autocommit: the check runs last, in the implicit transaction.
	p, _ := sqltx.PlanQuery("INSERT INTO invoices VALUES (1)", false, false, check)
	fmt.Printf("%q %v\n", p.Text, p.Ours)

	// Inside a block: right before the COMMIT.
	p, _ = sqltx.PlanQuery("UPDATE accounts SET n = n + 1; COMMIT", true, false, check)
	fmt.Printf("%q %v %v\n", p.Text, p.Ours, p.EndsInBlock)

	// VACUUM alone cannot share a transaction with a check.
	p, err := sqltx.PlanQuery("VACUUM", false, false, check)
	fmt.Println(errors.Is(err, sqltx.ErrNeedsOwnTransaction), p.Kinds[0].SafeWithoutCheck())
	// Output:
	// "INSERT INTO invoices VALUES (1)\n;SELECT fence.check('billing', 42)" [false true]
	// "UPDATE accounts SET n = n + 1; SELECT fence.check('billing', 42); COMMIT" [false true false] false
	// true true
}

func ExampleCache() {
	cache := sqltx.NewCache(1024) // one per proxy, shared by its sessions
	for i := 0; i < 3; i++ {
		k, _ := cache.Classify("SELECT abalance FROM pgbench_accounts WHERE aid = $1")
		fmt.Println(k)
	}
	fmt.Println(cache.Len())
	// Output:
	// other statement
	// other statement
	// other statement
	// 1
}
