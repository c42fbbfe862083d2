package proxy_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// testClientDisconnect: when the client goes away, the proxy closes the
// upstream connection, the backend ends and its transaction rolls back.
//
// A backend busy in a query notices a closed socket only when it next
// reads or writes, or every client_connection_check_interval: the sessions
// set it, as they would for a direct connection, so that a pg_sleep
// notices too.
func testClientDisconnect(t *testing.T, s *suite) {
	_, p, admin := s.setup(t)
	mustExec(t, admin, "CREATE TABLE gone (tag text)")
	tests := []struct {
		name string
		// busy starts what the session is doing when its client vanishes;
		// it returns once the backend is at it, with a function that waits
		// for the client's side of it to end.
		busy func(t *testing.T, conn *pgx.Conn) (wait func())
	}{
		{"idle in transaction", func(t *testing.T, conn *pgx.Conn) func() { return func() {} }},
		{"in a query", func(t *testing.T, conn *pgx.Conn) func() {
			done := make(chan struct{})
			go func() {
				defer close(done)
				conn.Exec(context.Background(), "SELECT pg_sleep(30)") //nolint:errcheck // the connection is killed under it
			}()
			waitActive(t, admin, conn.PgConn().PID(), "pg_sleep")
			return func() { <-done }
		}},
		{"in COPY FROM STDIN", func(t *testing.T, conn *pgx.Conn) func() {
			pr, pw := io.Pipe()
			done := make(chan struct{})
			go func() {
				defer close(done)
				conn.PgConn().CopyFrom(context.Background(), pr, "COPY gone FROM STDIN") //nolint:errcheck
			}()
			fmt.Fprintf(pw, "copied\ncopied\n")
			waitActive(t, admin, conn.PgConn().PID(), "COPY")
			return func() { pw.Close(); <-done }
		}},
		{"receiving a large result", func(t *testing.T, conn *pgx.Conn) func() {
			rows, err := conn.Query(context.Background(), "SELECT repeat('x', 1000000) FROM generate_series(1, 2000)")
			if err != nil {
				t.Fatal(err)
			}
			if !rows.Next() {
				t.Fatal(rows.Err())
			}
			return func() {}
		}},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			tag := fmt.Sprint("tag", i)
			conn := connect(t, p.URL(testenv.AdminUser, "postgres", "client_connection_check_interval=100ms"))
			pid := conn.PgConn().PID()
			mustExec(t, conn, "BEGIN")
			mustExec(t, conn, "INSERT INTO gone VALUES ($1)", tag)
			wait := tt.busy(t, conn)
			conn.PgConn().Conn().Close() // the client vanishes without Terminate
			wait()
			took := backendGone(t, admin, pid, 15*time.Second)
			t.Logf("backend gone %v after the client", took)
			if n := count(t, admin, "SELECT count(*) FROM gone WHERE tag = $1", tag); n != 0 {
				t.Fatalf("%d rows of the vanished client's transaction committed", n)
			}
		})
	}
}

// TestUpstreamRestartAndCrash: when the server goes away, clients get an
// error promptly (never a hang), and once it is back new sessions work.
// It has a cluster of its own, which it restarts and crashes.
func TestUpstreamRestartAndCrash(t *testing.T) {
	t.Parallel()
	pg, p, _ := newSuite(t).setup(t)
	url := p.URL(testenv.AdminUser, "postgres")

	// A clean restart: the server's goodbye (57P01) reaches the client.
	idle := connect(t, url)
	waitErr := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, err := idle.WaitForNotification(ctx)
		waitErr <- err
	}()
	time.Sleep(50 * time.Millisecond)
	pg.Restart(t)
	select {
	case err := <-waitErr:
		wantCode(t, err, "57P01")
	case <-time.After(10 * time.Second):
		t.Fatal("the idle client heard nothing of the restart")
	}
	if c := count(t, connect(t, url), "SELECT 1"); c != 1 {
		t.Fatal(c)
	}

	// A crash: busy, idle and in-transaction sessions all fail promptly.
	busy, idle2, inTx := connect(t, url), connect(t, url), connect(t, url)
	mustExec(t, inTx, "BEGIN")
	busyErr := make(chan error, 1)
	go func() {
		_, err := busy.Exec(context.Background(), "SELECT pg_sleep(30)")
		busyErr <- err
	}()
	time.Sleep(200 * time.Millisecond)
	pg.Kill(t)
	start := time.Now()
	select {
	case err := <-busyErr:
		if err == nil {
			t.Fatal("the busy query succeeded")
		}
		t.Logf("busy session: %v after %v", err, time.Since(start))
	case <-time.After(5 * time.Second):
		t.Fatal("the busy client got no error within 5 s of the crash")
	}
	for name, conn := range map[string]*pgx.Conn{"idle": idle2, "in transaction": inTx} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		qs := time.Now()
		_, err := conn.Exec(ctx, "SELECT 1")
		cancel()
		if err == nil || time.Since(qs) > 5*time.Second {
			t.Fatalf("%s session after the crash: %v after %v", name, err, time.Since(qs))
		}
	}
	// While the server is down: a clear, prompt refusal.
	cs := time.Now()
	err := connectErr(url)
	wantCode(t, err, "08006")
	if time.Since(cs) > 10*time.Second {
		t.Fatalf("refusal took %v", time.Since(cs))
	}
	pg.Start(t)
	if c := count(t, connect(t, url), "SELECT 2"); c != 2 {
		t.Fatal(c)
	}
}

