package proxy_test

import (
	"bytes"
	"context"
	"crypto/md5" //nolint:gosec // compared with PostgreSQL's md5(), not for security
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// pgxModes are the two ways pgx talks: the extended protocol (its default,
// statements prepared and cached) and the simple protocol (parameters
// interpolated client-side into a Query).
var pgxModes = []struct {
	name   string
	params []string
}{
	{"extended", nil},
	{"simple", []string{"default_query_exec_mode=simple_protocol"}},
}

// tenv is what a transparency case gets: where to connect through the
// proxy, where directly, and an admin pool straight to PostgreSQL.
type tenv struct {
	pg     *testenv.Postgres
	proxy  string // URL through the proxy, in the case's pgx mode
	direct string // the same URL straight to PostgreSQL
	admin  *pgxpool.Pool
	name   string // unique per case and mode, usable as an identifier
}

var transparencyCases = []struct {
	name string
	run  func(t *testing.T, e tenv)
}{
	{"types round trip", testTypes},
	{"many rows", func(t *testing.T, e tenv) {
		conn := connect(t, e.proxy)
		rows, err := conn.Query(ctxT(t), "SELECT g, md5(g::text) FROM generate_series(1, $1::int) g", 100000)
		if err != nil {
			t.Fatal(err)
		}
		var n, sum int64
		for rows.Next() {
			var g int64
			var h string
			if err := rows.Scan(&g, &h); err != nil {
				t.Fatal(err)
			}
			if want := fmt.Sprintf("%x", md5.Sum([]byte(fmt.Sprint(g)))); h != want { //nolint:gosec
				t.Fatalf("row %d: md5 %s, want %s", g, h, want)
			}
			n++
			sum += g
		}
		if rows.Err() != nil || n != 100000 || sum != 100000*100001/2 {
			t.Fatalf("%d rows, sum %d, err %v", n, sum, rows.Err())
		}
	}},
	{"errors as the server reports them", testErrors},
	{"multi-statement query", func(t *testing.T, e tenv) {
		conn := connect(t, e.proxy)
		res, err := conn.PgConn().Exec(ctxT(t), "SELECT 1; SELECT 'two'; CREATE TEMP TABLE x (a int); INSERT INTO x VALUES (1), (2); SELECT sum(a) FROM x").ReadAll()
		if err != nil {
			t.Fatal(err)
		}
		var tags []string
		for _, r := range res {
			tags = append(tags, r.CommandTag.String())
		}
		if want := []string{"SELECT 1", "SELECT 1", "CREATE TABLE", "INSERT 0 2", "SELECT 1"}; !reflect.DeepEqual(tags, want) {
			t.Fatalf("tags %q, want %q", tags, want)
		}
		if got := string(res[4].Rows[0][0]); got != "3" {
			t.Fatalf("sum %s", got)
		}
	}},
	{"prepared statements", testPrepared},
	{"pipeline with several syncs", testPipeline},
	{"batch", func(t *testing.T, e tenv) {
		conn := connect(t, e.proxy)
		mustExec(t, e.admin, "CREATE TABLE "+e.name+" (id int PRIMARY KEY, v text)")
		b := &pgx.Batch{}
		b.Queue("INSERT INTO "+e.name+" VALUES ($1, $2)", 1, "one")
		b.Queue("INSERT INTO "+e.name+" VALUES ($1, $2) RETURNING id * 10", 2, "two")
		b.Queue("SELECT string_agg(v, ',' ORDER BY id) FROM " + e.name)
		br := conn.SendBatch(ctxT(t), b)
		if _, err := br.Exec(); err != nil {
			t.Fatal(err)
		}
		var id int
		if err := br.QueryRow().Scan(&id); err != nil || id != 20 {
			t.Fatalf("returning %d %v", id, err)
		}
		var agg string
		if err := br.QueryRow().Scan(&agg); err != nil || agg != "one,two" {
			t.Fatalf("agg %q %v", agg, err)
		}
		if err := br.Close(); err != nil {
			t.Fatal(err)
		}
	}},
	{"transactions and savepoints", testTransactions},
	{"copy from stdin", testCopyFrom},
	{"copy to stdout", testCopyTo},
	{"listen and notify", testListenNotify},
	{"notices", testNotices},
	{"parameter status", testParameterStatus},
	{"cancel", testCancel},
	{"parameter of 100 MB", testLargeParam},
	{"row of 100 MB", testLargeRow},
	{"terminate", func(t *testing.T, e tenv) {
		conn := connect(t, e.proxy)
		pid := conn.PgConn().PID()
		var serverPID uint32
		if err := conn.QueryRow(ctxT(t), "SELECT pg_backend_pid()").Scan(&serverPID); err != nil {
			t.Fatal(err)
		}
		if serverPID != pid {
			t.Fatalf("BackendKeyData says pid %d, the backend is %d", pid, serverPID)
		}
		if err := conn.Close(ctxT(t)); err != nil {
			t.Fatal(err)
		}
		took := backendGone(t, e.admin, pid, 15*time.Second)
		t.Logf("backend gone %v after Terminate", took)
	}},
}

// testPgx runs pgx through the proxy, in both of its protocol modes, over
// every feature of the protocol that applications use.
func testPgx(t *testing.T, s *suite) {
	pg, p, admin := s.setup(t)
	for _, mode := range pgxModes {
		t.Run(mode.name, func(t *testing.T) {
			for i, c := range transparencyCases {
				e := tenv{
					pg:     pg,
					proxy:  p.URL(testenv.AdminUser, "postgres", mode.params...),
					direct: pg.URL(testenv.AdminUser, "postgres", mode.params...),
					admin:  admin,
					name:   fmt.Sprintf("t_%s_%d", mode.name, i),
				}
				t.Run(c.name, func(t *testing.T) {
					t.Parallel()
					c.run(t, e)
				})
			}
		})
	}
}

func testTypes(t *testing.T, e tenv) {
	conn := connect(t, e.proxy)
	ts := time.Date(2024, 2, 29, 23, 59, 58, 123456000, time.UTC)
	text := "quote ' double \" backslash \\ dollar $$ nul-free unicode é 漢字 🙂\nnewline\ttab"
	blob := []byte{0, 1, 2, 0xff, 0xfe, '\\', '\'', 0}
	args := []any{int64(-9007199254740993), text, blob, 3.25, true, ts, "12345678901234567890.000000001", []int32{1, -2, 3}, `{"k": ["v", 1.5]}`, nil}
	var (
		i8  int64
		s   string
		b   []byte
		f   float64
		ok  bool
		tz  time.Time
		num string
		arr []int32
		js  map[string]any
		nul *string
	)
	err := conn.QueryRow(ctxT(t), "SELECT $1::int8, $2::text, $3::bytea, $4::float8, $5::bool, $6::timestamptz, $7::numeric::text, $8::int4[], $9::jsonb, $10::text", args...).
		Scan(&i8, &s, &b, &f, &ok, &tz, &num, &arr, &js, &nul)
	if err != nil {
		t.Fatal(err)
	}
	got := []any{i8, s, b, f, ok, tz.UTC(), num, arr, js, nul}
	want := []any{args[0], text, blob, 3.25, true, ts, args[6], args[7], map[string]any{"k": []any{"v", 1.5}}, (*string)(nil)}
	for i := range want {
		if !reflect.DeepEqual(got[i], want[i]) {
			t.Errorf("$%d: got %#v, want %#v", i+1, got[i], want[i])
		}
	}
	var iv pgtype.Interval
	if err := conn.QueryRow(ctxT(t), "SELECT $1::interval", "1 mon 2 days 03:04:05").Scan(&iv); err != nil || iv.Months != 1 || iv.Days != 2 {
		t.Fatalf("interval %+v %v", iv, err)
	}
}

func testErrors(t *testing.T, e tenv) {
	ctx := ctxT(t)
	direct, proxied := connect(t, e.direct), connect(t, e.proxy)
	for _, sql := range []string{"SELECT 1/0", "SELECT * FRM nowhere", "SELECT nosuchcolumn FROM pg_class", "SELECT 'x'::int", "DO $$BEGIN RAISE EXCEPTION USING ERRCODE = 'P0001', MESSAGE = 'mine', DETAIL = 'd', HINT = 'h'; END$$"} {
		_, derr := direct.Exec(ctx, sql)
		_, perr := proxied.Exec(ctx, sql)
		d, p := pgErrorOf(derr), pgErrorOf(perr)
		if d == nil || p == nil {
			t.Fatalf("%s: direct %v, proxy %v", sql, derr, perr)
		}
		if !reflect.DeepEqual(*d, *p) {
			t.Errorf("%s:\ndirect %+v\nproxy  %+v", sql, *d, *p)
		}
	}
	tx, err := proxied.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SELECT 1/0"); sqlstate(err) != "22012" {
		t.Fatalf("want 22012, got %v", err)
	}
	if _, err := tx.Exec(ctx, "SELECT 1"); sqlstate(err) != "25P02" {
		t.Fatalf("want 25P02, got %v", err)
	}
	if proxied.PgConn().TxStatus() != 'E' {
		t.Fatalf("tx status %q, want E", proxied.PgConn().TxStatus())
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if n := count(t, proxied, "SELECT 7"); n != 7 {
		t.Fatal(n)
	}
}

func testPrepared(t *testing.T, e tenv) {
	ctx := ctxT(t)
	conn := connect(t, e.proxy)
	// Named, through pgx.
	if _, err := conn.Prepare(ctx, "double_it", "SELECT $1::int * 2"); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if n := count(t, conn, "double_it", 21+i); n != 42+2*i {
			t.Fatalf("double_it(%d) = %d", 21+i, n)
		}
	}
	if err := conn.Deallocate(ctx, "double_it"); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.PgConn().ExecPrepared(ctx, "double_it", nil, nil, nil).Close(); sqlstate(err) != "26000" {
		t.Fatalf("after Deallocate: want 26000, got %v", err)
	}
	// Unnamed statement and portal, text and binary results.
	res := conn.PgConn().ExecParams(ctx, "SELECT $1::text || 'b', $2::int4", [][]byte{[]byte("a"), {0, 0, 0, 5}}, nil, []int16{0, 1}, []int16{0, 1}).Read()
	if res.Err != nil || string(res.Rows[0][0]) != "ab" || !bytes.Equal(res.Rows[0][1], []byte{0, 0, 0, 5}) {
		t.Fatalf("unnamed: %q %v", res.Rows, res.Err)
	}
	if _, err := conn.PgConn().Prepare(ctx, "", "SELECT $1::int + 1", nil); err != nil {
		t.Fatal(err)
	}
	res = conn.PgConn().ExecPrepared(ctx, "", [][]byte{[]byte("1")}, nil, nil).Read()
	if res.Err != nil || string(res.Rows[0][0]) != "2" {
		t.Fatalf("unnamed prepared: %q %v", res.Rows, res.Err)
	}
	// SQL-level PREPARE and EXECUTE.
	if _, err := conn.PgConn().Exec(ctx, "PREPARE sq(int) AS SELECT $1 * 3").ReadAll(); err != nil {
		t.Fatal(err)
	}
	if n := count(t, conn, "EXECUTE sq(5)"); n != 15 {
		t.Fatal(n)
	}
	// The statement cache of the extended mode reuses statements: run the same SQL many times.
	for i := range 50 {
		if n := count(t, conn, "SELECT $1::int", i); n != i {
			t.Fatal(n)
		}
	}
}

