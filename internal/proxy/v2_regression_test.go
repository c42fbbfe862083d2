package proxy_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"reflect"
	"regexp"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// Regression tests of fencing v2 (issue 10): every message sequence that
// committed a stale row under v1 (DESIGN.md, "Mechanism v2"), replayed against
// v2 the way a late leader would: the stale session (token t, through proxy A)
// drives the sequence up to just before its commit point, a new leader
// connects with t+1 through proxy B (another instance, with its own registry:
// A hears nothing of the raise), then the stale session completes the
// sequence. Asserted, by querying PostgreSQL directly as the superuser:
//
//   - right after the raise returned, the stale session's backend (pid and
//     backend_start) is gone from pg_stat_activity;
//   - no row of the stale token committed after the raise (commit timestamps,
//     track_commit_timestamp), and the stale rows counted right after the raise
//     are all there are at the end (the set does not grow);
//   - the stale client saw no ReadyForQuery after the raise, only a FATAL
//     (ZF001 from a proxy that heard of the raise, 57P01 relayed by one that
//     did not) or a closed connection.
//
// Each sequence runs three ways: through proxy A (hears nothing), through
// proxy AH (LISTENs on the database, so it says ZF001), and as a control,
// connected straight to PostgreSQL, unbound, where the same sequence must
// commit a stale row after the raise: proof that the sequence reaches a
// commit point the test can see. The in-flight variants raise while the
// commit point itself is running: the write at the commit point waits on an
// advisory lock the test holds, the test raises, then releases the lock.
//
// The helpers here (v2 prefix) are also used by v2_race_test.go and
// generated_test.go.

// ---------------------------------------------------------------------
// A raw protocol session with a background reader.

// v2Msg is a backend message, rendered at once (pgproto3 reuses its messages).
type v2Msg struct {
	Type   string                  // e.g. "ReadyForQuery"
	Text   string                  // type and JSON, normalised (see v2Render)
	Err    *pgproto3.ErrorResponse // ErrorResponse only
	Status byte                    // ReadyForQuery only
	PID    uint32                  // BackendKeyData only
}

// v2Session is a protocol-level client whose reader goroutine queues every
// message, so that a test may send as much as it likes before reading.
type v2Session struct {
	conn net.Conn
	fe   *pgproto3.Frontend
	in   chan v2Msg
	end  error // why the reader stopped; written before in is closed
	PID  uint32
	got  []v2Msg                       // everything consumed since startup
	sent int                           // messages sent since startup
	gate atomic.Pointer[chan struct{}] // non-nil: the reader waits for it to close
}

// hold stops the reader before its next message, so that what the server
// sends backs up; release lets it go on.
func (s *v2Session) hold() {
	c := make(chan struct{})
	s.gate.Store(&c)
}

func (s *v2Session) release() {
	if c := s.gate.Swap(nil); c != nil {
		close(*c)
	}
}

// v2ServerError is an ErrorResponse that refused a session at startup.
type v2ServerError struct{ resp *pgproto3.ErrorResponse }

func (e *v2ServerError) Error() string {
	return fmt.Sprintf("%s %s: %s", e.resp.Severity, e.resp.Code, e.resp.Message)
}

// v2Code returns the SQLSTATE of a refusal or server error, "" if none.
func v2Code(err error) string {
	var se *v2ServerError
	if errors.As(err, &se) {
		return se.resp.Code
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}

// v2Dial connects to addr and completes startup with params (trust
// authentication): it returns at the first ReadyForQuery, or with the
// ErrorResponse that refused the session (*v2ServerError).
func v2Dial(addr string, params map[string]string) (*v2Session, error) {
	return v2DialBuffer(addr, params, 0)
}

// v2DialBuffer is v2Dial with a receive buffer of rcvbuf bytes (0: the system's), set
// before the connection is made, as a client with a small buffer has it: set afterwards,
// below the window already advertised, Linux's sender can stall for seconds on loopback
// (a window smaller than its segment size).
func v2DialBuffer(addr string, params map[string]string, rcvbuf int) (*v2Session, error) {
	d := net.Dialer{Timeout: 5 * time.Second}
	if rcvbuf > 0 {
		d.Control = func(_, _ string, c syscall.RawConn) error {
			var serr error
			if err := c.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, rcvbuf) }); err != nil {
				return err
			}
			return serr
		}
	}
	conn, err := d.Dial("tcp", addr)
	if err != nil {
		return nil, err
	}
	s := &v2Session{conn: conn, fe: pgproto3.NewFrontend(conn, conn), in: make(chan v2Msg, 1<<15)}
	go s.read()
	s.fe.Send(&pgproto3.StartupMessage{ProtocolVersion: pgproto3.ProtocolVersionNumber, Parameters: params})
	if err := s.flush(); err != nil {
		conn.Close()
		return nil, err
	}
	for {
		m, ok, err := s.next(30 * time.Second)
		if err != nil {
			conn.Close()
			return nil, fmt.Errorf("startup: %w", err)
		}
		if !ok {
			conn.Close()
			return nil, fmt.Errorf("startup: connection closed: %v", s.end)
		}
		switch m.Type {
		case "BackendKeyData":
			s.PID = m.PID
		case "ErrorResponse":
			conn.Close()
			return nil, &v2ServerError{m.Err}
		case "ReadyForQuery":
			s.got = nil
			return s, nil
		}
	}
}

func (s *v2Session) read() {
	defer close(s.in)
	for {
		if c := s.gate.Load(); c != nil {
			<-*c
		}
		m, err := s.fe.Receive()
		if err != nil {
			s.end = err
			return
		}
		s.in <- v2Render(m)
	}
}

func (s *v2Session) Close() { s.conn.Close() }

func (s *v2Session) flush() error {
	s.conn.SetWriteDeadline(time.Now().Add(10 * time.Second)) //nolint:errcheck
	return s.fe.Flush()
}

// send sends msgs and flushes.
func (s *v2Session) send(msgs ...pgproto3.FrontendMessage) error {
	for _, m := range msgs {
		s.fe.Send(m)
	}
	s.sent += len(msgs)
	return s.flush()
}

// next returns the next message; ok is false when the connection ended.
func (s *v2Session) next(d time.Duration) (m v2Msg, ok bool, err error) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case m, ok = <-s.in:
		if ok {
			s.got = append(s.got, m)
		}
		return m, ok, nil
	case <-t.C:
		return v2Msg{}, false, fmt.Errorf("no message within %v", d)
	}
}

// untilRFQ reads until n ReadyForQuery messages (n > 0) or, with n == 0,
// until a message of type stop.
func (s *v2Session) untilRFQ(n int, stop string, d time.Duration) ([]v2Msg, error) {
	var out []v2Msg
	deadline := time.Now().Add(d)
	for {
		m, ok, err := s.next(time.Until(deadline))
		if err != nil {
			return out, err
		}
		if !ok {
			return out, fmt.Errorf("connection ended: %v", s.end)
		}
		out = append(out, m)
		if n == 0 && m.Type == stop {
			return out, nil
		}
		if n > 0 && m.Type == "ReadyForQuery" {
			if n--; n == 0 {
				return out, nil
			}
		}
	}
}

// drain reads until the connection ends.
func (s *v2Session) drain(d time.Duration) ([]v2Msg, error) {
	var out []v2Msg
	deadline := time.Now().Add(d)
	for {
		m, ok, err := s.next(time.Until(deadline))
		if err != nil {
			return out, fmt.Errorf("the connection did not end: %w", err)
		}
		if !ok {
			return out, nil
		}
		out = append(out, m)
	}
}

// finish reads until the connection ends, as a client that goes on: after
// each ReadyForQuery that follows a ZF001 ERROR (the proxy's answer to a unit
// of an ended session, which keeps the connection for the next one) it sends
// its next unit, at most probes times.
func (s *v2Session) finish(d time.Duration, probes int) ([]v2Msg, error) {
	var out []v2Msg
	deadline := time.Now().Add(d)
	for {
		m, ok, err := s.next(time.Until(deadline))
		if err != nil {
			return out, fmt.Errorf("the connection did not end: %w", err)
		}
		if !ok {
			return out, nil
		}
		if m.Type == "ReadyForQuery" && len(out) > 0 && probes > 0 {
			if p := out[len(out)-1]; p.Type == "ErrorResponse" && p.Err.Code == fence.CodeStale {
				probes--
				s.send(v2Probe()...) //nolint:errcheck // closed, maybe
			}
		}
		out = append(out, m)
	}
}

// transcript is everything consumed, one message a line.
func (s *v2Session) transcript() string {
	var b strings.Builder
	for _, m := range s.got {
		b.WriteString("\n    ")
		b.WriteString(v2Short(m.Text))
	}
	return b.String()
}