// testMaxMessageSize: a message above MaxMessageSize, in either direction,
// ends that session with 54000 and a message that names the limit; other
// sessions go on.
func testMaxMessageSize(t *testing.T, s *suite) {
	const limit = 1 << 20
	_, p, _ := s.setup(t, func(c *proxy.Config) { c.MaxMessageSize = limit })
	url := p.URL(testenv.AdminUser, "postgres")
	bystander := connect(t, url)
	big := strings.Repeat("b", 2*limit)
	tests := []struct {
		name string
		run  func(t *testing.T, conn *pgx.Conn) error
	}{
		{"query text", func(t *testing.T, conn *pgx.Conn) error {
			_, err := conn.PgConn().Exec(ctxT(t), "SELECT '"+big+"'").ReadAll()
			return err
		}},
		{"parameter", func(t *testing.T, conn *pgx.Conn) error {
			_, err := conn.Exec(ctxT(t), "SELECT length($1::text)", big)
			return err
		}},
		{"row", func(t *testing.T, conn *pgx.Conn) error {
			_, err := conn.Exec(ctxT(t), "SELECT repeat('r', $1::int)", 2*limit)
			return err
		}},
		{"notice", func(t *testing.T, conn *pgx.Conn) error {
			_, err := conn.Exec(ctxT(t), "DO $$BEGIN RAISE NOTICE '%', repeat('n', 2 * 1024 * 1024); END$$")
			return err
		}},
	}
	t.Run("cases", func(t *testing.T) {
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				t.Parallel()
				conn := connect(t, url)
				// Just under the limit passes.
				if c := count(t, conn, "SELECT length($1::text)", big[:limit-1000]); c != limit-1000 {
					t.Fatal(c)
				}
				err := tt.run(t, conn)
				wantCode(t, err, wire.CodeProgramLimitExceeded)
				if !strings.Contains(err.Error(), fmt.Sprint(limit)) {
					t.Errorf("the error does not name the limit: %v", err)
				}
			})
		}
		t.Run("COPY data", func(t *testing.T) {
			t.Parallel()
			r := dialRaw(t, proxyAddr(p))
			r.startup(wire.ProtocolVersion30, "user", testenv.AdminUser, "database", "postgres")
			r.send(&pgproto3.Query{String: "CREATE TEMP TABLE c (v text); COPY c FROM STDIN"})
			if _, err := r.readUntil(0, "CopyInResponse"); err != nil {
				t.Fatal(err)
			}
			r.conn.Write(wire.AppendMessage(nil, 'd', []byte(big+"\n"))) //nolint:errcheck // the proxy closes before reading it all
			msgs, err := r.readAll()
			e := errorOf(msgs)
			if e == nil || e.Code != wire.CodeProgramLimitExceeded || !isClosed(err) {
				t.Fatalf("want 54000 and a close, got %+v %v", msgs, err)
			}
		})
	})
	t.Run("others unaffected", func(t *testing.T) {
		// After the cases; the bystander's session was open all along.
		if c := count(t, bystander, "SELECT length($1::text)", big[:limit/2]); c != limit/2 {
			t.Fatal(c)
		}
		if c := count(t, connect(t, url), "SELECT 1"); c != 1 {
			t.Fatal(c)
		}
	})
}