func testPipeline(t *testing.T, e tenv) {
	ctx := ctxT(t)
	conn := connect(t, e.proxy)
	p := conn.PgConn().StartPipeline(ctx)
	p.SendPrepare("pp", "SELECT $1::int + 1", nil)
	p.SendQueryPrepared("pp", [][]byte{[]byte("1")}, nil, nil)
	p.SendPipelineSync()
	p.SendQueryParams("SELECT 1/0", nil, nil, nil, nil)
	p.SendQueryParams("SELECT 'skipped'", nil, nil, nil, nil)
	p.SendPipelineSync()
	p.SendQueryPrepared("pp", [][]byte{[]byte("41")}, nil, nil)
	p.SendQueryParams("SELECT repeat('x', 100000)", nil, nil, nil, nil)
	p.SendPipelineSync()
	if err := p.Flush(); err != nil {
		t.Fatal(err)
	}
	var got []string
	for {
		r, err := p.GetResults()
		if err != nil {
			got = append(got, "error "+sqlstate(err))
			continue
		}
		switch r := r.(type) {
		case *pgconn.StatementDescription:
			got = append(got, fmt.Sprintf("prepared %d params", len(r.ParamOIDs)))
		case *pgconn.ResultReader:
			res := r.Read()
			if res.Err != nil {
				got = append(got, "error "+sqlstate(res.Err))
			} else {
				got = append(got, fmt.Sprintf("result %d", len(res.Rows[0][0])))
			}
		case *pgconn.PipelineSync:
			got = append(got, "sync")
		case nil:
			got = append(got, "end")
		}
		if len(got) > 0 && got[len(got)-1] == "end" || len(got) > 20 {
			break
		}
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	want := []string{"prepared 1 params", "result 1", "sync", "error 22012", "sync", "result 2", "result 100000", "sync", "end"}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("pipeline results %q, want %q", got, want)
	}
	if n := count(t, conn, "SELECT 5"); n != 5 {
		t.Fatal(n)
	}
}

