// Command raise measures how long a raise takes as its client sees it: the time a new session
// with a higher fencing token needs to connect through fenceproxy until it is ready (the
// proxy's bind raises the token, which ends every backend bound to a lower one and waits until
// each has exited before it commits), with 0, 1, 10, 100 ... stale sessions open. bench/bench.sh
// runs it between its pgbench rounds; it can run on its own against any proxy:
//
//	go run ./bench/raise -proxy 'postgres://postgres@127.0.0.1:6432/bench?sslmode=disable' \
//	    -direct 'postgres://postgres@127.0.0.1:5432/bench?sslmode=disable' -resource raise \
//	    -stale 0,1,10,100 -samples 3
//
// After one unmeasured connect (the first connection of a process pays for what later ones
// reuse), one sample with N stale sessions, for the next free token t of the resource:
//
//  1. open N sessions through the proxy with token t (the first one admits t); every other
//     one (half, rounded up) starts a transaction with an uncommitted INSERT into
//     bench_raise_probe and stays idle in it, the others stay idle in autocommit;
//  2. time pgconn.Connect of a session with token t+1 through the proxy, from the dial until
//     ReadyForQuery (what `raise_ms` reports); the proxy binds it before that, and the bind
//     raises the token: it ends the N backends and waits for them;
//  3. time a second connect with token t+1, a bind with nothing to raise (`plain_ms`, the
//     baseline of the same client code);
//  4. check the guarantee: every stale session's next statement (COMMIT in the ones with an
//     open transaction) must fail, none of their probe rows may be committed, and no backend
//     bound to a token below t+1 may be alive (pg_stat_activity, on -direct).
//
// It prints one line per sample, "raise stale=N sample=I token=T raise_ms=X plain_ms=Y
// ended_zf001=A ended_other=B survived=C committed=D alive=E" (E: backends bound below t+1
// still listed), and exits 1 when a check fails (the
// lines still say which). Needs max_connections above the largest N plus a few.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"maps"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

func main() {
	proxyURL := flag.String("proxy", "", "URL of the database through fenceproxy (its fenced sessions are bound)")
	directURL := flag.String("direct", "", "URL of the same database straight on PostgreSQL (setup and checks)")
	resource := flag.String("resource", "raise", "fenced resource to raise (one the proxy serves; keep it apart from other benchmarks: every sample raises it)")
	staleList := flag.String("stale", "0,1,10,100", "numbers of stale sessions, comma-separated, in the order to measure them")
	samples := flag.Int("samples", 3, "samples per number of stale sessions")
	timeout := flag.Duration("timeout", 30*time.Second, "time allowed for each connect and check")
	flag.Parse()
	if *proxyURL == "" || *directURL == "" || *samples < 1 {
		fmt.Fprintln(os.Stderr, "raise: -proxy and -direct are required, -samples must be at least 1")
		flag.Usage()
		os.Exit(2)
	}
	var counts []int
	for _, f := range strings.Split(*staleList, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 0 {
			fatalf("-stale: %q is not a number of sessions", f)
		}
		counts = append(counts, n)
	}

	ctx := context.Background()
	direct, err := connect(ctx, *timeout, *directURL)
	if err != nil {
		fatalf("connect -direct: %v", err)
	}
	defer direct.Close(ctx)
	if _, err := exec(ctx, direct, "CREATE TABLE IF NOT EXISTS bench_raise_probe (token bigint NOT NULL, pid integer NOT NULL); GRANT INSERT ON bench_raise_probe TO PUBLIC"); err != nil {
		fatalf("create bench_raise_probe: %v", err)
	}

	// One unmeasured connect first (a bind at the stored token, or token 1 if none is stored):
	// the first connection of a process pays for what the next ones reuse.
	stored, err := queryInt(ctx, direct, fmt.Sprintf("SELECT coalesce(max(token), 1) FROM fence.tokens WHERE resource = '%s'", *resource))
	if err != nil {
		fatalf("read the stored token: %v", err)
	}
	warm, err := connect(ctx, *timeout, fenced(*proxyURL, *resource, stored))
	if err != nil {
		fatalf("warm-up connect with token %d: %v", stored, err)
	}
	warm.Close(ctx)

	failed := false
	for _, n := range counts {
		for i := 1; i <= *samples; i++ {
			r, err := sample(ctx, *timeout, direct, *proxyURL, *resource, n)
			if err != nil {
				fatalf("%d stale session(s), sample %d: %v", n, i, err)
			}
			bad := r.survived > 0 || r.committed > 0 || r.alive > 0
			failed = failed || bad
			fmt.Printf("raise stale=%d sample=%d token=%d raise_ms=%.3f plain_ms=%.3f ended_zf001=%d ended_other=%d survived=%d committed=%d alive=%d%s\n",
				n, i, r.token, ms(r.raise), ms(r.plain), r.zf001, r.other, r.survived, r.committed, r.alive,
				map[bool]string{true: " FAILED", false: ""}[bad])
			if r.otherCodes != "" {
				fmt.Printf("raise   stale sessions ended otherwise: %s\n", r.otherCodes)
			}
		}
	}
	if failed {
		fmt.Fprintln(os.Stderr, "raise: FAILED: a stale session outlived the raise or committed")
		os.Exit(1)
	}
}

