package bench

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// RaiseSample is one raise as its client sees it: a new session with token t+1 connects
// through the proxy while N sessions with token t are open (every other one idle in a
// transaction with an uncommitted INSERT); its bind raises the token, which ends the N
// backends and waits until each has exited before it commits.
type RaiseSample struct {
	Round, Stale int
	Token        int64
	Raise        time.Duration // from the dial until ReadyForQuery, the raise included
	Plain        time.Duration // the same connect again: a bind with nothing to raise
	ZF001, Other int           // stale sessions ended, told ZF001 or otherwise
	Survived     int           // stale sessions whose next statement succeeded: a failure
	Committed    int           // their probe rows committed: a failure
	Alive        int           // backends bound below t+1 still listed: a failure
	OtherCodes   string
}

// Failed reports whether a stale session outlived the raise or committed.
func (r RaiseSample) Failed() bool { return r.Survived > 0 || r.Committed > 0 || r.Alive > 0 }

// raiseTimeout bounds each connect and check of the raise measurement.
const raiseTimeout = 30 * time.Second

// raise measures one sample per number of stale sessions in counts, RaiseSamples times, and
// checks the guarantee after each.
func (e *env) raise(ctx context.Context, round int, counts []int) ([]RaiseSample, error) {
	direct, err := connect(ctx, e.directURL())
	if err != nil {
		return nil, fmt.Errorf("connect straight to PostgreSQL: %w", err)
	}
	defer direct.Close(context.Background())
	if round == 1 {
		if err := execAll(ctx, direct, "CREATE TABLE IF NOT EXISTS bench_raise_probe (token bigint NOT NULL, pid integer NOT NULL)"); err != nil {
			return nil, err
		}
		// One unmeasured connect first: the first connection of a process pays for what the
		// next ones reuse.
		warm, err := connect(ctx, e.fencedURL(raiseResource, 1))
		if err != nil {
			return nil, fmt.Errorf("warm-up connect: %w", err)
		}
		warm.Close(ctx)
	}
	var out []RaiseSample
	var failed []error
	for _, n := range counts {
		for range e.cfg.RaiseSamples {
			r, err := e.raiseSample(ctx, direct, n)
			if err != nil {
				return out, fmt.Errorf("%d stale session(s): %w", n, err)
			}
			r.Round = round
			status := "ok"
			if r.Failed() {
				status = "FAILED"
				failed = append(failed, fmt.Errorf("%d stale session(s): %d survived, %d committed, %d alive", n, r.Survived, r.Committed, r.Alive))
			}
			e.say("round %d  raise stale=%d token=%d raise_ms=%.3f plain_ms=%.3f ended_zf001=%d ended_other=%d %s %s",
				round, n, r.Token, ms(r.Raise), ms(r.Plain), r.ZF001, r.Other, status, r.OtherCodes)
			out = append(out, r)
		}
	}
	return out, errors.Join(failed...)
}

func (e *env) raiseSample(ctx context.Context, direct *pgconn.PgConn, n int) (RaiseSample, error) {
	stored, err := queryInt(ctx, direct, "SELECT coalesce(max(token), 1) FROM fence.tokens WHERE resource = '"+raiseResource+"'")
	if err != nil {
		return RaiseSample{}, fmt.Errorf("read the stored token: %w", err)
	}
	old, next := stored+1, stored+2
	r := RaiseSample{Stale: n, Token: next}

	// 1. The stale sessions: the first admits token old, the others bind to it.
	stale := make([]*pgconn.PgConn, 0, n)
	defer func() {
		for _, c := range stale {
			c.Close(context.Background())
		}
	}()
	inTx := func(i int) bool { return i%2 == 0 }
	for i := range n {
		c, err := connect(ctx, e.fencedURL(raiseResource, old))
		if err != nil {
			return r, fmt.Errorf("stale session %d of %d (token %d): %w", i+1, n, old, err)
		}
		stale = append(stale, c)
		q := "SELECT 1"
		if inTx(i) {
			q = fmt.Sprintf("BEGIN; INSERT INTO bench_raise_probe VALUES (%d, pg_backend_pid())", old)
		}
		if err := execAll(ctx, c, q); err != nil {
			return r, fmt.Errorf("stale session %d: %w", i+1, err)
		}
	}

	// 2. The raise, as the new leader's connect; 3. the same connect again.
	for _, d := range []*time.Duration{&r.Raise, &r.Plain} {
		start := time.Now()
		c, err := connect(ctx, e.fencedURL(raiseResource, next))
		*d = time.Since(start)
		if err != nil {
			return r, fmt.Errorf("connect with token %d: %w", next, err)
		}
		c.Close(ctx)
	}

	// 4. The checks: every stale session's next statement must fail, none of their rows may
	// be committed, no backend bound below next may be alive.
	others := map[string]int{}
	for i, c := range stale {
		q := "SELECT 1"
		if inTx(i) {
			q = "COMMIT"
		}
		err := execAll(ctx, c, q)
		var pgErr *pgconn.PgError
		switch {
		case err == nil:
			r.Survived++
		case errors.As(err, &pgErr) && pgErr.Code == "ZF001":
			r.ZF001++
		default:
			r.Other++
			code := "no SQLSTATE"
			if errors.As(err, &pgErr) {
				code = pgErr.Code
			}
			others[code]++
		}
	}
	for _, k := range slices.Sorted(maps.Keys(others)) {
		r.OtherCodes += fmt.Sprintf("%s x%d; ", k, others[k])
	}
	committed, err := queryInt(ctx, direct, fmt.Sprintf("SELECT count(*) FROM bench_raise_probe WHERE token = %d", old))
	if err != nil {
		return r, fmt.Errorf("count the probe rows: %w", err)
	}
	alive, err := queryInt(ctx, direct, fmt.Sprintf(`SELECT count(*) FROM fence.bindings AS b
		JOIN pg_stat_activity AS a ON a.pid = b.pid AND a.backend_start = b.backend_start
		WHERE b.resource = '%s' AND b.token < %d`, raiseResource, next))
	if err != nil {
		return r, fmt.Errorf("count the live stale backends: %w", err)
	}
	r.Committed, r.Alive = int(committed), int(alive)
	return r, nil
}