func testTransactions(t *testing.T, e tenv) {
	ctx := ctxT(t)
	conn := connect(t, e.proxy)
	mustExec(t, e.admin, "CREATE TABLE "+e.name+" (v text)")
	ins := "INSERT INTO " + e.name + " VALUES ($1)"
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	mustExec(t, tx, ins, "rolled back")
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	tx, err = conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	mustExec(t, tx, ins, "committed")
	sp, err := tx.Begin(ctx) // a savepoint
	if err != nil {
		t.Fatal(err)
	}
	mustExec(t, sp, ins, "savepoint rolled back")
	if err := sp.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if conn.PgConn().TxStatus() != 'T' {
		t.Fatalf("status %q", conn.PgConn().TxStatus())
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var vals []string
	rows, _ := e.admin.Query(ctx, "SELECT v FROM "+e.name)
	vals, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || !reflect.DeepEqual(vals, []string{"committed"}) {
		t.Fatalf("rows %q %v", vals, err)
	}
}

func testCopyFrom(t *testing.T, e tenv) {
	ctx := ctxT(t)
	conn := connect(t, e.proxy)
	mustExec(t, e.admin, "CREATE TABLE "+e.name+" (id int, v text)")
	// pgx's binary COPY.
	const n = 20000
	rows := make([][]any, n)
	for i := range rows {
		rows[i] = []any{i, fmt.Sprintf("row %d é", i)}
	}
	got, err := conn.CopyFrom(ctx, pgx.Identifier{e.name}, []string{"id", "v"}, pgx.CopyFromRows(rows))
	if err != nil || got != n {
		t.Fatalf("CopyFrom: %d %v", got, err)
	}
	// Text COPY of about 16 MB, streamed from a reader.
	var buf bytes.Buffer
	line := strings.Repeat("z", 1000)
	for i := n; buf.Len() < 16<<20; i++ {
		fmt.Fprintf(&buf, "%d\t%s\n", i, line)
	}
	want := sha256.Sum256(buf.Bytes())
	size := buf.Len()
	tag, err := conn.PgConn().CopyFrom(ctx, &buf, "COPY "+e.name+" FROM STDIN")
	if err != nil {
		t.Fatal(err)
	}
	var back bytes.Buffer
	if _, err := connect(t, e.direct).PgConn().CopyTo(ctx, &back, "COPY (SELECT * FROM "+e.name+" WHERE id >= "+fmt.Sprint(n)+" ORDER BY id) TO STDOUT"); err != nil {
		t.Fatal(err)
	}
	if back.Len() != size || sha256.Sum256(back.Bytes()) != want {
		t.Fatalf("text COPY of %d bytes (%s) came back as %d bytes", size, tag, back.Len())
	}
	if c := count(t, e.admin, "SELECT count(*) FROM "+e.name+" WHERE id < $1 AND v = 'row ' || id || ' é'", n); c != n {
		t.Fatalf("%d binary rows arrived intact, want %d", c, n)
	}
	// A COPY that fails in the middle leaves the session usable.
	_, err = conn.PgConn().CopyFrom(ctx, strings.NewReader("1\tok\nnot-a-number\tx\n"), "COPY "+e.name+" FROM STDIN")
	if sqlstate(err) != "22P02" {
		t.Fatalf("want 22P02, got %v", err)
	}
	if c := count(t, conn, "SELECT 1"); c != 1 {
		t.Fatal(c)
	}
}

func testCopyTo(t *testing.T, e tenv) {
	ctx := ctxT(t)
	sql := "COPY (SELECT g, md5(g::text), repeat('y', 1000 + g % 100) FROM generate_series(1, 20000) g) TO STDOUT"
	var d, p bytes.Buffer
	dtag, err := connect(t, e.direct).PgConn().CopyTo(ctx, &d, sql)
	if err != nil {
		t.Fatal(err)
	}
	ptag, err := connect(t, e.proxy).PgConn().CopyTo(ctx, &p, sql)
	if err != nil {
		t.Fatal(err)
	}
	if dtag.String() != ptag.String() || !bytes.Equal(d.Bytes(), p.Bytes()) {
		t.Fatalf("COPY TO through the proxy: %s, %d bytes; directly: %s, %d bytes", ptag, p.Len(), dtag, d.Len())
	}
	if d.Len() < 20<<20 {
		t.Fatalf("only %d bytes copied", d.Len())
	}
	// Binary COPY and an error in the middle of a COPY.
	d.Reset()
	if _, err := connect(t, e.proxy).PgConn().CopyTo(ctx, &d, "COPY (SELECT 1::int) TO STDOUT (FORMAT binary)"); err != nil || !bytes.HasPrefix(d.Bytes(), []byte("PGCOPY\n\xff\r\n\x00")) {
		t.Fatalf("binary COPY: %q %v", d.Bytes(), err)
	}
	conn := connect(t, e.proxy)
	if _, err := conn.PgConn().CopyTo(ctx, &d, "COPY (SELECT 1/(g - 1000) FROM generate_series(1, 2000) g) TO STDOUT"); sqlstate(err) != "22012" {
		t.Fatalf("want 22012, got %v", err)
	}
	if c := count(t, conn, "SELECT 2"); c != 2 {
		t.Fatal(c)
	}
}

func testListenNotify(t *testing.T, e tenv) {
	ctx := ctxT(t)
	listener, notifier := connect(t, e.proxy), connect(t, e.proxy)
	ch := e.name + "_chan"
	mustExec(t, listener, "LISTEN "+ch)
	payload := strings.Repeat("é", 3000)
	if _, err := notifier.Exec(ctx, "SELECT pg_notify($1, $2)", ch, payload); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	n, err := listener.WaitForNotification(wctx)
	if err != nil {
		t.Fatal(err)
	}
	if n.Channel != ch || n.Payload != payload || n.PID != notifier.PgConn().PID() {
		t.Fatalf("notification %q/%d bytes from %d, want %q/%d from %d", n.Channel, len(n.Payload), n.PID, ch, len(payload), notifier.PgConn().PID())
	}
	// A notification that arrives while the listener is busy, and one
	// committed inside a transaction.
	tx, err := notifier.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	mustExec(t, tx, "NOTIFY "+ch+", 'in tx'")
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := listener.Exec(ctx, "SELECT pg_sleep(0.1)"); err != nil {
		t.Fatal(err)
	}
	n, err = listener.WaitForNotification(wctx)
	if err != nil || n.Payload != "in tx" {
		t.Fatalf("second notification %+v %v", n, err)
	}
	// Unlisten: nothing more arrives.
	mustExec(t, listener, "UNLISTEN *")
	mustExec(t, notifier, "NOTIFY "+ch+", 'late'")
	sctx, scancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer scancel()
	if n, err := listener.WaitForNotification(sctx); err == nil {
		t.Fatalf("notification after UNLISTEN: %+v", n)
	}
}

func testNotices(t *testing.T, e tenv) {
	var mu sync.Mutex
	var notices []pgconn.Notice
	conn := connectCfg(t, e.proxy, func(c *pgx.ConnConfig) {
		c.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
			mu.Lock()
			notices = append(notices, *n)
			mu.Unlock()
		}
	})
	mustExec(t, e.admin, "CREATE FUNCTION "+e.name+"(m text) RETURNS int LANGUAGE plpgsql AS $$BEGIN RAISE NOTICE 'fn %', m USING DETAIL = 'det'; RAISE WARNING 'careful'; RETURN 1; END$$")
	mustExec(t, conn, "DO $$BEGIN RAISE NOTICE 'hello %', 42; END$$")
	if c := count(t, conn, "SELECT "+e.name+"($1)", "arg"); c != 1 {
		t.Fatal(c)
	}
	mustExec(t, conn, "DROP TABLE IF EXISTS no_such_table_"+e.name)
	mu.Lock()
	defer mu.Unlock()
	var got []string
	for _, n := range notices {
		got = append(got, n.Severity+" "+n.Code+" "+n.Message+" "+n.Detail)
	}
	want := []string{
		"NOTICE 00000 hello 42 ",
		"NOTICE 00000 fn arg det",
		"WARNING 01000 careful ",
		"NOTICE 00000 table \"no_such_table_" + e.name + "\" does not exist, skipping ",
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("notices %q, want %q", got, want)
	}
}

