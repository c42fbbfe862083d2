package proxy_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxy/guards"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// ctxLong is ctxT for the 100 MB transfers: under -race on two loaded cores one took 65 s
// (CI), and their point is the bytes, not the time.
func ctxLong(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func connect(t *testing.T, url string) *pgx.Conn { return testenv.Connect(t, url) }

func connectErr(url string) error { return connectErrWithin(20*time.Second, url) }

// connectErrWithin is connectErr with the client's own timeout d.
func connectErrWithin(d time.Duration, url string) error {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err == nil {
		conn.Close(ctx)
	}
	return err
}

// sqlstate is the one way the tests read a SQLSTATE: that of err's error from the server or
// the proxy, as pgx reports it (*pgconn.PgError) or as a wireSession's startup does
// (*serverError); "" if err carries none.
func sqlstate(err error) string {
	if pe := pgErrorOf(err); pe != nil {
		return pe.Code
	}
	var se *serverError
	if errors.As(err, &se) {
		return se.resp.Code
	}
	return ""
}

// pgErrorOf returns err's *pgconn.PgError (severity, message, hint...), nil if none.
func pgErrorOf(err error) *pgconn.PgError {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe
	}
	return nil
}

func wantCode(t *testing.T, err error, code string) {
	t.Helper()
	if err == nil {
		t.Fatalf("want SQLSTATE %s, got success", code)
	}
	if got := sqlstate(err); got != code {
		t.Fatalf("want SQLSTATE %s, got %q: %v", code, got, err)
	}
}

func wantStale(t *testing.T, err error) {
	t.Helper()
	wantCode(t, err, fence.CodeStale)
	if !strings.Contains(err.Error(), "stale fencing token") {
		t.Fatalf("message %q does not begin with 'stale fencing token'", err)
	}
}

// querier is a *pgx.Conn or a *pgxpool.Pool.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

func mustExec(t *testing.T, conn querier, sql string, args ...any) {
	t.Helper()
	if _, err := conn.Exec(ctxT(t), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

func count(t *testing.T, conn querier, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := conn.QueryRow(ctxT(t), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// fencedDB starts PostgreSQL with the fence schema and the proxy key
// (testenv.Key, which testenv.StartProxy uses), an application role
// "app" and a table "items", and returns the cluster and an admin connection.
func fencedDB(t *testing.T, opts ...testenv.PGOption) (*testenv.Postgres, *pgxpool.Pool) {
	t.Helper()
	pg := testenv.StartPostgres(t, opts...)
	testenv.Migrate(t, pg.AdminURL())
	admin, err := pgxpool.New(ctxT(t), pg.AdminURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(admin.Close)
	pg.CreateRole(t, "app", "app")
	mustExec(t, admin, `CREATE TABLE items (id bigserial PRIMARY KEY, tag text NOT NULL, token bigint)`)
	mustExec(t, admin, `GRANT ALL ON items, items_id_seq TO app`)
	mustExec(t, admin, `GRANT CREATE ON SCHEMA public TO app`)
	return pg, admin
}

func fencedProxy(t *testing.T, pg *testenv.Postgres, mod ...func(*proxy.Config)) *testenv.Proxy {
	cfg := proxy.Config{Resources: []string{"billing", "other"}}
	for _, m := range mod {
		m(&cfg)
	}
	return testenv.StartProxy(t, pg, cfg)
}

func bytesReader(b []byte) *bytes.Reader { return bytes.NewReader(b) }

// wantSessionOver checks that a fenced session that was just told code (a
// stale or blocked session) is over: the proxy answers the unit the client
// waited for with an ERROR and a ReadyForQuery (an idle client gets a FATAL at
// once), keeps the connection for the client's next unit, answers that one
// with the error again and closes. So each further statement fails, with code
// or as a closed connection, and the connection ends within a few of them.
func wantSessionOver(t *testing.T, conn *pgx.Conn, code string) {
	t.Helper()
	for i := 0; i < 3 && !conn.IsClosed(); i++ {
		_, err := conn.Exec(ctxT(t), "SELECT 1", pgx.QueryExecModeSimpleProtocol)
		if err == nil {
			t.Fatalf("statement %d after the session ended succeeded", i+1)
		}
		if pe := pgErrorOf(err); pe != nil && pe.Code != code {
			t.Fatalf("statement %d after the session ended: want SQLSTATE %s or a closed connection, got %v", i+1, code, err)
		}
	}
	if !conn.IsClosed() {
		t.Fatal("the ended session's connection is still open after three statements")
	}
}

// metricValue is the value (counter or gauge) of reg's metric name whose labels include want,
// and whether there is one.
func metricValue(t *testing.T, reg *prometheus.Registry, name string, want map[string]string) (float64, bool) {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			match := true
			for k, v := range want {
				match = match && labels[k] == v
			}
			if match {
				return m.GetCounter().GetValue() + m.GetGauge().GetValue(), true
			}
		}
	}
	return 0, false
}

// pollEvery is how often eventually asks again (what the most used of the helpers it
// replaced asked at: a condition may open a session through a proxy each time).
const pollEvery = 50 * time.Millisecond

// eventually is the one way the tests wait for a condition: it calls cond until cond
// returns nil, every pollEvery, and fails the test once within has passed, with what and
// cond's last error (what was still wrong). cond may itself fail the test on an error that
// waiting cannot cure. Give within room: the machine may be loaded (a wait's timeout is how
// long a failing test takes to say so, not what a test asserts, unless its comment says so).
func eventually(t testing.TB, within time.Duration, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s; last: %v", what, within, err)
		}
		time.Sleep(pollEvery)
	}
}

// storedToken is the token stored in fence.tokens for res (0: none).
func storedToken(t *testing.T, admin querier, res string) int64 {
	t.Helper()
	var tok int64
	err := admin.QueryRow(ctxT(t), `SELECT coalesce((SELECT token FROM fence.tokens WHERE resource = $1), 0)`, res).Scan(&tok)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// lockGuard is cfg's one LockGuard (etcd's or ZooKeeper's), built as fenceproxy serve builds
// it.
func lockGuard(ctx context.Context, cfg proxy.Config, opts proxy.LockGuardOptions) (*proxy.LockGuard, error) {
	gs, err := guards.Lock(ctx, cfg, opts)
	if err != nil {
		return nil, err
	}
	if len(gs) != 1 {
		return nil, fmt.Errorf("%d lock guards, want 1", len(gs))
	}
	return gs[0], nil
}