// testLoginTimeout: a client that does not finish its startup within
// LoginTimeout is closed; established sessions are not timed out.
func testLoginTimeout(t *testing.T, s *suite) {
	const timeout = 500 * time.Millisecond
	_, p, _ := s.setup(t, func(c *proxy.Config) { c.LoginTimeout = timeout })
	alice := authRoles["password"] // see setupAuth
	tests := []struct {
		name  string
		start func(r *rawConn)
	}{
		{"sends nothing", func(r *rawConn) {}},
		{"half a startup packet", func(r *rawConn) {
			r.writeRaw(startupPacket(wire.ProtocolVersion30, "user", alice)[:9])
		}},
		{"SSLRequest then nothing", func(r *rawConn) {
			r.writeRaw(requestPacket(wire.SSLRequestCode))
			if b, err := r.readByte(); err != nil || b != 'N' {
				r.t.Fatalf("SSLRequest answered %q %v", b, err)
			}
		}},
		{"never answers the password request", func(r *rawConn) {
			r.writeRaw(startupPacket(wire.ProtocolVersion30, "user", alice, "database", "postgres"))
			m, err := r.fe.Receive()
			if _, ok := m.(*pgproto3.AuthenticationCleartextPassword); !ok || err != nil {
				r.t.Fatalf("want a password request, got %T %v", m, err)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			// Before the dial: the proxy's clock starts at its accept,
			// which a loaded machine may run well before dialRaw returns.
			start := time.Now()
			r := dialRaw(t, proxyAddr(p))
			tt.start(r)
			msgs, err := r.readAll()
			took := time.Since(start)
			if !isClosed(err) {
				t.Fatalf("not closed: %v", err)
			}
			if took < timeout-50*time.Millisecond || took > timeout+5*time.Second {
				t.Fatalf("closed after %v, LoginTimeout is %v", took, timeout)
			}
			if e := errorOf(msgs); e != nil {
				if e.Code != wire.CodeProtocolViolation {
					t.Fatalf("error %s %s", e.Code, e.Message)
				}
				t.Logf("closed after %v with %s: %s", took, e.Code, e.Message)
			} else {
				t.Logf("closed after %v without a message", took)
			}
		})
	}
	t.Run("established sessions outlive it", func(t *testing.T) {
		t.Parallel()
		conn := connect(t, p.URLWithPassword(alice, authPassword, "postgres"))
		time.Sleep(timeout + 300*time.Millisecond)
		if c := count(t, conn, "SELECT 1"); c != 1 {
			t.Fatal(c)
		}
	})
}

// testUpstreamUnreachable: when the server cannot be reached, or does not
// answer, the client hears so promptly.
func testUpstreamUnreachable(t *testing.T, s *suite) {
	pg := s.pg

	// Listeners that accept and then stay silent, or hang up at once.
	listen := func(onAccept func(net.Conn)) string {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		t.Cleanup(func() { ln.Close(); wg.Wait() })
		wg.Go(func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				wg.Go(func() { onAccept(c) })
			}
		})
		return "postgres://" + ln.Addr().String()
	}
	silent := listen(func(c net.Conn) {
		io.Copy(io.Discard, c) //nolint:errcheck // until the proxy gives up
		c.Close()
	})
	hangUp := listen(func(c net.Conn) { c.Close() })

	tests := []struct {
		name     string
		upstream string
		code     string
		msg      string
		within   time.Duration
	}{
		{"closed port", fmt.Sprintf("postgres://127.0.0.1:%d", testenv.FreePort(t)), wire.CodeConnectionFailure, "could not connect to the server", 2 * time.Second},
		{"hangs up at once", hangUp, wire.CodeConnectionFailure, "lost the server", 2 * time.Second},
		// LoginTimeout bounds the whole startup, the server's part included.
		{"never answers", silent, wire.CodeConnectionFailure, "timeout", 3 * time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			p := testenv.StartProxy(t, pg, proxy.Config{Unfenced: proxy.UnfencedAllow, Upstream: tt.upstream, LoginTimeout: time.Second})
			start := time.Now()
			err := connectErr(p.URL(testenv.AdminUser, "postgres"))
			took := time.Since(start)
			wantCode(t, err, tt.code)
			if !strings.Contains(err.Error(), tt.msg) {
				t.Errorf("error %q does not say %q", err, tt.msg)
			}
			if took > tt.within {
				t.Fatalf("error after %v, want within %v", took, tt.within)
			}
			t.Logf("%v after %v", err, took)
		})
	}
}