func v2Short(s string) string {
	if len(s) > 300 {
		return s[:300] + "..."
	}
	return s
}

var v2TuplePos = regexp.MustCompile(`tuple \(\d+,\d+\)`)

// v2Render renders m as its type name and JSON, with what legitimately
// differs between two sessions blanked: process IDs and cancel keys, table
// OIDs, and tuple positions in error contexts (they depend on when other
// sessions' snapshots let a page be pruned).
func v2Render(m pgproto3.BackendMessage) v2Msg {
	name := reflect.TypeOf(m).Elem().Name()
	out := v2Msg{Type: name}
	var v any = m
	switch m := m.(type) {
	case *pgproto3.BackendKeyData:
		out.PID = m.ProcessID
		v = map[string]int{"KeyLen": len(m.SecretKey)}
	case *pgproto3.RowDescription:
		c := pgproto3.RowDescription{Fields: append([]pgproto3.FieldDescription(nil), m.Fields...)}
		for i := range c.Fields {
			c.Fields[i].TableOID = 0
		}
		v = &c
	case *pgproto3.NotificationResponse:
		c := *m
		c.PID = 0
		v = &c
	case *pgproto3.ErrorResponse:
		c := *m
		out.Err = &c
		n := c
		n.Where = v2TuplePos.ReplaceAllString(n.Where, "tuple (?)")
		v = &n
	case *pgproto3.NoticeResponse:
		n := *m
		n.Where = v2TuplePos.ReplaceAllString(n.Where, "tuple (?)")
		v = &n
	case *pgproto3.ReadyForQuery:
		out.Status = m.TxStatus
	}
	b, err := json.Marshal(v)
	if err != nil {
		b = []byte(fmt.Sprintf("(unencodable: %v)", err))
	}
	out.Text = name + " " + string(b)
	return out
}

// Message builders.

func v2Q(sql string) *pgproto3.Query { return &pgproto3.Query{String: sql} }

// v2PBE is Parse, Bind and Execute of sql as statement name and portal.
func v2PBE(name, portal, sql string) []pgproto3.FrontendMessage {
	return []pgproto3.FrontendMessage{
		&pgproto3.Parse{Name: name, Query: sql},
		&pgproto3.Bind{DestinationPortal: portal, PreparedStatement: name},
		&pgproto3.Execute{Portal: portal},
	}
}

func v2Msgs(parts ...any) []pgproto3.FrontendMessage {
	var out []pgproto3.FrontendMessage
	for _, p := range parts {
		switch p := p.(type) {
		case pgproto3.FrontendMessage:
			out = append(out, p)
		case []pgproto3.FrontendMessage:
			out = append(out, p...)
		default:
			panic(fmt.Sprintf("v2Msgs: %T", p))
		}
	}
	return out
}

// ---------------------------------------------------------------------
// Runs in goroutines: the regression runs and the generated sequences run
// many at a time (most of their time is spent waiting: proxy A holds a
// terminated session's error for a second before it relays it), so they
// cannot be parallel subtests (-parallel is GOMAXPROCS, 2 on CI). A run
// records its failures and aborts with fatalf; the test reports them.

type v2Run struct {
	name  string
	mu    sync.Mutex
	fails []string
	logs  []string
}

type v2Abort struct{}

func (r *v2Run) fatalf(format string, args ...any) {
	r.errorf(format, args...)
	panic(v2Abort{})
}

func (r *v2Run) errorf(format string, args ...any) {
	r.mu.Lock()
	r.fails = append(r.fails, fmt.Sprintf(format, args...))
	r.mu.Unlock()
}

func (r *v2Run) logf(format string, args ...any) {
	r.mu.Lock()
	r.logs = append(r.logs, fmt.Sprintf(format, args...))
	r.mu.Unlock()
}

