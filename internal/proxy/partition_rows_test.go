package proxy_test

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
)

// TestProtectedRowsPerPartition (issue 24, part 2): a table declared with fence.protect, its
// rows partitioned by shard into the resources billing-3 and billing-7. Through the proxy, a
// session of each partition writes its own rows and is refused the other's (ZF012: INSERT,
// UPDATE, DELETE, ON CONFLICT DO UPDATE, a move between partitions, COPY), in PostgreSQL, with
// no rewriting; a raise of billing-3 ends its stale writer (its open
// transaction never commits, its token is refused), while billing-7's session writes on; the
// new token of billing-3 takes over its rows, which then carry it; a session without a token
// (a direct connection) writes nothing (ZF003).
func TestProtectedRowsPerPartition(t *testing.T) {
	t.Parallel()
	pg, admin := fencedDB(t)
	ctx := ctxT(t)
	mustExec(t, admin, `CREATE TABLE charges (id bigint PRIMARY KEY, shard int NOT NULL, amount int NOT NULL)`)
	mustExec(t, admin, `GRANT ALL ON charges TO app`)
	mustExec(t, admin, `SELECT fence.protect('charges', $$'billing-' || shard$$)`)
	p := fencedProxy(t, pg, func(c *proxy.Config) { c.Resources = []string{"billing-3", "billing-7"} })

	s3 := connect(t, p.FenceURL("app", "postgres", "billing-3", 1))
	s7 := connect(t, p.FenceURL("app", "postgres", "billing-7", 1))
	mustExec(t, s3, `INSERT INTO charges VALUES (31, 3, 10), (32, 3, 20)`)
	mustExec(t, s7, `INSERT INTO charges VALUES (71, 7, 10)`)
	mustExec(t, s3, `UPDATE charges SET amount = amount + 1 WHERE shard = 3`)
	mustExec(t, s7, `DELETE FROM charges WHERE id = 71`)
	mustExec(t, s7, `INSERT INTO charges VALUES (71, 7, 11) ON CONFLICT (id) DO UPDATE SET amount = excluded.amount`)

	for _, c := range []struct {
		conn querier
		sql  string
	}{
		{s3, `INSERT INTO charges VALUES (33, 7, 1)`},
		{s3, `UPDATE charges SET amount = 0 WHERE id = 71`},
		{s3, `DELETE FROM charges`},
		{s3, `INSERT INTO charges VALUES (71, 3, 1) ON CONFLICT (id) DO UPDATE SET amount = 0`},
		{s7, `UPDATE charges SET shard = 7 WHERE id = 31`},
		{s7, `UPDATE charges SET amount = 0 WHERE shard = 3`},
	} {
		_, err := c.conn.Exec(ctx, c.sql)
		wantCode(t, err, fence.CodeNotBound)
		if pe := pgErrorOf(err); pe.Hint == "" {
			t.Fatalf("%s: ZF012 without a hint: %v", c.sql, err)
		}
	}
	// COPY, the pgx way (CopyFrom): its rows are checked one by one too.
	copyRows := func(conn *pgx.Conn, rows ...[]any) error {
		_, err := conn.CopyFrom(ctx, pgx.Identifier{"charges"}, []string{"id", "shard", "amount"}, pgx.CopyFromRows(rows))
		return err
	}
	wantCode(t, copyRows(s3, []any{int64(36), int32(3), int32(1)}, []any{int64(74), int32(7), int32(1)}), fence.CodeNotBound)
	if err := copyRows(s7, []any{int64(74), int32(7), int32(1)}); err != nil {
		t.Fatal(err)
	}
	mustExec(t, s7, `DELETE FROM charges WHERE id = 74`)
	if got := rowsOf(t, admin); got != "31 3 11 1, 32 3 21 1, 71 7 11 1" {
		t.Fatalf("rows after the refused writes: %s", got)
	}

	// billing-3's stale writer has a transaction open when billing-3 is raised to 2.
	mustExec(t, s3, `BEGIN`)
	mustExec(t, s3, `INSERT INTO charges VALUES (34, 3, 1)`)
	n3 := connect(t, p.FenceURL("app", "postgres", "billing-3", 2))
	_, err := s3.Exec(ctx, `COMMIT`)
	wantStale(t, err)
	wantStale(t, connectErr(p.FenceURL("app", "postgres", "billing-3", 1)))
	// billing-7's session was not touched: it writes on.
	mustExec(t, s7, `INSERT INTO charges VALUES (72, 7, 1)`)
	// The new leader of billing-3 takes its rows over.
	mustExec(t, n3, `UPDATE charges SET amount = amount + 1 WHERE id = 31`)
	mustExec(t, n3, `INSERT INTO charges VALUES (35, 3, 1)`)
	_, err = n3.Exec(ctx, `INSERT INTO charges VALUES (73, 7, 1)`)
	wantCode(t, err, fence.CodeNotBound)
	if got := rowsOf(t, admin); got != "31 3 12 2, 32 3 21 1, 35 3 1 2, 71 7 11 1, 72 7 1 1" {
		t.Fatalf("rows after the raise: %s (the stale writer's row 34 must not be there)", got)
	}

	// A session without a token, straight to PostgreSQL, writes no protected row.
	direct := connect(t, pg.URLWithPassword("app", "app", "postgres"))
	_, err = direct.Exec(ctx, `INSERT INTO charges VALUES (36, 3, 1)`)
	wantCode(t, err, fence.CodeMissing)
}

