package proxy_test

import (
	"context"
	"fmt"
	"net"
	"runtime/debug"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// ---------------------------------------------------------------------
// Runs in goroutines: the regression runs and the generated sequences run
// many at a time (most of their time is spent waiting: proxy A holds a
// terminated session's error for a second before it relays it), so they
// cannot be parallel subtests (-parallel is GOMAXPROCS, 2 on CI). A run
// records its failures and aborts with fatalf; the test reports them.

type parallelRun struct {
	name  string
	mu    sync.Mutex
	fails []string
	logs  []string
}

type runAborted struct{}

func (r *parallelRun) fatalf(format string, args ...any) {
	r.errorf(format, args...)
	panic(runAborted{})
}

func (r *parallelRun) errorf(format string, args ...any) {
	r.mu.Lock()
	r.fails = append(r.fails, fmt.Sprintf(format, args...))
	r.mu.Unlock()
}

func (r *parallelRun) logf(format string, args ...any) {
	r.mu.Lock()
	r.logs = append(r.logs, fmt.Sprintf(format, args...))
	r.mu.Unlock()
}

// runParallel runs fn(i, runs[i]) for every run, at most parallel at a time, and
// waits.
func runParallel(parallel int, runs []*parallelRun, fn func(i int, r *parallelRun)) {
	sem := make(chan struct{}, parallel)
	var wg sync.WaitGroup
	for i, r := range runs {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			defer func() {
				if p := recover(); p != nil {
					if _, ok := p.(runAborted); !ok {
						r.errorf("panic: %v\n%s", p, debug.Stack())
					}
				}
			}()
			fn(i, r)
		}()
	}
	wg.Wait()
}

// report turns a run's record into a subtest's result.
func (r *parallelRun) report(t *testing.T) {
	t.Helper()
	for _, l := range r.logs {
		t.Log(l)
	}
	for _, f := range r.fails {
		t.Error(f)
	}
}

// ---------------------------------------------------------------------
// The environment: one cluster, the fence schema with testenv.Key, a
// non-superuser role "app", and three proxy instances.

type staleEnv struct {
	pg    *testenv.Postgres
	admin *pgxpool.Pool // the superuser, database postgres
	a     *testenv.Proxy
	ah    *testenv.Proxy
	b     *testenv.Proxy
}

// staleEnvSchema is what every v2 test database holds: the stale rows' table, and
// functions that write them from inside a query (the held cursors'), wait on
// an advisory lock the test holds (the in-flight variants), or commit inside
// a procedure. Owned by the superuser, run as the caller (not SECURITY
// DEFINER).
const staleEnvSchema = `
CREATE TABLE public.v2_rows (id bigserial PRIMARY KEY, resource text NOT NULL, token bigint NOT NULL, tag text NOT NULL);
GRANT ALL ON public.v2_rows, public.v2_rows_id_seq TO app;
GRANT CREATE ON SCHEMA public TO app;
CREATE FUNCTION public.v2_write(res text, tok bigint, tag text) RETURNS int LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    INSERT INTO public.v2_rows (resource, token, tag) VALUES (res, tok, tag);
    RETURN 1;
END $$;
CREATE FUNCTION public.v2_wait(k bigint) RETURNS int LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_catalog.pg_advisory_lock_shared(k);
    PERFORM pg_catalog.pg_advisory_unlock_shared(k);
    RETURN 1;
END $$;
CREATE FUNCTION public.v2_write_wait(res text, tok bigint, tag text, k bigint) RETURNS int LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM public.v2_write(res, tok, tag);
    PERFORM public.v2_wait(k);
    RETURN 1;
END $$;
CREATE PROCEDURE public.v2_proc(res text, tok bigint, k bigint) LANGUAGE plpgsql AS $$
BEGIN
    PERFORM public.v2_write(res, tok, 'procedure 1');
    COMMIT;
    PERFORM public.v2_write(res, tok, 'procedure 2');
    PERFORM public.v2_wait(k);
    COMMIT;
END $$;
`