// fencedURL reaches the bench database through the proxy with a fencing token (pgx sends
// unknown URL parameters as startup parameters).
func (e *env) fencedURL(res string, tok int64) string {
	return e.targetURL(Unfenced, "fence.resource="+res, "fence.token="+strconv.FormatInt(tok, 10))
}

// targetURL reaches the bench database through target t.
func (e *env) targetURL(t string, params ...string) string {
	if t == Fenced {
		params = append(params, "options="+fenceOptions)
	}
	q := url.Values{"sslmode": {"disable"}}
	for _, kv := range params {
		k, v, _ := strings.Cut(kv, "=")
		q.Set(k, v)
	}
	u := url.URL{Scheme: "postgres", User: url.User(testenv.AdminUser), Host: "127.0.0.1:" + strconv.Itoa(e.port(t)), Path: "/" + database,
		// libpq and pgx decode %XX but read '+' literally: spaces must be %20.
		RawQuery: strings.ReplaceAll(q.Encode(), "+", "%20")}
	return u.String()
}

func connect(ctx context.Context, connString string) (*pgconn.PgConn, error) {
	ctx, cancel := context.WithTimeout(ctx, raiseTimeout)
	defer cancel()
	return pgconn.Connect(ctx, connString)
}

func execAll(ctx context.Context, c *pgconn.PgConn, sql string) error {
	ctx, cancel := context.WithTimeout(ctx, raiseTimeout)
	defer cancel()
	_, err := c.Exec(ctx, sql).ReadAll()
	return err
}

func queryInt(ctx context.Context, c *pgconn.PgConn, sql string) (int64, error) {
	ctx, cancel := context.WithTimeout(ctx, raiseTimeout)
	defer cancel()
	res, err := c.Exec(ctx, sql).ReadAll()
	if err != nil {
		return 0, err
	}
	if len(res) != 1 || len(res[0].Rows) != 1 || len(res[0].Rows[0]) != 1 {
		return 0, fmt.Errorf("%s: want one value", sql)
	}
	return strconv.ParseInt(string(res[0].Rows[0][0]), 10, 64)
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// idle opens IdleSessions sessions through t, 8 at a time, waits IdleSettle with all of them
// open and idle, and reads how much the middleman's resident set grew.
func (e *env) idle(ctx context.Context, t string) (IdleResult, error) {
	r := IdleResult{Target: t, Sessions: e.cfg.IdleSessions}
	pid := e.middleman(t)
	var err error
	if r.BeforeKiB, err = StatusKiB(pid, "VmRSS"); err != nil {
		return r, err
	}
	conns := make([]*pgconn.PgConn, r.Sessions)
	errs := make([]error, r.Sessions)
	defer func() {
		for _, c := range conns {
			if c != nil {
				c.Close(context.Background())
			}
		}
	}()
	next := make(chan int)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for i := range next {
				conns[i], errs[i] = connect(ctx, e.targetURL(t))
			}
		})
	}
	for i := range r.Sessions {
		next <- i
	}
	close(next)
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return r, err
	}
	select {
	case <-ctx.Done():
		return r, ctx.Err()
	case <-time.After(e.cfg.IdleSettle):
	}
	r.AfterK, err = StatusKiB(pid, "VmRSS")
	return r, err
}