// testMaxClients: the connection over MaxClients is refused with 53300, as
// the server does over max_connections.
func testMaxClients(t *testing.T, s *suite) {
	_, p, _ := s.setup(t, func(c *proxy.Config) { c.MaxClients = 2 })
	url := p.URL(testenv.AdminUser, "postgres")
	first := connect(t, url)
	connect(t, url)
	err := connectErr(url)
	wantCode(t, err, wire.CodeTooManyConnections)
	first.Close(ctxT(t))
	eventually(t, 5*time.Second, "admitted after a client left", func() error {
		err := connectErr(url)
		if err != nil && sqlstate(err) != wire.CodeTooManyConnections {
			t.Fatalf("after a client left: %v", err)
		}
		return err
	})
}

// testGracefulShutdown: on shutdown the proxy stops accepting, closes idle
// sessions with 57P01, lets sessions in a transaction or a query finish
// within ShutdownGrace, then closes the rest; Serve returns nil.
func testGracefulShutdown(t *testing.T, s *suite) {
	const grace = 2 * time.Second
	_, p, admin := s.setup(t, func(c *proxy.Config) { c.ShutdownGrace = grace })
	mustExec(t, admin, "CREATE TABLE shut (tag text)")
	url := p.URL(testenv.AdminUser, "postgres")
	idle, inTx, stuck, querying := connect(t, url), connect(t, url), connect(t, url), connect(t, url)
	var pids []int32
	for _, c := range []*pgx.Conn{idle, inTx, stuck, querying} {
		pids = append(pids, int32(c.PgConn().PID()))
	}
	mustExec(t, inTx, "BEGIN")
	mustExec(t, inTx, "INSERT INTO shut VALUES ('tx1')")
	mustExec(t, stuck, "BEGIN")
	mustExec(t, stuck, "INSERT INTO shut VALUES ('stuck')")

	idleErr := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, err := idle.WaitForNotification(ctx)
		idleErr <- err
	}()
	type result struct {
		n   int
		err error
	}
	queryDone := make(chan result, 1)
	go func() {
		var n int
		err := querying.QueryRow(context.Background(), "SELECT 7 FROM pg_sleep(1)").Scan(&n)
		queryDone <- result{n, err}
	}()
	waitActive(t, admin, querying.PgConn().PID(), "pg_sleep")

	start := time.Now()
	stopped := make(chan struct{})
	go func() {
		p.Stop(t) // reports an error if Serve did not return nil
		close(stopped)
	}()
	select {
	case err := <-idleErr:
		wantCode(t, err, wire.CodeAdminShutdown)
		t.Logf("idle session closed after %v: %v", time.Since(start), err)
	case <-time.After(5 * time.Second):
		t.Fatal("the idle session was not closed")
	}
	// No new clients.
	if _, err := net.DialTimeout("tcp", proxyAddr(p), time.Second); err == nil {
		t.Error("the proxy still accepts connections while shutting down")
	}
	// The transaction may still finish.
	mustExec(t, inTx, "INSERT INTO shut VALUES ('tx2')")
	if _, err := inTx.Exec(ctxT(t), "COMMIT"); err != nil {
		t.Fatalf("COMMIT during the grace period: %v", err)
	}
	// The query in flight finishes too.
	select {
	case r := <-queryDone:
		if r.err != nil || r.n != 7 {
			t.Fatalf("the query in flight at shutdown: %d %v", r.n, r.err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the query in flight did not finish")
	}
	select {
	case <-stopped:
	case <-time.After(grace + 5*time.Second):
		t.Fatalf("Serve did not return within %v", grace+5*time.Second)
	}
	took := time.Since(start)
	if took < grace-100*time.Millisecond {
		t.Fatalf("stopped after %v, before the grace period of %v, with a transaction open", took, grace)
	}
	t.Logf("stopped after %v (grace %v)", took, grace)
	for _, c := range []*pgx.Conn{inTx, stuck, querying} {
		if _, err := c.Exec(ctxT(t), "SELECT 1"); err == nil {
			t.Fatal("a session is still open after the shutdown")
		}
	}
	for _, pid := range pids {
		backendGone(t, admin, uint32(pid), 15*time.Second)
	}
	var tags []string
	rows, _ := admin.Query(ctxT(t), "SELECT tag FROM shut ORDER BY tag")
	tags, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || strings.Join(tags, ",") != "tx1,tx2" {
		t.Fatalf("rows %q %v, want tx1,tx2 (the stuck transaction rolled back)", tags, err)
	}
}