func ctxEnv(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// startStaleEnv starts the cluster (track_commit_timestamp on, plus opts), the
// schema and the proxies A, AH (with the database as its control database:
// it listens for raises there and asks whether a raise ended a backend) and
// B, each fencing resources.
func startStaleEnv(t *testing.T, resources []string, opts ...testenv.PGOption) *staleEnv {
	t.Helper()
	return startStaleEnvOwner(t, resources, "", opts...)
}

// startStaleEnvOwner is startStaleEnv with the fence schema migrated by owner, a
// role created with only what the schema's functions need (pg_signal_backend,
// pg_read_all_stats, CREATE on the database); "": the superuser.
func startStaleEnvOwner(t *testing.T, resources []string, owner string, opts ...testenv.PGOption) *staleEnv {
	t.Helper()
	pg := testenv.StartPostgres(t, append([]testenv.PGOption{testenv.WithConf("track_commit_timestamp", "on")}, opts...)...)
	migrateURL := pg.AdminURL()
	if owner != "" {
		pg.CreateRole(t, owner, owner)
		pg.Exec(t, fmt.Sprintf("GRANT pg_signal_backend, pg_read_all_stats TO %[1]s; GRANT CREATE ON DATABASE postgres TO %[1]s", owner))
		migrateURL = pg.URLWithPassword(owner, owner, "postgres")
	}
	testenv.Migrate(t, migrateURL)
	pg.CreateRole(t, "app", "app")
	admin := newPool(t, pg.AdminURL())
	if _, err := admin.Exec(ctxEnv(t), staleEnvSchema, pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatalf("setup: %v", err)
	}
	e := &staleEnv{pg: pg, admin: admin}
	cfg := proxy.Config{Resources: resources}
	e.a = testenv.StartProxy(t, pg, cfg)
	cfgH := cfg
	cfgH.ControlDatabase = pg.AdminURL()
	e.ah = testenv.StartProxy(t, pg, cfgH)
	e.b = testenv.StartProxy(t, pg, cfg)
	return e
}

// newPool is a pool of up to 64 connections to url: the runs hold advisory
// locks on some while they query on others.
func newPool(t *testing.T, url string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 64
	pool, err := pgxpool.NewWithConfig(ctxEnv(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func addrOf(host string, port int) string { return net.JoinHostPort(host, strconv.Itoa(port)) }

// fenceParams are the startup parameters of an app session of db, fenced with
// (res, tok) unless res is "".
func fenceParams(db, res string, tok int64, extra ...string) map[string]string {
	p := map[string]string{"user": "app", "database": db}
	if res != "" {
		p["fence.resource"] = res
		p["fence.token"] = strconv.FormatInt(tok, 10)
	}
	for i := 0; i+1 < len(extra); i += 2 {
		p[extra[i]] = extra[i+1]
	}
	return p
}

// raise admits tok for res in db: a new leader connects through proxy B.
// It returns once the raise has committed (the bind runs before
// ReadyForQuery).
func (e *staleEnv) raise(ctx context.Context, db, res string, tok int64) error {
	conn, err := pgx.Connect(ctx, e.b.FenceURL("app", db, res, tok))
	if err != nil {
		return err
	}
	return conn.Close(ctx)
}

// backendAlive reports whether the backend (pid, started) is still listed.
func backendAlive(ctx context.Context, admin *pgxpool.Pool, pid uint32, started time.Time) (bool, error) {
	var n int
	err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND backend_start = $2`, int32(pid), started).Scan(&n)
	return n > 0, err
}

func backendStart(ctx context.Context, admin *pgxpool.Pool, pid uint32) (time.Time, error) {
	var t time.Time
	err := admin.QueryRow(ctx, `SELECT backend_start FROM pg_stat_activity WHERE pid = $1`, int32(pid)).Scan(&t)
	return t, err
}

// staleRows counts the rows that rowsSQL lists (one xid column: the xmin
// of every stale row; $1 is the resource), and those of them whose commit
// timestamp is after the commit of the resource's current token.
func staleRows(ctx context.Context, admin *pgxpool.Pool, rowsSQL, res string) (total, after int, err error) {
	q := `SELECT count(*), count(*) FILTER (WHERE pg_xact_commit_timestamp(s.x) >
	          (SELECT pg_xact_commit_timestamp(t.xmin) FROM fence.tokens AS t WHERE t.resource = $1))
	      FROM (` + rowsSQL + `) AS s(x)`
	err = admin.QueryRow(ctx, q, res).Scan(&total, &after)
	return total, after, err
}

const defaultStaleRows = `SELECT xmin FROM public.v2_rows WHERE resource = $1`
