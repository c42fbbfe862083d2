package proxy_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// matrixChecks are what every cell reports, in the order drivers run them; a fenced cell
// adds "stale token". A driver may report more (node-postgres: "connect then end").
var matrixChecks = []string{
	"idle after connect",         // the transaction status right after connecting
	"rollback leaves nothing",    // the first transaction, rolled back, leaves nothing
	"transaction and savepoints", // a block with a savepoint rolled back to, and an error
	"prepared statement",
	"copy in",
	"copy out",
	"listen notify",
	"cancel",
}

var matrixRelays = []string{"loop", "goroutines"}

// cell is one driver through one proxy (admission path, relay), with TLS or without.
type cell struct {
	proxy    *testenv.Proxy
	tls      bool
	caFile   string
	resource string
	fenced   bool
	first    holding // the token the driver's sessions present
	dir      string  // the program's own folder
	// takeover makes the lock change hands (or, for a bare resource, picks the next
	// token) and returns the new holder, whose session makes the first one stale.
	takeover func() (holding, error)
}

// TestTransparencyMatrix runs every driver (pgx, psql, psycopg 2, psycopg 3,
// node-postgres, pgjdbc) through every admission path (bare resource, PostgreSQL lease,
// Consul in both token modes, etcd, ZooKeeper, unfenced) with either relay, over plain
// TCP and TLS: in each cell the driver's own view of the transaction status right after
// connecting is idle, a rolled-back first transaction leaves nothing, savepoints,
// prepared statements, COPY both ways, LISTEN/NOTIFY and cancel work, and a stale token
// surfaces as ZF001 in the driver's own error type. A failure names driver, path, relay,
// TLS and check: TestTransparencyMatrix/<driver>/<path>/<relay>/<tls>/<check>.
//
// A driver runs a cell's checks in one process; FENCEPROXY_MATRIX_PARALLEL cells run at
// once (default 6: a cell mostly waits on the servers). Every (path, relay) has one proxy,
// every cell its own resource, so that a cell's takeover leaves the others alone.
func TestTransparencyMatrix(t *testing.T) {
	s := sharedServers(t)
	drivers := clientDrivers()
	ca := newCA(t)
	certFile, keyFile := ca.issue(t, "proxy")
	tlsModes := []string{"plain", "tls"}
	parallel := 6
	if n, err := strconv.Atoi(os.Getenv("FENCEPROXY_MATRIX_PARALLEL")); err == nil && n > 0 {
		parallel = n
	}
	slots := make(chan struct{}, parallel)
	start := time.Now()

	// One proxy per (path, relay), one resource per cell.
	resource := func(pi, ri, ti, di int) string { return fmt.Sprintf("mx%d%d%d%d", pi, ri, ti, di) }
	proxies := map[[2]int]*testenv.Proxy{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for pi, path := range admissionPaths {
		for ri, relay := range matrixRelays {
			var resources []string
			for ti := range tlsModes {
				for di := range drivers {
					resources = append(resources, resource(pi, ri, ti, di))
				}
			}
			wg.Go(func() {
				p := startPathProxy(t, s, path, resources, func(c *proxy.Config) {
					c.Relay = relay
					c.TLSCert, c.TLSKey = certFile, keyFile
				})
				mu.Lock()
				proxies[[2]int{pi, ri}] = p
				mu.Unlock()
			})
		}
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	t.Logf("servers and %d proxies ready after %v", len(proxies), time.Since(start).Round(time.Millisecond))

	// Each level's subtests run from goroutines: the cells, not -parallel, set how many run.
	each := func(t *testing.T, names []string, f func(t *testing.T, i int)) {
		var wg sync.WaitGroup
		for i, name := range names {
			wg.Go(func() { t.Run(name, func(t *testing.T) { f(t, i) }) })
		}
		wg.Wait()
	}
	var driverNames, pathNames []string
	for _, d := range drivers {
		driverNames = append(driverNames, d.name)
	}
	for _, p := range admissionPaths {
		pathNames = append(pathNames, p.name)
	}
	each(t, driverNames, func(t *testing.T, di int) {
		run := drivers[di].prepare(t, s)
		each(t, pathNames, func(t *testing.T, pi int) {
			each(t, matrixRelays, func(t *testing.T, ri int) {
				each(t, tlsModes, func(t *testing.T, ti int) {
					slots <- struct{}{}
					defer func() { <-slots }()
					c := &cell{proxy: proxies[[2]int{pi, ri}], tls: ti == 1, caFile: ca.CAFile, resource: resource(pi, ri, ti, di), dir: t.TempDir()}
					runCell(t, s, admissionPaths[pi], c, run)
				})
			})
		})
	})
	t.Logf("%d drivers × %d paths × %d relays × %d = %d cells in %v", len(drivers), len(admissionPaths), len(matrixRelays), len(tlsModes),
		len(drivers)*len(admissionPaths)*len(matrixRelays)*len(tlsModes), time.Since(start).Round(time.Millisecond))
}

// runCell wins the cell's first token, runs the driver and reports each check as a
// subtest.
func runCell(t *testing.T, s *servers, path admissionPath, c *cell, run cellRunner) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c.fenced = !path.unfenced
	var held []holding
	defer func() {
		for _, h := range held {
			h.release()
		}
	}()
	if c.fenced {
		h, err := holder(ctx, s, path, c.resource, c.resource+"-first", 1)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, h)
		c.first = h
		c.takeover = func() (holding, error) {
			last := held[len(held)-1]
			last.release()
			next, err := holder(ctx, s, path, c.resource, c.resource+"-next", last.token+1)
			if err == nil {
				held = append(held, next)
			}
			return next, err
		}
	}
	started := time.Now()
	report, diag := run(ctx, c)
	results := map[string]string{} // check -> "" when ok, else why it failed
	var order []string
	for _, line := range strings.Split(report, "\n") {
		name, why, failed := strings.Cut(strings.TrimPrefix(line, "FAIL "), ": ")
		switch {
		case strings.HasPrefix(line, "ok "):
			name, why = strings.TrimPrefix(line, "ok "), ""
		case strings.HasPrefix(line, "FAIL ") && failed:
		default:
			continue
		}
		if _, seen := results[name]; !seen {
			order = append(order, name)
		}
		results[name] = why
	}
	want := append([]string(nil), matrixChecks...)
	if c.fenced {
		want = append(want, "stale token")
	}
	for _, name := range order {
		if !contains(want, name) {
			want = append(want, name)
		}
	}
	for _, name := range want {
		t.Run(name, func(t *testing.T) {
			why, reported := results[name]
			switch {
			case !reported:
				t.Errorf("not reported\nreport:\n%s\n%s", report, diag)
			case why != "":
				t.Errorf("%s\nreport:\n%s\n%s", why, report, diag)
			}
		})
	}
	t.Logf("%d checks in %v; %s", len(want), time.Since(started).Round(time.Millisecond), lineWith(report, "stale: "))
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// lineWith returns the first line of s that starts with prefix.
func lineWith(s, prefix string) string {
	for _, l := range strings.Split(s, "\n") {
		if strings.HasPrefix(l, prefix) {
			return l
		}
	}
	return ""
}

// pgxCell is pgx's program for a cell, in this process: the options startup parameter
// carries the token.
func pgxCell(ctx context.Context, c *cell) (string, string) {
	var report, diag strings.Builder
	check := func(name string, f func() error) {
		if err := f(); err != nil {
			fmt.Fprintf(&report, "FAIL %s: %v\n", name, err)
			return
		}
		fmt.Fprintf(&report, "ok %s\n", name)
	}
	connectAs := func(h holding) (*pgx.Conn, error) {
		params := []string{"sslmode=disable"}
		if c.tls {
			params = []string{"sslmode=verify-full", "sslrootcert=" + c.caFile}
		}
		cfg, err := pgx.ParseConfig(c.proxy.URL("app", "postgres", params...))
		if err != nil {
			return nil, err
		}
		if c.fenced {
			cfg.RuntimeParams["options"] = h.options(c.resource)
		}
		return pgx.ConnectConfig(ctx, cfg)
	}
	conn, err := connectAs(c.first)
	if err != nil {
		return "", "connect: " + err.Error()
	}
	defer conn.Close(context.Background())
	check("idle after connect", func() error {
		if st := conn.PgConn().TxStatus(); st != 'I' {
			return fmt.Errorf("transaction status %q", st)
		}
		return nil
	})
	check("rollback leaves nothing", func() error {
		tx, err := conn.Begin(ctx)
		if err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "CREATE TEMP TABLE t (id int PRIMARY KEY, tag text NOT NULL DEFAULT 'copied')"); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "INSERT INTO t VALUES (1, 'rolled back')"); err != nil {
			return err
		}
		if err := tx.Rollback(ctx); err != nil {
			return err
		}
		var left bool
		if err := conn.QueryRow(ctx, "SELECT to_regclass('pg_temp.t') IS NOT NULL").Scan(&left); err != nil || left {
			return fmt.Errorf("the rolled-back first transaction's table is left (%t, %v)", left, err)
		}
		return nil
	})
	check("transaction and savepoints", func() error { return pgxSavepoints(ctx, conn) })
	check("prepared statement", func() error {
		if _, err := conn.Prepare(ctx, "double", "SELECT $1::int * 2"); err != nil {
			return err
		}
		for i := 1; i <= 3; i++ {
			var d int
			if err := conn.QueryRow(ctx, "double", i).Scan(&d); err != nil || d != 2*i {
				return fmt.Errorf("double(%d) = %d, %v", i, d, err)
			}
		}
		return nil
	})
	check("copy in", func() error {
		var rows [][]any
		for i := 4; i <= 1000; i++ {
			rows = append(rows, []any{i})
		}
		n, err := conn.CopyFrom(ctx, pgx.Identifier{"t"}, []string{"id"}, pgx.CopyFromRows(rows))
		if err != nil || n != 997 {
			return fmt.Errorf("copied %d, %v", n, err)
		}
		return nil
	})
	check("copy out", func() error {
		var out bytes.Buffer
		if _, err := conn.PgConn().CopyTo(ctx, &out, "COPY (SELECT id, tag FROM t ORDER BY id) TO STDOUT"); err != nil {
			return err
		}
		if s := out.String(); strings.Count(s, "\n") != 999 || !strings.HasPrefix(s, "1\tkept\n3\tkept\n4\tcopied\n") {
			return fmt.Errorf("COPY out: %d lines, %.40q", strings.Count(s, "\n"), s)
		}
		return nil
	})
	other, err := connectAs(c.first)
	if err != nil {
		return report.String(), "connect the other session: " + err.Error()
	}
	defer other.Close(context.Background())
	check("listen notify", func() error {
		channel := "chan_" + c.resource // the cell's own: cells run side by side in one database
		if _, err := conn.Exec(ctx, "LISTEN "+channel); err != nil {
			return err
		}
		if _, err := other.Exec(ctx, "NOTIFY "+channel+", 'hello from pgx'"); err != nil {
			return err
		}
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		n, err := conn.WaitForNotification(wctx)
		if err != nil || n.Channel != channel || n.Payload != "hello from pgx" {
			return fmt.Errorf("notification %+v, %v", n, err)
		}
		return nil
	})
	check("cancel", func() error { return pgxCancel(ctx, conn, other) })
	if c.fenced {
		check("stale token", func() error {
			h, err := c.takeover()
			if err != nil {
				return err
			}
			higher, err := connectAs(h)
			if err != nil {
				return fmt.Errorf("the new holder: %w", err)
			}
			defer higher.Close(context.Background())
			if _, err := higher.Exec(ctx, "SELECT 1"); err != nil {
				return fmt.Errorf("the new holder: %w", err)
			}
			_, err = conn.Exec(ctx, "SELECT 1")
			pe := pgErrorOf(err)
			if pe == nil || pe.Code != fence.CodeStale {
				return fmt.Errorf("want a *pgconn.PgError %s, got %T %v", fence.CodeStale, err, err)
			}
			fmt.Fprintf(&report, "stale: %T %s %s\n", pe, pe.Code, pe.Message)
			return nil
		})
	}
	return report.String(), diag.String()
}