// rowsOf lists the rows of charges as "id shard amount fence_token", by id.
func rowsOf(t *testing.T, conn querier) string {
	t.Helper()
	var rows string
	if err := conn.QueryRow(ctxT(t), `SELECT coalesce(string_agg(concat_ws(' ', id, shard, amount, fence_token), ', ' ORDER BY id), '') FROM charges`).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	return rows
}

// TestMeasureProtectedWrites measures what fence.protect's trigger costs a fenced session,
// through the proxy: statements that write 10000 rows (INSERT ... SELECT, UPDATE, DELETE) and
// single-row INSERTs (a round trip each), into a protected table and into the same table
// unprotected, in interleaved rounds; it prints the medians per row. Run it by hand
// (docs/partitions.md):
//
//	FENCEPROXY_MEASURE=1 go test -run TestMeasureProtectedWrites -count=1 -v ./internal/proxy/
func TestMeasureProtectedWrites(t *testing.T) {
	rounds, bulk, single := measureRounds(t, 5), 10000, 200
	pg, admin := fencedDB(t)
	for _, tbl := range []string{"plain", "protected"} {
		mustExec(t, admin, `CREATE TABLE `+tbl+` (id bigint PRIMARY KEY, shard int NOT NULL, amount int NOT NULL, fence_token bigint NOT NULL DEFAULT 0)`)
		mustExec(t, admin, `GRANT ALL ON `+tbl+` TO app`)
	}
	mustExec(t, admin, `SELECT fence.protect('protected', $$'billing-' || shard$$)`)
	p := fencedProxy(t, pg, func(c *proxy.Config) { c.Resources = []string{"billing-3"} })
	conn := connect(t, p.FenceURL("app", "postgres", "billing-3", 1))
	ctx := ctxT(t)
	timed := func(sql string, args ...any) time.Duration {
		began := time.Now()
		if _, err := conn.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
		return time.Since(began)
	}
	d := map[string][]time.Duration{}
	kinds := []string{"insert", "update", "delete", "single insert"}
	for range rounds {
		for _, tbl := range []string{"plain", "protected"} {
			n := time.Duration(bulk)
			d[tbl+" insert"] = append(d[tbl+" insert"], timed(`INSERT INTO `+tbl+` SELECT g, 3, g FROM generate_series(1, $1) AS g`, bulk)/n)
			d[tbl+" update"] = append(d[tbl+" update"], timed(`UPDATE `+tbl+` SET amount = amount + 1`)/n)
			d[tbl+" delete"] = append(d[tbl+" delete"], timed(`DELETE FROM `+tbl)/n)
			for i := range single {
				d[tbl+" single insert"] = append(d[tbl+" single insert"], timed(`INSERT INTO `+tbl+` VALUES ($1, 3, 1)`, i))
			}
			timed(`DELETE FROM ` + tbl)
		}
	}
	for _, kind := range kinds {
		for _, tbl := range []string{"plain", "protected"} {
			ds := d[tbl+" "+kind]
			slices.Sort(ds)
			fmt.Printf("%-10s %-14s median %v per row (n=%d)\n", tbl, kind, ds[len(ds)/2].Round(100*time.Nanosecond), len(ds))
		}
	}
}