type result struct {
	token                  int64
	raise, plain           time.Duration
	zf001, other, survived int
	committed, alive       int
	otherCodes             string
}

func sample(ctx context.Context, timeout time.Duration, direct *pgconn.PgConn, proxyURL, resource string, n int) (*result, error) {
	stored, err := queryInt(ctx, direct, fmt.Sprintf("SELECT coalesce(max(token), 0) FROM fence.tokens WHERE resource = '%s'", resource))
	if err != nil {
		return nil, fmt.Errorf("read the stored token: %w", err)
	}
	old, next := stored+1, stored+2
	r := &result{token: next}

	// 1. The stale sessions.
	stale := make([]*pgconn.PgConn, 0, n)
	defer func() {
		for _, c := range stale {
			c.Close(ctx)
		}
	}()
	inTx := func(i int) bool { return i%2 == 0 }
	for i := 0; i < n; i++ {
		c, err := connect(ctx, timeout, fenced(proxyURL, resource, old))
		if err != nil {
			return nil, fmt.Errorf("stale session %d of %d (token %d): %w", i+1, n, old, err)
		}
		stale = append(stale, c)
		q := "SELECT 1"
		if inTx(i) {
			q = fmt.Sprintf("BEGIN; INSERT INTO bench_raise_probe VALUES (%d, pg_backend_pid())", old)
		}
		if _, err := exec(ctx, c, q); err != nil {
			return nil, fmt.Errorf("stale session %d: %s: %w", i+1, q, err)
		}
	}

	// 2. The raise, as the new leader's connect.
	cfg, err := pgconn.ParseConfig(fenced(proxyURL, resource, next))
	if err != nil {
		return nil, err
	}
	cctx, cancel := context.WithTimeout(ctx, timeout)
	start := time.Now()
	leader, err := pgconn.ConnectConfig(cctx, cfg)
	r.raise = time.Since(start)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("connect with token %d: %w", next, err)
	}
	leader.Close(ctx)

	// 3. The same connect again: a bind with nothing to raise.
	cctx, cancel = context.WithTimeout(ctx, timeout)
	start = time.Now()
	again, err := pgconn.ConnectConfig(cctx, cfg)
	r.plain = time.Since(start)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("second connect with token %d: %w", next, err)
	}
	again.Close(ctx)

	// 4. The checks.
	others := map[string]int{}
	for i, c := range stale {
		q := "SELECT 1"
		if inTx(i) {
			q = "COMMIT"
		}
		_, err := exec(ctx, c, q)
		var pgErr *pgconn.PgError
		switch {
		case err == nil:
			r.survived++
		case errors.As(err, &pgErr) && pgErr.Code == "ZF001":
			r.zf001++
		default:
			r.other++
			code := "no SQLSTATE: " + err.Error()
			if errors.As(err, &pgErr) {
				code = pgErr.Code
			}
			others[code]++
		}
	}
	for _, k := range slices.Sorted(maps.Keys(others)) {
		r.otherCodes += fmt.Sprintf("%q x%d; ", k, others[k])
	}
	committed, err := queryInt(ctx, direct, fmt.Sprintf("SELECT count(*) FROM bench_raise_probe WHERE token = %d", old))
	if err != nil {
		return nil, fmt.Errorf("count the probe rows: %w", err)
	}
	r.committed = int(committed)
	alive, err := queryInt(ctx, direct, fmt.Sprintf(`SELECT count(*) FROM fence.bindings AS b
		JOIN pg_stat_activity AS a ON a.pid = b.pid AND a.backend_start = b.backend_start
		WHERE b.resource = '%s' AND b.token < %d`, resource, next))
	if err != nil {
		return nil, fmt.Errorf("count the live stale backends: %w", err)
	}
	r.alive = int(alive)
	return r, nil
}

// fenced is base with the fence startup parameters (pgx sends unknown URL parameters as
// startup parameters).
func fenced(base, resource string, token int64) string {
	u, err := url.Parse(base)
	if err != nil {
		fatalf("-proxy: %v", err)
	}
	q := u.Query()
	q.Set("fence.resource", resource)
	q.Set("fence.token", strconv.FormatInt(token, 10))
	u.RawQuery = q.Encode()
	return u.String()
}

func connect(ctx context.Context, timeout time.Duration, connString string) (*pgconn.PgConn, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	return pgconn.Connect(ctx, connString)
}

func exec(ctx context.Context, c *pgconn.PgConn, sql string) ([]*pgconn.Result, error) {
	return c.Exec(ctx, sql).ReadAll()
}

func queryInt(ctx context.Context, c *pgconn.PgConn, sql string) (int64, error) {
	res, err := exec(ctx, c, sql)
	if err != nil {
		return 0, err
	}
	if len(res) != 1 || len(res[0].Rows) != 1 || len(res[0].Rows[0]) != 1 {
		return 0, fmt.Errorf("%s: want one value", sql)
	}
	return strconv.ParseInt(string(res[0].Rows[0][0]), 10, 64)
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func fatalf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "raise: "+format+"\n", args...)
	os.Exit(1)
}