// pgxSavepoints: a block with a savepoint rolled back to (pgx's nested transaction), and
// an error that aborts a block.
func pgxSavepoints(ctx context.Context, conn *pgx.Conn) error {
	for _, sql := range []string{"DROP TABLE IF EXISTS pg_temp.t", "CREATE TEMP TABLE t (id int PRIMARY KEY, tag text NOT NULL DEFAULT 'copied')"} {
		if _, err := conn.Exec(ctx, sql); err != nil {
			return err
		}
	}
	err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "INSERT INTO t VALUES (1, 'kept')"); err != nil {
			return err
		}
		sp, err := tx.Begin(ctx)
		if err != nil {
			return err
		}
		if _, err := sp.Exec(ctx, "INSERT INTO t VALUES (2, 'undone')"); err != nil {
			return err
		}
		if err := sp.Rollback(ctx); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, "INSERT INTO t VALUES ($1, $2)", 3, "kept")
		return err
	})
	if err != nil {
		return err
	}
	err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "SELECT 1/0")
		return err
	})
	if sqlstate(err) != "22012" {
		return fmt.Errorf("division by zero: %v", err)
	}
	var ids string
	if err := conn.QueryRow(ctx, "SELECT string_agg(id::text, ',' ORDER BY id) FROM t").Scan(&ids); err != nil || ids != "1,3" {
		return fmt.Errorf("rows %q, %v", ids, err)
	}
	return nil
}

// pgxCancel sends a CancelRequest once conn's pg_sleep runs (one for an idle backend
// cancels nothing) and wants 57014.
func pgxCancel(ctx context.Context, conn, other *pgx.Conn) error {
	pid := int32(conn.PgConn().PID())
	cancelled := make(chan error, 1)
	go func() {
		deadline := time.Now().Add(30 * time.Second)
		for time.Now().Before(deadline) {
			var n int
			err := other.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND state = 'active' AND query LIKE '%pg_sleep%'", pid).Scan(&n)
			if err != nil {
				cancelled <- err
				return
			}
			if n == 1 {
				cancelled <- conn.PgConn().CancelRequest(ctx)
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
		cancelled <- errors.New("pg_sleep never seen running")
	}()
	_, err := conn.Exec(ctx, "SELECT pg_sleep(60)")
	if cerr := <-cancelled; cerr != nil {
		return fmt.Errorf("cancel request: %w", cerr)
	}
	if sqlstate(err) != "57014" {
		return fmt.Errorf("want 57014, got %v", err)
	}
	return nil
}