// v2Go runs fn(i, runs[i]) for every run, at most parallel at a time, and
// waits.
func v2Go(parallel int, runs []*v2Run, fn func(i int, r *v2Run)) {
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
					if _, ok := p.(v2Abort); !ok {
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
func (r *v2Run) report(t *testing.T) {
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

type v2Env struct {
	pg    *testenv.Postgres
	admin *pgxpool.Pool // the superuser, database postgres
	a     *testenv.Proxy
	ah    *testenv.Proxy
	b     *testenv.Proxy
}

// v2Setup is what every v2 test database holds: the stale rows' table, and
// functions that write them from inside a query (the held cursors'), wait on
// an advisory lock the test holds (the in-flight variants), or commit inside
// a procedure. Owned by the superuser, run as the caller (not SECURITY
// DEFINER).
const v2Setup = `
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

func v2Ctx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// v2StartEnv starts the cluster (track_commit_timestamp on, plus opts), the
// schema and the proxies A, AH (with the database as its control database:
// it listens for raises there and asks whether a raise ended a backend) and
// B, each fencing resources.
func v2StartEnv(t *testing.T, resources []string, opts ...testenv.PGOption) *v2Env {
	t.Helper()
	return v2StartEnvOwner(t, resources, "", opts...)
}

// v2StartEnvOwner is v2StartEnv with the fence schema migrated by owner, a
// role created with only what the schema's functions need (pg_signal_backend,
// pg_read_all_stats, CREATE on the database); "": the superuser.
func v2StartEnvOwner(t *testing.T, resources []string, owner string, opts ...testenv.PGOption) *v2Env {
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
	admin := v2Pool(t, pg.AdminURL())
	if _, err := admin.Exec(v2Ctx(t), v2Setup, pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatalf("setup: %v", err)
	}
	e := &v2Env{pg: pg, admin: admin}
	cfg := proxy.Config{Resources: resources}
	e.a = testenv.StartProxy(t, pg, cfg)
	cfgH := cfg
	cfgH.ControlDatabase = pg.AdminURL()
	e.ah = testenv.StartProxy(t, pg, cfgH)
	e.b = testenv.StartProxy(t, pg, cfg)
	return e
}

// v2Pool is a pool of up to 64 connections to url: the runs hold advisory
// locks on some while they query on others.
func v2Pool(t *testing.T, url string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 64
	pool, err := pgxpool.NewWithConfig(v2Ctx(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func v2Addr(host string, port int) string { return net.JoinHostPort(host, strconv.Itoa(port)) }

// v2Params are the startup parameters of an app session of db, fenced with
// (res, tok) unless res is "".
func v2Params(db, res string, tok int64, extra ...string) map[string]string {
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
func (e *v2Env) raise(ctx context.Context, db, res string, tok int64) error {
	conn, err := pgx.Connect(ctx, e.b.FenceURL("app", db, res, tok))
	if err != nil {
		return err
	}
	return conn.Close(ctx)
}

// backendAlive reports whether the backend (pid, started) is still listed.
func v2BackendAlive(ctx context.Context, admin *pgxpool.Pool, pid uint32, started time.Time) (bool, error) {
	var n int
	err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND backend_start = $2`, int32(pid), started).Scan(&n)
	return n > 0, err
}

func v2BackendStart(ctx context.Context, admin *pgxpool.Pool, pid uint32) (time.Time, error) {
	var t time.Time
	err := admin.QueryRow(ctx, `SELECT backend_start FROM pg_stat_activity WHERE pid = $1`, int32(pid)).Scan(&t)
	return t, err
}

// v2StaleRows counts the rows that rowsSQL lists (one xid column: the xmin
// of every stale row; $1 is the resource), and those of them whose commit
// timestamp is after the commit of the resource's current token.
func v2StaleRows(ctx context.Context, admin *pgxpool.Pool, rowsSQL, res string) (total, after int, err error) {
	q := `SELECT count(*), count(*) FILTER (WHERE pg_xact_commit_timestamp(s.x) >
	          (SELECT pg_xact_commit_timestamp(t.xmin) FROM fence.tokens AS t WHERE t.resource = $1))
	      FROM (` + rowsSQL + `) AS s(x)`
	err = admin.QueryRow(ctx, q, res).Scan(&total, &after)
	return total, after, err
}

const v2DefaultRows = `SELECT xmin FROM public.v2_rows WHERE resource = $1`

// v2JudgeEnd checks what a stale session's client saw after the raise.
// Allowed: ZF001 from the proxy (a FATAL to an idle client; an ERROR and a
// ReadyForQuery for each unit it waited for or sent afterwards: the proxy
// answers them itself once the backend is gone), the server's 57P01 or the
// proxy's 08006 FATAL from a proxy that did not hear of the raise (deaf), a
// closed connection, the first early ReadyForQuery (units sent before the
// raise that may have completed before it), and the partial output of the
// unit the raise interrupted. Not allowed: any other ReadyForQuery (a unit
// completed after the raise), any other error. A listening proxy must say
// ZF001. It returns how the session ended.
func v2JudgeEnd(rest []v2Msg, listening bool, early int) (string, error) {
	how := "closed"
	var prev v2Msg
	for i, m := range rest {
		switch m.Type {
		case "ReadyForQuery":
			switch {
			case prev.Type == "ErrorResponse" && prev.Err.Code == fence.CodeStale && prev.Err.Severity == "ERROR":
				// The proxy's answer to a unit of the ended session.
			case early > 0:
				early--
			default:
				return "", fmt.Errorf("the stale session completed a unit after the raise (message %d: %s)", i, m.Text)
			}
		case "ErrorResponse":
			e := m.Err
			switch {
			case e.Code == fence.CodeStale:
				if !strings.Contains(e.Message, "stale fencing token") {
					return "", fmt.Errorf("ZF001 without the stale token message: %s", m.Text)
				}
				how = e.Code
			case e.Severity == "FATAL" && (e.Code == "57P01" || e.Code == "08006") && !listening:
				how = e.Code
			default:
				return "", fmt.Errorf("unexpected error after the raise: %s", m.Text)
			}
		}
		prev = m
	}
	if listening && how != fence.CodeStale {
		return "", fmt.Errorf("the proxy that heard of the raise did not say ZF001 (ended: %s)", how)
	}
	return how, nil
}

// v2Probe is the unit a stale client sends next: a session that the proxy
// ended answers it with ZF001 and closes.
func v2Probe() []pgproto3.FrontendMessage { return v2Msgs(v2Q("SELECT 'v2 probe'")) }

// ---------------------------------------------------------------------
// The regression cases.

// v2C is one run's context: its resource, the stale token, the advisory
// lock key of the in-flight variant, a large object OID, and the protocol.
type v2C struct {
	n    int
	res  string
	tok  int64
	key  int64
	lo   int64
	ext  bool // extended protocol
	wait bool // in-flight variant: the write at the commit point waits on key
}

// w is a write of a stale row from inside a query; at the commit point of the
// in-flight variant it waits on the test's advisory lock after writing.
func (c v2C) w(tag string) string {
	if c.wait {
		return fmt.Sprintf("public.v2_write_wait('%s', %d, '%s', %d)", c.res, c.tok, tag, c.key)
	}
	return c.wnow(tag)
}

// wnow is a write that never waits.
func (c v2C) wnow(tag string) string {
	return fmt.Sprintf("public.v2_write('%s', %d, '%s')", c.res, c.tok, tag)
}

func (c v2C) insert(tag string) string {
	return fmt.Sprintf("INSERT INTO public.v2_rows (resource, token, tag) VALUES ('%s', %d, '%s')", c.res, c.tok, tag)
}

// v2Step is a group of messages and what to read after them.
type v2Step struct {
	msgs  []pgproto3.FrontendMessage
	rfq   int    // ReadyForQuery messages that end the step
	until string // with rfq 0: the message type that ends it
	fail  bool   // the step must fail (an ErrorResponse)
}

// stmt is sql on its own: a Query, or Parse, Bind, Execute and Sync.
func (c v2C) stmt(sql string) v2Step {
	if c.ext {
		return v2Step{msgs: v2Msgs(v2PBE("", "", sql), &pgproto3.Sync{}), rfq: 1}
	}
	return v2Step{msgs: v2Msgs(v2Q(sql)), rfq: 1}
}

func (c v2C) bad(sql string) v2Step {
	s := c.stmt(sql)
	s.fail = true
	return s
}

// unit is sqls in one Query, or in one Sync unit.
func (c v2C) unit(sqls ...string) v2Step {
	if !c.ext {
		return v2Step{msgs: v2Msgs(v2Q(strings.Join(sqls, "; "))), rfq: 1}
	}
	var msgs []pgproto3.FrontendMessage
	for _, s := range sqls {
		msgs = append(msgs, v2PBE("", "", s)...)
	}
	return v2Step{msgs: append(msgs, &pgproto3.Sync{}), rfq: 1}
}

func v2Raw(rfq int, fail bool, parts ...any) v2Step {
	return v2Step{msgs: v2Msgs(parts...), rfq: rfq, fail: fail}
}

// v2Case is one sequence of the Why list.
type v2Case struct {
	name string
	// protos: which protocols to run it in (false: simple, true: extended).
	protos []bool
	// idle: raise while the stale session waits before its commit point;
	// inflight: raise while the commit point runs (it must block on c.key).
	idle, inflight bool
	// setup prepares a run (as the superuser) before the stale session starts.
	setup func(ctx context.Context, admin *pgxpool.Pool, c v2C) error
	// build returns the steps up to the commit point and the commit point.
	build func(c v2C) (before, commit []v2Step)
	// rows lists the xmin of every stale row ($1: the resource); default
	// v2DefaultRows.
	rows func(c v2C) string
	// fenced is how many stale rows a fenced run commits before the raise
	// (nil: 0).
	fenced func(c v2C) int
	// state, when set, is the stale backend's pg_stat_activity state just
	// before the raise.
	state string
	// early is how many units of the commit point complete before it blocks
	// (in-flight variant).
	early int
}

var (
	v2Both     = []bool{false, true}
	v2Extended = []bool{true}
)

// v2VacuumSetup creates the table of the expression-index cases: owned by
// app, three rows, and an index on an IMMUTABLE function that writes a stale
// row (through a volatile one) whenever it runs as app: at VACUUM FULL,
// ANALYZE, or an index build.
func v2VacuumSetup(ctx context.Context, admin *pgxpool.Pool, c v2C) error {
	sql := fmt.Sprintf(`
CREATE TABLE public.v2_vac_%[1]d (x int);
INSERT INTO public.v2_vac_%[1]d VALUES (1), (2), (3);
CREATE FUNCTION public.v2_idx_%[1]d(x int) RETURNS int LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN current_user = 'app' THEN %[2]s ELSE 0 END + x
$$;
CREATE INDEX ON public.v2_vac_%[1]d (public.v2_idx_%[1]d(x));
ALTER TABLE public.v2_vac_%[1]d OWNER TO app;
`, c.n, c.w("expression index"))
	_, err := admin.Exec(ctx, sql, pgx.QueryExecModeSimpleProtocol)
	return err
}

func v2LORows(c v2C) string {
	return fmt.Sprintf(`SELECT xmin FROM pg_largeobject_metadata WHERE oid = %d`, c.lo)
}

// v2LOExpr creates the run's large object; in the in-flight variant it then
// waits on the test's lock.
func (c v2C) loExpr() string {
	if c.wait {
		return fmt.Sprintf("CASE WHEN lo_from_bytea(%d, 'stale') > 0 THEN public.v2_wait(%d) END", c.lo, c.key)
	}
	return fmt.Sprintf("lo_from_bytea(%d, 'stale')", c.lo)
}

// noSyncThen: a write Executed without Sync, then a Query (sql), with BEGIN
// first when block. In the in-flight variant the Execute goes with the Query.
func noSyncThen(block bool, query string) func(c v2C) (before, commit []v2Step) {
	return func(c v2C) (before, commit []v2Step) {
		if block {
			before = append(before, v2Raw(1, false, v2Q("BEGIN")))
		}
		exec := v2PBE("", "", "SELECT "+c.w("executed without sync"))
		if c.wait {
			return before, []v2Step{v2Raw(1, false, exec, v2Q(query))}
		}
		before = append(before, v2Step{msgs: v2Msgs(exec, &pgproto3.Flush{}), until: "CommandComplete"})
		return before, []v2Step{v2Raw(1, false, v2Q(query))}
	}
}

var v2Cases = []v2Case{
	// 1. Held cursors whose query writes: it runs inside COMMIT.
	{name: "held cursor in a block", protos: v2Both, idle: true, inflight: true,
		build: func(c v2C) ([]v2Step, []v2Step) {
			return []v2Step{c.stmt("BEGIN"), c.stmt("DECLARE c CURSOR WITH HOLD FOR SELECT " + c.w("held cursor"))},
				[]v2Step{c.stmt("COMMIT")}
		}},
	{name: "held cursor in autocommit", protos: v2Both, idle: true, inflight: true,
		build: func(c v2C) ([]v2Step, []v2Step) {
			return nil, []v2Step{c.stmt("DECLARE c CURSOR WITH HOLD FOR SELECT " + c.w("held cursor"))}
		}},
	{name: "held cursor of lo_from_bytea in a block", protos: v2Both, idle: true, inflight: true, rows: v2LORows,
		build: func(c v2C) ([]v2Step, []v2Step) {
			return []v2Step{c.stmt("BEGIN"), c.stmt("DECLARE c CURSOR WITH HOLD FOR SELECT " + c.loExpr())},
				[]v2Step{c.stmt("COMMIT")}
		}},
	{name: "held cursor of lo_from_bytea in autocommit", protos: v2Both, idle: true, inflight: true, rows: v2LORows,
		build: func(c v2C) ([]v2Step, []v2Step) {
			return nil, []v2Step{c.stmt("DECLARE c CURSOR WITH HOLD FOR SELECT " + c.loExpr())}
		}},
	// 2. A block failed after a SAVEPOINT, then ROLLBACK TO, a write and COMMIT
	// in one Sync unit (one Query in the simple protocol).
	{name: "ROLLBACK TO a failed savepoint, write and COMMIT in one unit", protos: v2Both, idle: true, inflight: true,
		state: "idle in transaction (aborted)",
		build: func(c v2C) ([]v2Step, []v2Step) {
			return []v2Step{c.stmt("BEGIN"), c.stmt("SAVEPOINT s"), c.bad("SELECT 1/0")},
				[]v2Step{c.unit("ROLLBACK TO s", "SELECT "+c.w("after rollback to"), "COMMIT")}
		}},
	// 3. Execute of a write without Sync, then a Query.
	{name: "Execute without Sync then Query COMMIT in a block", protos: v2Extended, idle: true, inflight: true,
		build: noSyncThen(true, "COMMIT")},
	{name: "Execute without Sync then Query COMMIT", protos: v2Extended, idle: true, inflight: true,
		build: noSyncThen(false, "COMMIT")},
	{name: "Execute without Sync then a comment-only Query", protos: v2Extended, idle: true, inflight: true,
		build: noSyncThen(false, "-- nothing but a comment")},
	{name: "Execute without Sync then an empty Query", protos: v2Extended, idle: true, inflight: true,
		build: noSyncThen(false, "")},
	// 4. Statement names and portals that still mean COMMIT on the server.
	{name: "named statement whose re-Parse failed with 42P05", protos: v2Extended, idle: true,
		build: func(c v2C) ([]v2Step, []v2Step) {
			return []v2Step{
					v2Raw(1, false, &pgproto3.Parse{Name: "s1", Query: "COMMIT"}, &pgproto3.Sync{}),
					v2Raw(1, true, &pgproto3.Parse{Name: "s1", Query: "SELECT 1"}, &pgproto3.Sync{}),
					v2Raw(1, false, v2Q("BEGIN")),
					v2Raw(1, false, v2Q("SELECT "+c.w("before statement s1"))),
				},
				[]v2Step{v2Raw(1, false, &pgproto3.Bind{PreparedStatement: "s1"}, &pgproto3.Execute{}, &pgproto3.Sync{})}
		}},
	{name: "named statement whose Close and re-Parse were skipped after an error", protos: v2Extended, idle: true,
		build: func(c v2C) ([]v2Step, []v2Step) {
			return []v2Step{
					v2Raw(1, false, &pgproto3.Parse{Name: "s1", Query: "COMMIT"}, &pgproto3.Sync{}),
					v2Raw(1, true, v2PBE("", "", "SELECT 1/0"), &pgproto3.Close{ObjectType: 'S', Name: "s1"},
						&pgproto3.Parse{Name: "s1", Query: "SELECT 1"}, &pgproto3.Sync{}),
					v2Raw(1, false, v2Q("BEGIN")),
					v2Raw(1, false, v2Q("SELECT "+c.w("before statement s1"))),
				},
				[]v2Step{v2Raw(1, false, &pgproto3.Bind{PreparedStatement: "s1"}, &pgproto3.Execute{}, &pgproto3.Sync{})}
		}},
	{name: "portal rebound in a failed savepoint", protos: v2Extended, idle: true,
		build: func(c v2C) ([]v2Step, []v2Step) {
			return []v2Step{
					v2Raw(1, false, v2Q("BEGIN")),
					v2Raw(1, false, &pgproto3.Parse{Name: "sc", Query: "COMMIT"}, &pgproto3.Bind{DestinationPortal: "p", PreparedStatement: "sc"}, &pgproto3.Sync{}),
					v2Raw(1, false, v2Q("SAVEPOINT s")),
					v2Raw(1, true, v2Q("SELECT 1/0")),
					v2Raw(1, true, &pgproto3.Parse{Name: "s2", Query: "SELECT 1"}, &pgproto3.Bind{DestinationPortal: "p", PreparedStatement: "s2"}, &pgproto3.Sync{}),
					v2Raw(1, false, v2Q("ROLLBACK TO s")),
					v2Raw(1, false, v2Q("SELECT "+c.w("before portal p"))),
				},
				[]v2Step{v2Raw(1, false, &pgproto3.Execute{Portal: "p"}, &pgproto3.Sync{})}
		}},
	// 5. v1's prepared check replaced from PL/pgSQL; user code run by VACUUM
	// FULL and ANALYZE through an expression index.
	{name: "prepared statements replaced from PL/pgSQL", protos: v2Both, idle: true,
		build: func(c v2C) ([]v2Step, []v2Step) {
			return []v2Step{c.stmt("BEGIN"), c.stmt("SELECT " + c.w("before DEALLOCATE")),
					c.stmt(`DO $$BEGIN EXECUTE 'DEALLOCATE ALL'; EXECUTE 'PREPARE __fenceproxy_check AS SELECT 1'; END$$`)},
				[]v2Step{c.stmt("COMMIT")}
		}},
	{name: "VACUUM FULL through an expression index", protos: v2Both, idle: true, inflight: true, setup: v2VacuumSetup,
		build: func(c v2C) ([]v2Step, []v2Step) {
			return nil, []v2Step{c.stmt(fmt.Sprintf("VACUUM FULL public.v2_vac_%d", c.n))}
		}},
	{name: "ANALYZE through an expression index in a block", protos: v2Both, idle: true, setup: v2VacuumSetup,
		build: func(c v2C) ([]v2Step, []v2Step) {
			return []v2Step{c.stmt("BEGIN"), c.stmt(fmt.Sprintf("ANALYZE public.v2_vac_%d", c.n))}, []v2Step{c.stmt("COMMIT")}
		}},
	{name: "ANALYZE through an expression index in autocommit", protos: v2Both, inflight: true, setup: v2VacuumSetup,
		build: func(c v2C) ([]v2Step, []v2Step) {
			return nil, []v2Step{c.stmt(fmt.Sprintf("ANALYZE public.v2_vac_%d", c.n))}
		}},
	// Commit points inside a statement, the plain idle-in-transaction case,
	// and a pipeline.
	{name: "procedure that commits inside", protos: v2Both, idle: true, inflight: true,
		fenced: func(c v2C) int {
			if c.wait {
				return 1 // its first COMMIT ran before the raise
			}
			return 0
		},
		build: func(c v2C) ([]v2Step, []v2Step) {
			return nil, []v2Step{c.stmt(fmt.Sprintf("CALL public.v2_proc('%s', %d, %d)", c.res, c.tok, c.key))}
		}},
	{name: "DO block that commits inside", protos: v2Both, idle: true, inflight: true,
		fenced: func(c v2C) int {
			if c.wait {
				return 1
			}
			return 0
		},
		build: func(c v2C) ([]v2Step, []v2Step) {
			return nil, []v2Step{c.stmt(fmt.Sprintf(`DO $$BEGIN PERFORM %s; COMMIT; PERFORM %s; END$$`, c.wnow("do 1"), c.w("do 2")))}
		}},
	{name: "idle in transaction", protos: v2Both, idle: true, state: "idle in transaction",
		build: func(c v2C) ([]v2Step, []v2Step) {
			return []v2Step{c.stmt("BEGIN"), c.stmt(c.insert("idle in transaction"))}, []v2Step{c.stmt("COMMIT")}
		}},
	// 6. Execute (error), Query, Sync once desynchronised v1's session; then a
	// block idle in transaction.
	{name: "block after Execute error, Query, Sync", protos: v2Both, idle: true, state: "idle in transaction",
		build: func(c v2C) ([]v2Step, []v2Step) {
			return []v2Step{v2Raw(1, true, v2PBE("", "", "SELECT 1/0"), v2Q("SELECT 1"), &pgproto3.Sync{}),
					c.stmt("BEGIN"), c.stmt(c.insert("after the desync"))},
				[]v2Step{c.stmt("COMMIT")}
		}},
	{name: "COMMIT AND CHAIN", protos: v2Both, idle: true,
		build: func(c v2C) ([]v2Step, []v2Step) {
			return []v2Step{c.stmt("BEGIN"), c.stmt(c.insert("chain"))}, []v2Step{c.stmt("COMMIT AND CHAIN")}
		}},
	{name: "pipeline of three Sync units", protos: v2Extended, idle: true, inflight: true, early: 1,
		build: func(c v2C) ([]v2Step, []v2Step) {
			return nil, []v2Step{v2Raw(3, false,
				v2PBE("", "", "BEGIN"), &pgproto3.Sync{},
				v2PBE("", "", "SELECT "+c.w("pipeline")), &pgproto3.Sync{},
				v2PBE("", "", "COMMIT"), &pgproto3.Sync{})}
		}},
	{name: "multi-statement Query with COMMIT in the middle", protos: []bool{false}, idle: true, inflight: true,
		build: func(c v2C) ([]v2Step, []v2Step) {
			return []v2Step{c.stmt("BEGIN")},
				[]v2Step{v2Raw(1, false, v2Q("SELECT "+c.w("multi 1")+"; COMMIT; SELECT "+c.wnow("multi 2")))}
		}},
}

type v2Mode int

const (
	v2ViaA   v2Mode = iota // through proxy A, which hears nothing of the raise
	v2ViaAH                // through proxy AH, which LISTENs for raises
	v2Direct               // control: straight to PostgreSQL, unbound
)

func (m v2Mode) String() string {
	return [...]string{"proxy", "listening proxy", "direct control"}[m]
}

type v2Variant struct {
	cs   v2Case
	c    v2C
	mode v2Mode
}

func (v v2Variant) name() string {
	proto := "simple"
	if v.c.ext {
		proto = "extended"
	}
	when := "raise before the commit point"
	if v.c.wait {
		when = "raise during the commit point"
	}
	return fmt.Sprintf("%s/%s/%s/%s", v.cs.name, proto, when, v.mode)
}

// TestV2Regressions runs every case of v2Cases in every protocol, variant and
// mode (see the top of this file).
func TestV2Regressions(t *testing.T) {
	t.Parallel()
	var variants []v2Variant
	n := 0
	for _, cs := range v2Cases {
		for _, ext := range cs.protos {
			for _, wait := range []bool{false, true} {
				if (wait && !cs.inflight) || (!wait && !cs.idle) {
					continue
				}
				for _, mode := range []v2Mode{v2ViaA, v2ViaAH, v2Direct} {
					n++
					c := v2C{n: n, res: fmt.Sprintf("v2r%d", n), tok: 1, key: 7700000 + int64(n), lo: 4200000 + int64(n), ext: ext, wait: wait}
					variants = append(variants, v2Variant{cs: cs, c: c, mode: mode})
				}
			}
		}
	}
	resources := make([]string, len(variants))
	for i, v := range variants {
		resources[i] = v.c.res
	}
	e := v2StartEnv(t, resources)
	runs := make([]*v2Run, len(variants))
	for i, v := range variants {
		runs[i] = &v2Run{name: v.name()}
	}
	start := time.Now()
	v2Go(12, runs, func(i int, r *v2Run) { e.runCase(r, variants[i]) })
	t.Logf("%d runs (%d cases) in %v", len(runs), len(v2Cases), time.Since(start).Round(time.Millisecond))
	for _, r := range runs {
		t.Run(r.name, r.report)
	}
}

// runCase runs one variant (see the top of this file).
func (e *v2Env) runCase(r *v2Run, v v2Variant) {
	cs, c, mode := v.cs, v.c, v.mode
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	if cs.setup != nil {
		if err := cs.setup(ctx, e.admin, c); err != nil {
			r.fatalf("setup: %v", err)
		}
	}
	rows := v2DefaultRows
	if cs.rows != nil {
		rows = cs.rows(c)
	}
	before, commit := cs.build(c)
	fenced := mode != v2Direct
	addr, params := v2Addr(e.pg.Host, e.pg.Port), v2Params("postgres", "", 0)
	switch mode {
	case v2ViaA:
		addr, params = v2Addr(e.a.Host, e.a.Port), v2Params("postgres", c.res, c.tok)
	case v2ViaAH:
		addr, params = v2Addr(e.ah.Host, e.ah.Port), v2Params("postgres", c.res, c.tok)
	}
	s, err := v2Dial(addr, params)
	if err != nil {
		r.fatalf("connect: %v", err)
	}
	defer s.Close()
	started, err := v2BackendStart(ctx, e.admin, s.PID)
	if err != nil {
		r.fatalf("backend_start of %d: %v", s.PID, err)
	}
	step := func(i int, st v2Step, what string) {
		msgs, err := s.untilRFQ(st.rfq, st.until, 20*time.Second)
		if err != nil {
			r.fatalf("%s step %d: %v; transcript:%s", what, i, err, s.transcript())
		}
		failed := false
		for _, m := range msgs {
			failed = failed || m.Type == "ErrorResponse"
		}
		if failed != st.fail {
			r.fatalf("%s step %d: error %t, want %t; transcript:%s", what, i, failed, st.fail, s.transcript())
		}
	}
	for i, st := range before {
		if err := s.send(st.msgs...); err != nil {
			r.fatalf("before step %d: send: %v", i, err)
		}
		step(i, st, "before")
	}
	if cs.state != "" {
		var state string
		if err := e.admin.QueryRow(ctx, `SELECT state FROM pg_stat_activity WHERE pid = $1`, int32(s.PID)).Scan(&state); err != nil {
			r.fatalf("state: %v", err)
		}
		if state != cs.state {
			r.fatalf("stale backend state before the raise: %q, want %q", state, cs.state)
		}
	}

	var lock *pgxpool.Conn
	unlock := func() {
		if lock != nil {
			if _, err := lock.Exec(ctx, `SELECT pg_advisory_unlock($1)`, c.key); err != nil {
				r.errorf("unlock: %v", err)
			}
			lock.Release()
			lock = nil
		}
	}
	defer unlock()
	var commitMsgs []pgproto3.FrontendMessage
	for _, st := range commit {
		commitMsgs = append(commitMsgs, st.msgs...)
	}
	if c.wait {
		if lock, err = e.admin.Acquire(ctx); err != nil {
			r.fatalf("acquire: %v", err)
		}
		if _, err := lock.Exec(ctx, `SELECT pg_advisory_lock($1)`, c.key); err != nil {
			r.fatalf("lock: %v", err)
		}
		if err := s.send(commitMsgs...); err != nil {
			r.fatalf("commit point: send: %v", err)
		}
		deadline := time.Now().Add(20 * time.Second)
		for {
			var ev *string
			if err := e.admin.QueryRow(ctx, `SELECT wait_event FROM pg_stat_activity WHERE pid = $1`, int32(s.PID)).Scan(&ev); err != nil {
				r.fatalf("wait_event: %v", err)
			}
			if ev != nil && *ev == "advisory" {
				break
			}
			if time.Now().After(deadline) {
				s.untilRFQ(1, "", 100*time.Millisecond) //nolint:errcheck // for the transcript
				r.fatalf("the commit point did not reach its wait within 20 s; transcript:%s", s.transcript())
			}
			time.Sleep(5 * time.Millisecond)
		}
	}

	if err := e.raise(ctx, "postgres", c.res, c.tok+1); err != nil {
		r.fatalf("raise: %v", err)
	}
	if fenced {
		alive, err := v2BackendAlive(ctx, e.admin, s.PID, started)
		if err != nil {
			r.fatalf("pg_stat_activity: %v", err)
		}
		if alive {
			r.fatalf("the stale backend %d is still in pg_stat_activity after the raise returned", s.PID)
		}
	}
	atRaise, _, err := v2StaleRows(ctx, e.admin, rows, c.res)
	if err != nil {
		r.fatalf("stale rows: %v", err)
	}
	if c.wait {
		unlock()
	} else {
		s.send(commitMsgs...) //nolint:errcheck // the stale session's connection may be closed already
	}

	if fenced {
		s.send(v2Probe()...) //nolint:errcheck // closed, most likely
		rest, err := s.finish(20*time.Second, 5)
		if err != nil {
			r.fatalf("%v; transcript:%s", err, s.transcript())
		}
		early := 0
		if c.wait {
			early = cs.early
		}
		how, err := v2JudgeEnd(rest, mode == v2ViaAH, early)
		if err != nil {
			r.fatalf("%v; transcript:%s", err, s.transcript())
		}
		total, after, err := v2StaleRows(ctx, e.admin, rows, c.res)
		if err != nil {
			r.fatalf("stale rows: %v", err)
		}
		want := 0
		if cs.fenced != nil {
			want = cs.fenced(c)
		}
		if after != 0 {
			r.errorf("VIOLATION: %d stale rows committed after the raise; transcript:%s", after, s.transcript())
		}
		if total != atRaise {
			r.errorf("the stale rows grew after the raise: %d right after it, %d at the end", atRaise, total)
		}
		if total != want {
			r.errorf("%d stale rows committed, want %d", total, want)
		}
		r.logf("stale session ended (%s) after %d messages; stale rows %d, after the raise %d", how, s.sent, total, after)
		return
	}
	// The control: the same sequence, unfenced, commits after the raise.
	for i, st := range commit {
		step(i, st, "commit")
	}
	total, after, err := v2StaleRows(ctx, e.admin, rows, c.res)
	if err != nil {
		r.fatalf("stale rows: %v", err)
	}
	if after == 0 {
		r.errorf("control: unfenced, the sequence committed no row after the raise (%d in all): it does not reach the commit point it should test; transcript:%s", total, s.transcript())
	}
	r.logf("control: %d stale rows, %d committed after the raise", total, after)
}

// ---------------------------------------------------------------------
// Item 6: Execute (error), Query, Sync. The relay is plain: the session sees
// what a direct one sees, and its backend ends in the same state.

func TestV2ErrorQuerySyncTransparent(t *testing.T) {
	t.Parallel()
	e := v2StartEnv(t, []string{"desync"})
	ctx := v2Ctx(t)
	// rfq: the server discards every message but Sync after an
	// extended-protocol error, Queries too: one ReadyForQuery for the Sync
	// (and one for a Query before the error).
	seqs := []struct {
		name string
		msgs []pgproto3.FrontendMessage
		rfq  int
	}{
		{"Execute error, Query, Sync", v2Msgs(v2PBE("", "", "SELECT 1/0"), v2Q("SELECT 1"), &pgproto3.Sync{}), 1},
		{"BEGIN, Execute error, Query COMMIT, Sync", v2Msgs(v2Q("BEGIN"), v2PBE("", "", "SELECT 1/0"), v2Q("COMMIT"), &pgproto3.Sync{}), 2},
		{"Execute write, Execute error, Query, Sync", v2Msgs(v2PBE("", "", "INSERT INTO public.v2_rows (resource, token, tag) VALUES ('desync', 0, 'x')"),
			v2PBE("", "", "SELECT 1/0"), v2Q("SELECT 1"), &pgproto3.Sync{}), 1},
		{"Execute error, Query, Query, Sync", v2Msgs(v2PBE("", "", "SELECT 1/0"), v2Q("BEGIN"), v2Q("SELECT 2"), &pgproto3.Sync{}), 1},
	}
	for _, seq := range seqs {
		t.Run(seq.name, func(t *testing.T) {
			type out struct {
				lines []string
				state string
			}
			run := func(addr string, params map[string]string) out {
				s, err := v2Dial(addr, params)
				if err != nil {
					t.Fatal(err)
				}
				defer s.Close()
				if err := s.send(seq.msgs...); err != nil {
					t.Fatal(err)
				}
				// Then nothing more may come. The backend reports its state
				// before it sends ReadyForQuery.
				var o out
				first, err := s.untilRFQ(seq.rfq, "", 20*time.Second)
				if err != nil {
					t.Fatalf("%v; transcript:%s", err, s.transcript())
				}
				for _, m := range first {
					o.lines = append(o.lines, m.Text)
				}
				for {
					m, ok, err := s.next(200 * time.Millisecond)
					if err != nil || !ok {
						break
					}
					o.lines = append(o.lines, m.Text)
				}
				if err := e.admin.QueryRow(ctx, `SELECT state FROM pg_stat_activity WHERE pid = $1`, int32(s.PID)).Scan(&o.state); err != nil {
					t.Fatal(err)
				}
				lines, err := v2Transcript(s, nil, "v2-desync-end", 20*time.Second)
				if err != nil {
					t.Fatal(err)
				}
				o.lines = append(o.lines, lines...)
				return o
			}
			d := run(v2Addr(e.pg.Host, e.pg.Port), v2Params("postgres", "", 0))
			p := run(v2Addr(e.a.Host, e.a.Port), v2Params("postgres", "desync", 1))
			if strings.Join(d.lines, "\n") != strings.Join(p.lines, "\n") {
				t.Fatalf("the proxy's session differs from a direct one:\n%s", diffLines(d.lines, p.lines))
			}
			if d.state != p.state {
				t.Fatalf("backend state afterwards: direct %q, proxy %q", d.state, p.state)
			}
			t.Logf("%d messages alike; backend state afterwards %q", len(d.lines), d.state)
		})
	}
}

// v2Terminator ends any sequence: out of COPY, to an idle session, then a
// marker whose answer is unmistakable.
func v2Terminator(nonce string) []pgproto3.FrontendMessage {
	return v2Msgs(&pgproto3.CopyFail{Message: "v2 end"}, &pgproto3.Sync{}, v2Q("ROLLBACK"), v2Q("SELECT '"+nonce+"'"))
}

// v2Transcript sends msgs and the terminator and returns every message read
// up to the terminator's ReadyForQuery ("EOF" last if the connection ended).
func v2Transcript(s *v2Session, msgs []pgproto3.FrontendMessage, nonce string, d time.Duration) ([]string, error) {
	if err := s.send(append(append([]pgproto3.FrontendMessage(nil), msgs...), v2Terminator(nonce)...)...); err != nil {
		return nil, err
	}
	var out []string
	seen := false
	deadline := time.Now().Add(d)
	for {
		m, ok, err := s.next(time.Until(deadline))
		if err != nil {
			return out, err
		}
		if !ok {
			return append(out, "EOF"), nil
		}
		out = append(out, m.Text)
		if m.Type == "DataRow" && strings.Contains(m.Text, nonce) {
			seen = true
		}
		if seen && m.Type == "ReadyForQuery" {
			return out, nil
		}
	}
}

// ---------------------------------------------------------------------
// Item 7: only the proxy admits a token; a bound session cannot re-bind.

func TestV2OnlyTheProxyAdmits(t *testing.T) {
	t.Parallel()
	e := v2StartEnv(t, []string{"proof"})
	ctx := v2Ctx(t)
	const res = "proof"
	fenced := testenv.Connect(t, e.a.FenceURL("app", "postgres", res, 5))
	direct := testenv.Connect(t, e.pg.URL("app", "postgres"))
	fpid := fenced.PgConn().PID()
	key := testenv.Key
	validBind := key.Proof("bind", "postgres", res, 6, fpid) // what only a proxy can compute
	validRaise := key.Proof("raise", "postgres", res, 1000000, fpid)
	otherPid := key.Proof("raise", "postgres", res, 1000000, direct.PgConn().PID())
	refused := []struct {
		name string
		conn *pgx.Conn
		sql  string
		code string
	}{
		{"fenced: raise to 10^6 without proof", fenced, `SELECT fence.raise('proof', 1000000, 'forged')`, fence.CodeProof},
		{"fenced: bind to 10^6 without proof", fenced, `SELECT fence.bind('proof', 1000000, 'forged')`, fence.CodeProof},
		{"fenced: raise with a bind proof", fenced, `SELECT fence.raise('proof', 6, '` + validBind + `')`, fence.CodeProof},
		{"fenced: raise with another backend's proof", fenced, `SELECT fence.raise('proof', 1000000, '` + otherPid + `')`, fence.CodeProof},
		{"fenced: re-bind with a valid proof", fenced, `SELECT fence.bind('proof', 6, '` + validBind + `')`, fence.CodeNotAllowed},
		{"fenced: reset", fenced, `SELECT fence.reset('proof', 1000000)`, "42501"},
		{"fenced: raise_locked", fenced, `SELECT fence.raise_locked('proof', 1000000)`, "42501"},
		{"fenced: end_stale", fenced, `SELECT fence.end_stale('proof', 1000000, '1 s')`, "42501"},
		{"fenced: proof", fenced, `SELECT fence.proof('raise', 'proof', 1000000, pg_backend_pid())`, "42501"},
		{"fenced: read the key", fenced, `SELECT key FROM fence.keys`, "42501"},
		{"fenced: write the token", fenced, `UPDATE fence.tokens SET token = 1000000`, "42501"},
		{"fenced: delete the bindings", fenced, `DELETE FROM fence.bindings`, "42501"},
		{"fenced: insert a binding", fenced, `INSERT INTO fence.bindings (pid, backend_start, resource, token) VALUES (1, now(), 'proof', 1000000)`, "42501"},
		{"fenced: truncate the tokens", fenced, `TRUNCATE fence.tokens`, "42501"},
		{"fenced: create in schema fence", fenced, `CREATE FUNCTION fence.x() RETURNS int LANGUAGE sql AS 'SELECT 1'`, "42501"},
		{"fenced: replace fence.bind", fenced, `CREATE OR REPLACE FUNCTION fence.bind(text, bigint, text) RETURNS bigint LANGUAGE sql AS 'SELECT 1::bigint'`, "42501"},
		{"direct: raise to 10^6 without proof", direct, `SELECT fence.raise('proof', 1000000, 'forged')`, fence.CodeProof},
		{"direct: bind to 10^6 without proof", direct, `SELECT fence.bind('proof', 1000000, 'forged')`, fence.CodeProof},
		{"direct: raise with the fenced backend's proof", direct, `SELECT fence.raise('proof', 1000000, '` + validRaise + `')`, fence.CodeProof},
		{"direct: bind with the fenced backend's proof", direct, `SELECT fence.bind('proof', 6, '` + validBind + `')`, fence.CodeProof},
	}
	for _, tc := range refused {
		_, err := tc.conn.Exec(ctx, tc.sql, pgx.QueryExecModeSimpleProtocol)
		if got := v2Code(err); got != tc.code {
			t.Errorf("%s: SQLSTATE %q (%v), want %s", tc.name, got, err, tc.code)
		}
	}
	var tok int64
	if err := e.admin.QueryRow(ctx, `SELECT token FROM fence.tokens WHERE resource = 'proof'`).Scan(&tok); err != nil {
		t.Fatal(err)
	}
	if tok != 5 {
		t.Fatalf("stored token %d after the refused calls, want 5", tok)
	}
	// The fenced session still works, is still bound to 5, and token 5 is still
	// admitted; 6 through another proxy ends it.
	var bound int64
	if err := fenced.QueryRow(ctx, `SELECT token FROM fence.bindings WHERE pid = pg_backend_pid()`).Scan(&bound); err != nil || bound != 5 {
		t.Fatalf("binding of the fenced session: %d, %v", bound, err)
	}
	testenv.Connect(t, e.a.FenceURL("app", "postgres", res, 5)).Close(ctx)
	if err := e.raise(ctx, "postgres", res, 6); err != nil {
		t.Fatal(err)
	}
	_, err := fenced.Exec(ctx, "SELECT 1")
	if err == nil {
		t.Fatal("the session bound to 5 still works after 6 was admitted")
	}
}

// ---------------------------------------------------------------------
// Item 8: tokens are per database.

func TestV2TokensPerDatabase(t *testing.T) {
	t.Parallel()
	e := v2StartEnv(t, []string{"billing"})
	ctx := v2Ctx(t)
	if _, err := e.admin.Exec(ctx, `CREATE DATABASE v2other`); err != nil {
		t.Fatal(err)
	}
	otherURL := e.pg.URLWithPassword(testenv.AdminUser, testenv.AdminPassword, "v2other")
	testenv.Migrate(t, otherURL)
	e.pg.Exec(t, "GRANT ALL ON DATABASE v2other TO app")
	other := testenv.Connect(t, otherURL)
	if _, err := other.Exec(ctx, `CREATE TABLE w (token bigint); GRANT ALL ON w TO app`, pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatal(err)
	}
	if _, err := e.admin.Exec(ctx, `CREATE TABLE w (token bigint); GRANT ALL ON w TO app`, pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatal(err)
	}
	write := func(c *pgx.Conn, tok int64) error {
		_, err := c.Exec(ctx, fmt.Sprintf("INSERT INTO w VALUES (%d)", tok))
		return err
	}
	// 18 in postgres, then 7 in v2other, through the same proxy instance.
	p18 := testenv.Connect(t, e.a.FenceURL("app", "postgres", "billing", 18))
	o7 := testenv.Connect(t, e.a.FenceURL("app", "v2other", "billing", 7))
	if err := write(p18, 18); err != nil {
		t.Fatal(err)
	}
	if err := write(o7, 7); err != nil {
		t.Fatalf("token 7 in v2other after 18 in postgres: %v", err)
	}
	// 19 in postgres ends p18, not o7.
	if err := e.raise(ctx, "postgres", "billing", 19); err != nil {
		t.Fatal(err)
	}
	if err := write(p18, 18); err == nil {
		t.Fatal("the session of token 18 wrote after 19 was admitted in its database")
	}
	if err := write(o7, 7); err != nil {
		t.Fatalf("a raise in postgres ended a session of v2other: %v", err)
	}
	p19 := testenv.Connect(t, e.b.FenceURL("app", "postgres", "billing", 19))
	// 8 in v2other ends o7, not p19.
	if err := e.raise(ctx, "v2other", "billing", 8); err != nil {
		t.Fatal(err)
	}
	if err := write(o7, 7); err == nil {
		t.Fatal("the session of token 7 wrote after 8 was admitted in its database")
	}
	if err := write(p19, 19); err != nil {
		t.Fatalf("a raise in v2other ended a session of postgres: %v", err)
	}
	// Stale tokens are refused at connect, per database.
	if err := connectErr(e.a.FenceURL("app", "postgres", "billing", 18)); v2Code(err) != fence.CodeStale {
		t.Fatalf("18 in postgres: %v, want ZF001", err)
	}
	if err := connectErr(e.a.FenceURL("app", "v2other", "billing", 7)); v2Code(err) != fence.CodeStale {
		t.Fatalf("7 in v2other: %v, want ZF001", err)
	}
	if err := connectErr(e.a.FenceURL("app", "v2other", "billing", 8)); err != nil {
		t.Fatalf("8 in v2other: %v", err)
	}
	var n18, n7 int
	e.admin.QueryRow(ctx, `SELECT count(*) FROM w WHERE token = 18`).Scan(&n18) //nolint:errcheck
	other.QueryRow(ctx, `SELECT count(*) FROM w WHERE token = 7`).Scan(&n7)     //nolint:errcheck
	if n18 != 1 || n7 != 2 {
		t.Fatalf("rows: %d of 18 in postgres (want 1), %d of 7 in v2other (want 2)", n18, n7)
	}
}

// ---------------------------------------------------------------------
// Two-phase commit: a transaction prepared by a session that goes stale
// outlives its backend. The raise refuses (ZF011, naming it) while it
// exists, and raises nothing; resolved, the raise goes through.

func TestV2PreparedTransactionBlocksRaise(t *testing.T) {
	t.Parallel()
	e := v2StartEnv(t, []string{"twophase"})
	ctx := v2Ctx(t)
	const res = "twophase"
	for _, resolve := range []string{"ROLLBACK PREPARED", "COMMIT PREPARED"} {
		t.Run(resolve, func(t *testing.T) {
			var tok int64
			e.admin.QueryRow(ctx, `SELECT coalesce(max(token), 0) + 1 FROM fence.tokens WHERE resource = $1`, res).Scan(&tok) //nolint:errcheck
			gid := fmt.Sprintf("v2-gid-%d", tok)
			stale := testenv.Connect(t, e.a.FenceURL("app", "postgres", res, tok))
			if _, err := stale.Exec(ctx, fmt.Sprintf("BEGIN; INSERT INTO public.v2_rows (resource, token, tag) VALUES ('%s', %d, 'prepared'); PREPARE TRANSACTION '%s'", res, tok, gid),
				pgx.QueryExecModeSimpleProtocol); err != nil {
				t.Fatal(err)
			}
			pid := stale.PgConn().PID()
			started, err := v2BackendStart(ctx, e.admin, pid)
			if err != nil {
				t.Fatal(err)
			}
			err = e.raise(ctx, "postgres", res, tok+1)
			if v2Code(err) != fence.CodeRaiseFailed || !strings.Contains(err.Error(), gid) {
				t.Fatalf("raise with %s prepared: %v, want ZF011 naming it", gid, err)
			}
			var stored int64
			e.admin.QueryRow(ctx, `SELECT token FROM fence.tokens WHERE resource = $1`, res).Scan(&stored) //nolint:errcheck
			if stored != tok {
				t.Fatalf("stored token %d after the refused raise, want %d", stored, tok)
			}
			alive, _ := v2BackendAlive(ctx, e.admin, pid, started)
			t.Logf("refused: %v; stale backend alive after the refused raise: %t", err, alive)
			// The operator resolves it; the raise goes through.
			if _, err := e.admin.Exec(ctx, fmt.Sprintf("%s '%s'", resolve, gid)); err != nil {
				t.Fatal(err)
			}
			if err := e.raise(ctx, "postgres", res, tok+1); err != nil {
				t.Fatalf("raise after %s: %v", resolve, err)
			}
			if alive, _ := v2BackendAlive(ctx, e.admin, pid, started); alive {
				t.Fatal("stale backend alive after the raise")
			}
			if _, err := stale.Exec(ctx, "SELECT 1"); err == nil {
				t.Fatal("the stale session still works after the raise")
			}
			total, after, err := v2StaleRows(ctx, e.admin, fmt.Sprintf(`SELECT xmin FROM public.v2_rows WHERE resource = $1 AND token = %d`, tok), res)
			if err != nil {
				t.Fatal(err)
			}
			want := 0
			if resolve == "COMMIT PREPARED" {
				want = 1 // committed by the operator, before the raise
			}
			if total != want || after != 0 {
				t.Fatalf("stale rows %d (want %d), %d after the raise", total, want, after)
			}
			if err := connectErr(e.a.FenceURL("app", "postgres", res, tok)); v2Code(err) != fence.CodeStale {
				t.Fatalf("reconnect with %d: %v, want ZF001", tok, err)
			}
		})
	}
}

// ---------------------------------------------------------------------
// A limit of binding sessions: code that a stale leader planted runs later in
// backends that are bound to nothing. Here autovacuum's ANALYZE evaluates an
// expression index whose (IMMUTABLE-labelled) function writes a row of the
// stale token, after the raise ended the stale session. v1 listed VACUUM FULL
// and ANALYZE run by the stale session itself (case 5, fenced by v2); the same
// code run by autovacuum is not a session's and no raise can end it. The
// threat model excludes programs that try to defeat the proxy, and a write
// from an index expression is no correct program's; this test documents the
// limit and fails while it exists. Run it with FENCEPROXY_KNOWN_LIMITS=1.
func TestV2AutovacuumRunsPlantedCode(t *testing.T) {
	if os.Getenv("FENCEPROXY_KNOWN_LIMITS") == "" {
		t.Skip("documents a known limit of v2 (autovacuum is not fenced); set FENCEPROXY_KNOWN_LIMITS=1 to run")
	}
	t.Parallel()
	e := v2StartEnv(t, []string{"planted"}, testenv.WithConf("autovacuum_naptime", "1"))
	ctx := v2Ctx(t)
	stale := testenv.Connect(t, e.a.FenceURL("app", "postgres", "planted", 1))
	if _, err := stale.Exec(ctx, `
CREATE TABLE public.v2_planted (x int) WITH (autovacuum_analyze_threshold = 1, autovacuum_analyze_scale_factor = 0);
CREATE FUNCTION public.v2_planted_idx(x int) RETURNS int LANGUAGE sql IMMUTABLE AS
    $$ SELECT public.v2_write('planted', 1, 'index expression') + x $$;
CREATE INDEX ON public.v2_planted (public.v2_planted_idx(x));
INSERT INTO public.v2_planted SELECT generate_series(1, 20);`, pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatal(err)
	}
	if err := e.raise(ctx, "postgres", "planted", 2); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		total, after, err := v2StaleRows(ctx, e.admin, v2DefaultRows, "planted")
		if err != nil {
			t.Fatal(err)
		}
		if after > 0 {
			t.Fatalf("%d rows of stale token 1 committed after token 2 was admitted (of %d), written by autovacuum's ANALYZE through the stale leader's expression index", after, total)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// ---------------------------------------------------------------------
// A stale session ended while the proxy has output for it that the client
// has not read: the stale leader is frozen (the case fencing exists for), or
// slow, or its result is one large message. When the client reads again, the
// stream must be well-formed up to the proxy's answer (ZF001 from a proxy that
// heard of the raise) and end, or the connection must just end (a closed
// connection is what a proxy that did not hear of the raise may give): within
// seconds, never a hang.
//
// A stale session whose client has not read its pending output (a frozen
// leader) must end, not hang: through the listening proxy the answer cannot
// reach a client that holds part of a message, so the connection closes
// (before the fix the proxy lingered for the client's next unit and the client
// waited for the rest of its message for staleLinger, 5 minutes). Through the
// proxy that did not hear of the raise, many rows end with the proxy's FATAL
// 08006; one row larger than the relay's buffer ends inside the row, then the
// connection closes.
func TestV2StaleSessionMidResult(t *testing.T) {
	t.Parallel()
	e := v2StartEnv(t, []string{"midresult"})
	ctx := v2Ctx(t)
	tok := int64(1)
	for _, tc := range []struct {
		name string
		sql  string
	}{
		{"one large row", "SELECT repeat('x', 64 << 20)"},
		{"many rows", "SELECT repeat('x', 1000) FROM generate_series(1, 100000)"},
	} {
		for _, listening := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/listening %t", tc.name, listening), func(t *testing.T) {
				px := e.a
				if listening {
					px = e.ah
				}
				s, err := v2Dial(v2Addr(px.Host, px.Port), v2Params("postgres", "midresult", tok))
				if err != nil {
					t.Fatal(err)
				}
				defer s.Close()
				// The client stops reading: the backend blocks writing the result.
				s.hold()
				if err := s.send(v2Q(tc.sql)); err != nil {
					t.Fatal(err)
				}
				deadline := time.Now().Add(20 * time.Second)
				for {
					var ev *string
					if err := e.admin.QueryRow(ctx, `SELECT wait_event FROM pg_stat_activity WHERE pid = $1`, int32(s.PID)).Scan(&ev); err != nil {
						t.Fatal(err)
					}
					if ev != nil && *ev == "ClientWrite" {
						break
					}
					if time.Now().After(deadline) {
						t.Fatal("the backend never blocked writing to the proxy")
					}
					time.Sleep(5 * time.Millisecond)
				}
				tok++
				if err := e.raise(ctx, "postgres", "midresult", tok); err != nil {
					t.Fatal(err)
				}
				time.Sleep(1500 * time.Millisecond) // frozen a while longer
				// The client wakes up: it reads, and sends its next unit after
				// the first ReadyForQuery.
				s.release()
				var msgs []v2Msg
				answered, probed := false, false
				deadline = time.Now().Add(15 * time.Second)
				for {
					m, ok, err := s.next(time.Until(deadline))
					if err != nil {
						t.Fatalf("the stale client hangs: %v after %d messages (last: %s)", err, len(msgs), v2Last(msgs))
					}
					if !ok {
						break
					}
					msgs = append(msgs, m)
					if answered && m.Type != "ErrorResponse" && m.Type != "ReadyForQuery" {
						t.Fatalf("server message %s after the proxy's answer (message %d)", v2Short(m.Text), len(msgs)-1)
					}
					if m.Type == "ErrorResponse" {
						if m.Err.Code != fence.CodeStale && (listening || (m.Err.Code != "57P01" && m.Err.Code != "08006")) {
							t.Fatalf("error %s", v2Short(m.Text))
						}
						answered = true
					}
					if m.Type == "ReadyForQuery" && !probed {
						probed = true
						s.send(v2Probe()...) //nolint:errcheck
					}
				}
				t.Logf("%d messages, answered %t, then the end (%v); last: %s", len(msgs), answered, s.end, v2Last(msgs))
			})
		}
	}
}