func testParameterStatus(t *testing.T, e tenv) {
	ctx := ctxT(t)
	direct, conn := connect(t, e.direct), connect(t, e.proxy)
	for _, k := range []string{"server_version", "server_encoding", "client_encoding", "DateStyle", "IntervalStyle", "integer_datetimes",
		"is_superuser", "session_authorization", "standard_conforming_strings", "TimeZone", "application_name", "default_transaction_read_only", "in_hot_standby"} {
		if d, p := direct.PgConn().ParameterStatus(k), conn.PgConn().ParameterStatus(k); d != p {
			t.Errorf("startup ParameterStatus %s: direct %q, proxy %q", k, d, p)
		}
	}
	mustExec(t, conn, "SET application_name = 'through the proxy'")
	if got := conn.PgConn().ParameterStatus("application_name"); got != "through the proxy" {
		t.Fatalf("application_name %q", got)
	}
	if _, err := conn.Exec(ctx, "SELECT set_config('TimeZone', $1, false)", "America/Sao_Paulo"); err != nil {
		t.Fatal(err)
	}
	if got := conn.PgConn().ParameterStatus("TimeZone"); got != "America/Sao_Paulo" {
		t.Fatalf("TimeZone %q", got)
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	mustExec(t, tx, "SET LOCAL DateStyle = 'German'")
	if got := conn.PgConn().ParameterStatus("DateStyle"); got != "German, DMY" {
		t.Fatalf("DateStyle %q", got)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if got := conn.PgConn().ParameterStatus("DateStyle"); got != "ISO, MDY" {
		t.Fatalf("DateStyle after rollback %q", got)
	}
}

// testCancel: pgx sends a CancelRequest on a new connection when the
// query's context ends; through the proxy it must reach the backend.
func testCancel(t *testing.T, e tenv) {
	conn := connectCfg(t, e.proxy, func(c *pgx.ConnConfig) {
		c.BuildContextWatcherHandler = func(pc *pgconn.PgConn) ctxwatch.Handler {
			return &pgconn.CancelRequestContextWatcherHandler{Conn: pc, DeadlineDelay: 10 * time.Second}
		}
	})
	for range 2 {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		start := time.Now()
		_, err := conn.Exec(ctx, "SELECT pg_sleep(30)")
		cancel()
		took := time.Since(start)
		if sqlstate(err) != "57014" {
			t.Fatalf("want 57014 (query_canceled), got %v", err)
		}
		if took > 10*time.Second {
			t.Fatalf("cancel took %v", took)
		}
		if c := count(t, conn, "SELECT 3"); c != 3 {
			t.Fatal(c)
		}
	}
	// The explicit way, from another goroutine.
	errc := make(chan error, 1)
	go func() {
		_, err := conn.Exec(context.Background(), "SELECT pg_sleep(30)")
		errc <- err
	}()
	waitActive(t, e.admin, conn.PgConn().PID(), "pg_sleep")
	if err := conn.PgConn().CancelRequest(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-errc:
		if sqlstate(err) != "57014" {
			t.Fatalf("want 57014, got %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("CancelRequest did not cancel the query within 5 s")
	}
}

// waitActive waits until backend pid runs a query containing text.
func waitActive(t *testing.T, admin querier, pid uint32, text string) {
	t.Helper()
	eventually(t, 10*time.Second, fmt.Sprintf("backend %d runs %q", pid, text), func() error {
		if count(t, admin, "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND state = 'active' AND query LIKE '%' || $2 || '%'", int32(pid), text) == 0 {
			return errors.New("not running it")
		}
		return nil
	})
}

// largeText returns n bytes (a multiple of 64 KiB) of printable ASCII in
// 64 KiB blocks, each numbered and rotated differently, so that a lost,
// doubled or reordered chunk shows.
func largeText(n int) string {
	const block = 64 << 10
	const alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:-_"
	r := rand.New(rand.NewPCG(uint64(n), 7))
	chunk := make([]byte, 2*block)
	for i := range block {
		chunk[i] = alphabet[r.IntN(len(alphabet))]
	}
	copy(chunk[block:], chunk[:block])
	var b strings.Builder
	b.Grow(n)
	for i := 0; b.Len() < n; i++ {
		fmt.Fprintf(&b, "%08x", i)
		rot := (i * 7919) % block
		b.Write(chunk[rot : rot+block-8])
	}
	return b.String()
}

const hundredMB = 100 << 20

func testLargeParam(t *testing.T, e tenv) {
	conn := connect(t, e.proxy)
	s := largeText(hundredMB)
	sum := md5.Sum([]byte(s)) //nolint:gosec
	var back, serverMD5 string
	// $1 once: the simple protocol would paste it twice.
	if err := conn.QueryRow(ctxLong(t), "SELECT s, md5(s) FROM (SELECT $1::text AS s) x", s).Scan(&back, &serverMD5); err != nil {
		t.Fatal(err)
	}
	if serverMD5 != hex.EncodeToString(sum[:]) {
		t.Fatal("the server received different bytes")
	}
	if back != s {
		t.Fatalf("the echoed row differs (%d bytes, want %d)", len(back), len(s))
	}
}

func testLargeRow(t *testing.T, e tenv) {
	conn := connect(t, e.proxy)
	var row []byte
	var serverMD5 string
	// 1600 numbered blocks of 64 KiB, each different: 100 MiB.
	err := conn.QueryRow(ctxLong(t), `SELECT s, md5(s) FROM (
		SELECT string_agg(lpad(to_hex(g), 8, '0') || substr(repeat(md5(g::text), 2048), 1, 65528), '' ORDER BY g) AS s
		FROM generate_series(1, $1::int) g) x`, hundredMB>>16).Scan(&row, &serverMD5)
	if err != nil {
		t.Fatal(err)
	}
	sum := md5.Sum(row) //nolint:gosec
	if len(row) != hundredMB || hex.EncodeToString(sum[:]) != serverMD5 {
		t.Fatalf("row of %d bytes differs from what the server sent", len(row))
	}
}