func v2Last(msgs []v2Msg) string {
	if len(msgs) == 0 {
		return "none"
	}
	return v2Short(msgs[len(msgs)-1].Text)
}

// ---------------------------------------------------------------------
// A fenced session whose backend ends with a FATAL of its own (not a raise's
// 57P01) sees exactly what a direct one sees: the server's FATAL, then the
// end. (At 76c742c the proxy added, a second later, a FATAL 08006 "the server
// closed the connection" whose hint blamed a raise. Found by the generated
// sequences, seed 38.)
func TestV2ServerFatalRelayedAlone(t *testing.T) {
	t.Parallel()
	e := v2StartEnv(t, []string{"ownfatal"})
	for _, tc := range []struct {
		name  string
		msgs  []pgproto3.FrontendMessage
		sleep time.Duration
	}{
		{"08P01 protocol synchronization lost in COPY", v2Msgs(v2PBE("", "", "COPY public.v2_rows (resource, token, tag) FROM STDIN"), v2Q("SELECT 1")), 0},
		{"25P03 idle-in-transaction timeout", v2Msgs(v2Q("SET idle_in_transaction_session_timeout = '200ms'"), v2Q("BEGIN")), 700 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			run := func(addr string, params map[string]string) []string {
				s, err := v2Dial(addr, params)
				if err != nil {
					t.Fatal(err)
				}
				defer s.Close()
				if err := s.send(tc.msgs...); err != nil {
					t.Fatal(err)
				}
				time.Sleep(tc.sleep)
				rest, err := s.drain(10 * time.Second)
				if err != nil {
					t.Fatal(err)
				}
				var out []string
				for _, m := range rest {
					out = append(out, m.Text)
				}
				return append(out, "EOF")
			}
			d := run(v2Addr(e.pg.Host, e.pg.Port), v2Params("postgres", "", 0))
			p := run(v2Addr(e.a.Host, e.a.Port), v2Params("postgres", "ownfatal", 1))
			if strings.Join(d, "\n") != strings.Join(p, "\n") {
				t.Fatalf("the proxy's session differs from a direct one:\n%s", diffLines(d, p))
			}
			t.Logf("%d messages alike, the last: %s", len(d), v2Short(d[len(d)-2]))
		})
	}
}
