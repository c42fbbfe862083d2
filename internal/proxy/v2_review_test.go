package proxy_test

// Regression tests of the adversarial review of fencing v2: one test per
// finding (F1, F2, F4, F6 to F11, and F8 through the proxy), each against a
// real PostgreSQL. Each test's comment names the finding and what it proves.

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// rvStored is the token stored in fence.tokens for res (0: none).
func rvStored(t *testing.T, admin querier, res string) int64 {
	t.Helper()
	var tok int64
	err := admin.QueryRow(ctxT(t), `SELECT coalesce((SELECT token FROM fence.tokens WHERE resource = $1), 0)`, res).Scan(&tok)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// rvLockTokenRow holds res's row of fence.tokens FOR UPDATE on a connection of
// its own until the returned func is called (or the test ends): every bind and
// raise of res waits for it.
func rvLockTokenRow(t *testing.T, adminURL, res string) (release func()) {
	t.Helper()
	conn := connect(t, adminURL)
	ctx := ctxT(t)
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SELECT 1 FROM fence.tokens WHERE resource = $1 FOR UPDATE`, res); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	release = func() { once.Do(func() { tx.Rollback(context.Background()) }) } //nolint:errcheck
	t.Cleanup(release)
	return release
}

// rvWaitLocked waits until a backend of user waits for a lock and returns its
// pid and pg_stat_activity.query, as read by conn.
func rvWaitLocked(t *testing.T, conn querier, user string) (int32, string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		var pid int32
		var q string
		err := conn.QueryRow(ctxT(t), `SELECT pid, query FROM pg_stat_activity
			WHERE usename = $1 AND wait_event_type = 'Lock' AND pid <> pg_backend_pid() LIMIT 1`, user).Scan(&pid, &q)
		if err == nil {
			return pid, q
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			t.Fatal(err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("no backend of %s waits for a lock within 20 s", user)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestForgedRaiseNotificationIsNotBelieved (F1): any session may NOTIFY on
// fence_raise. A proxy with a listener must take the stored token, not the
// payload: a forged "billing 999999" from an unfenced session directly on the
// server neither ends the fenced session of the stored token 5 nor refuses a
// new one; a real raise to 6 is still learned and ends the session of 5 with
// ZF001 promptly.
func TestForgedRaiseNotificationIsNotBelieved(t *testing.T) {
	t.Parallel()
	pg, admin := fencedDB(t)
	a := fencedProxy(t, pg, func(c *proxy.Config) { c.ControlDatabase = pg.AdminURL() })
	b := fencedProxy(t, pg)
	ctx := ctxT(t)

	s5 := connect(t, a.FenceURL("app", "postgres", "billing", 5))
	if got := rvStored(t, admin, "billing"); got != 5 {
		t.Fatalf("stored token %d after the bind of 5, want 5", got)
	}
	// The forgeries, from the application's role straight on the server: a
	// raise, a reset, one of a resource that has no stored token, and garbage.
	forger := connect(t, pg.URL("app", "postgres"))
	for _, payload := range []string{"billing 999999", "billing 1 reset", "other 999999", "billing"} {
		mustExec(t, forger, `SELECT pg_notify('fence_raise', $1)`, payload)
	}
	// A real raise of another resource, notified after the forgeries: once the
	// listener has learned it, it has read every forgery (one channel, in
	// commit order).
	connect(t, b.FenceURL("app", "postgres", "other", 3))
	waitStale(t, a, "postgres", "other", 3)
	if _, err := s5.Exec(ctx, "INSERT INTO items(tag, token) VALUES ('f1-after-forgery', 5)"); err != nil {
		t.Fatalf("the fenced session of the stored token 5 was ended by a forged notification: SQLSTATE %q: %v", sqlstate(err), err)
	}
	if h := a.Registry.Highest("postgres", "billing"); h != 5 {
		t.Fatalf("after the forged notifications the proxy believes billing's highest token is %d, want the stored 5", h)
	}
	if h := a.Registry.Highest("postgres", "other"); h != 3 {
		t.Fatalf("the proxy believes other's highest token is %d, want the stored 3", h)
	}
	again := connect(t, a.FenceURL("app", "postgres", "billing", 5))
	if _, err := again.Exec(ctx, "SELECT 1"); err != nil {
		t.Fatalf("a new session of token 5: %v", err)
	}

	// A real raise is still learned.
	start := time.Now()
	connect(t, b.FenceURL("app", "postgres", "billing", 6))
	waitStale(t, a, "postgres", "billing", 6)
	_, err := s5.Exec(ctx, "SELECT 1")
	wantStale(t, err)
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("the session of 5 learned of the raise after %v", d)
	}
	if n := count(t, admin, "SELECT count(*) FROM items WHERE tag = 'f1-after-forgery'"); n != 1 {
		t.Fatalf("%d rows of the session of 5 written after the forgeries, want 1", n)
	}
}

// TestOversizedAuthAnswerRefusedUnread (F2): before authentication the proxy
// does not buffer what a client announces. After the server's SCRAM challenge
// a client announces a 10 MB SASLInitialResponse and sends only its first
// bytes: the proxy answers FATAL 08P01 "... too large" at once (not at the
// login timeout, 30 s here, after waiting for 10 MB), and closes. A normal
// SCRAM login through the proxy still works.
func TestOversizedAuthAnswerRefusedUnread(t *testing.T) {
	t.Parallel()
	pg, _ := fencedDB(t, testenv.WithAuth("scram-sha-256"))
	p := fencedProxy(t, pg, func(c *proxy.Config) { c.LoginTimeout = 30 * time.Second })

	ok := connect(t, p.URLWithPassword("app", "app", "postgres", "fence.resource=billing", "fence.token=1"))
	if _, err := ok.Exec(ctxT(t), "SELECT 1"); err != nil {
		t.Fatalf("a session after a normal SCRAM login: %v", err)
	}

	r := dialRaw(t, proxyAddr(p))
	r.writeRaw(startupPacket(196608, "user", "app", "database", "postgres", "fence.resource", "billing", "fence.token", "1"))
	m, err := r.fe.Receive()
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := m.(*pgproto3.AuthenticationSASL); !ok {
		t.Fatalf("want AuthenticationSASL, got %s", normalize(m))
	}
	const announced = 10 << 20
	msg := []byte{'p'}
	msg = binary.BigEndian.AppendUint32(msg, announced+4)
	msg = append(msg, "SCRAM-SHA-256\x00"...)
	msg = binary.BigEndian.AppendUint32(msg, uint32(announced-4-len("SCRAM-SHA-256\x00")-4))
	msg = append(msg, "n,,n=,r="...)
	r.writeRaw(msg)
	start := time.Now()
	r.conn.SetReadDeadline(start.Add(10 * time.Second)) //nolint:errcheck
	msgs, err := r.readAll()
	e := errorOf(msgs)
	if e == nil {
		t.Fatalf("no error within %v of an announced %d-byte authentication answer (connection: %v)", time.Since(start).Round(time.Millisecond), announced, err)
	}
	if e.Code != wire.CodeProtocolViolation || e.Severity != wire.SeverityFatal || !strings.Contains(e.Message, "too large") {
		t.Fatalf("want FATAL 08P01 ... too large, got %s %s: %s", e.Severity, e.Code, e.Message)
	}
	if !isClosed(err) {
		t.Fatalf("the connection stays open after the error: %v", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("the refusal took %v", d)
	}
	t.Logf("refused after %v: %s", time.Since(start).Round(time.Millisecond), e.Message)
}

// proofRE matches a proof: a MAC of 32 bytes in hex.
var proofRE = regexp.MustCompile(`[0-9a-fA-F]{64}`)

// TestBindAndRaiseProofsNotInPgStatActivity (F4): the role's other sessions
// read pg_stat_activity.query of its fenced sessions. The bind's proof must
// not be there, neither while the bind runs (its text is fence.BindQuery with
// parameters) nor after it (the last statement is the COMMIT); nor the proof
// of a raise on a control connection (fence.Key.Raise, fence.RaiseQuery).
func TestBindAndRaiseProofsNotInPgStatActivity(t *testing.T) {
	t.Parallel()
	pg, admin := fencedDB(t)
	p := fencedProxy(t, pg)
	ctx := ctxT(t)
	peer := connect(t, pg.URL("app", "postgres")) // the role's other session

	s5 := connect(t, p.FenceURL("app", "postgres", "billing", 5))
	var q string
	if err := peer.QueryRow(ctx, `SELECT query FROM pg_stat_activity WHERE pid = $1`, int32(s5.PgConn().PID())).Scan(&q); err != nil {
		t.Fatal(err)
	}
	if proofRE.MatchString(q) || q != "COMMIT" {
		t.Fatalf("the fenced session's last query after its bind is %q, want COMMIT and no proof", q)
	}

	// A bind in progress: it waits for the token row.
	release := rvLockTokenRow(t, pg.AdminURL(), "billing")
	var bindErr error
	bound := make(chan struct{})
	go func() { defer close(bound); bindErr = connectErr(p.FenceURL("app", "postgres", "billing", 6)) }()
	t.Cleanup(func() { release(); <-bound })
	_, q = rvWaitLocked(t, peer, "app")
	if proofRE.MatchString(q) || q != fence.BindQuery {
		t.Fatalf("a bind in progress shows %q in pg_stat_activity, want %q and no proof", q, fence.BindQuery)
	}
	release()
	if <-bound; bindErr != nil {
		t.Fatalf("the bind of 6: %v", bindErr)
	}

	// A raise on a control connection, in progress.
	control := connect(t, pg.AdminURL())
	release = rvLockTokenRow(t, pg.AdminURL(), "billing")
	var raiseErr error
	raised := make(chan struct{})
	go func() {
		defer close(raised)
		var stored int64
		stored, raiseErr = testenv.Key.Raise(context.Background(), control, "billing", 7)
		if raiseErr == nil && stored != 7 {
			raiseErr = fmt.Errorf("stored %d after the raise, want 7", stored)
		}
	}()
	t.Cleanup(func() { release(); <-raised }) // before control closes
	_, q = rvWaitLocked(t, admin, testenv.AdminUser)
	if proofRE.MatchString(q) || q != fence.RaiseQuery {
		t.Fatalf("a raise in progress shows %q in pg_stat_activity, want %q and no proof", q, fence.RaiseQuery)
	}
	release()
	if <-raised; raiseErr != nil {
		t.Fatalf("the raise to 7: %v", raiseErr)
	}

	// Nowhere in pg_stat_activity a literal proof.
	rows, err := admin.Query(ctx, `SELECT pid, query FROM pg_stat_activity WHERE query ~ '[0-9a-fA-F]{64}'`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var pid int32
		rows.Scan(&pid, &q) //nolint:errcheck
		t.Errorf("backend %d shows a proof: %q", pid, q)
	}
}

// rvPsycopg2Script opens a transaction with an insert, says "inserted", waits
// for a line on stdin, then commits and prints the outcome's SQLSTATE.
const rvPsycopg2Script = `
import sys
import psycopg2

conn = psycopg2.connect(sys.argv[1])
cur = conn.cursor()
cur.execute("INSERT INTO items(tag) VALUES ('f6-psycopg2')")
print("inserted", flush=True)
sys.stdin.readline()
try:
    conn.commit()
    print("committed", flush=True)
except psycopg2.Error as e:
    print("pgcode=%s" % e.pgcode, flush=True)
    print("error=%s" % str(e).replace("\n", " | "), flush=True)
`

// TestStaleLeaderCommitGetsZF001InLibpq (F6): a stale leader frozen in a
// transaction while a raise ends its session sends its COMMIT later. Through
// libpq (psycopg2, and psql) the COMMIT must fail with SQLSTATE ZF001, not
// with "server closed the connection unexpectedly" (the proxy closed the
// socket after the FATAL, and the COMMIT met a reset). The session's proxy A
// learns of the raise made through proxy B by its listener.
func TestStaleLeaderCommitGetsZF001InLibpq(t *testing.T) {
	t.Parallel()
	if _, err := os.Stat(psycopg2Python); err != nil {
		t.Fatalf("%s not found: run `make deps` (python3-psycopg2)", psycopg2Python)
	}
	pg, admin := fencedDB(t)
	a := fencedProxy(t, pg, func(c *proxy.Config) { c.ControlDatabase = pg.AdminURL() })
	b := fencedProxy(t, pg)
	script := filepath.Join(t.TempDir(), "stale_commit.py")
	if err := os.WriteFile(script, []byte(rvPsycopg2Script), 0o644); err != nil {
		t.Fatal(err)
	}

	// raise raises billing to tok through B and waits until A has ended its
	// sessions of lower tokens (and a little more: A's FATAL is on its way
	// before the client sends its COMMIT).
	raise := func(t *testing.T, tok int64) {
		connect(t, b.FenceURL("app", "postgres", "billing", tok))
		waitStale(t, a, "postgres", "billing", tok)
		time.Sleep(300 * time.Millisecond)
	}

	t.Run("psycopg2", func(t *testing.T) {
		const tok = 10
		dsn := fmt.Sprintf("host=%s port=%d user=app dbname=postgres sslmode=disable options='-c fence.resource=billing -c fence.token=%d'", a.Host, a.Port, tok)
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, psycopg2Python, script, dsn)
		cmd.Env = clientEnv([]string{"PYTHONIOENCODING=utf-8"})
		var stderr strings.Builder
		cmd.Stderr = &stderr
		stdin, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		stdoutPipe, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		out := bufio.NewReader(stdoutPipe)
		if line, err := out.ReadString('\n'); line != "inserted\n" {
			cmd.Wait() //nolint:errcheck
			t.Fatalf("psycopg2 client: %q %v\n%s", line, err, stderr.String())
		}
		raise(t, tok+1)
		io.WriteString(stdin, "\n") //nolint:errcheck
		stdin.Close()
		rest, _ := io.ReadAll(out)
		if err := cmd.Wait(); err != nil {
			t.Fatalf("psycopg2 client: %v\n%s%s", err, rest, stderr.String())
		}
		if !strings.HasPrefix(string(rest), "pgcode="+fence.CodeStale+"\n") {
			t.Fatalf("the stale leader's COMMIT through psycopg2: want pgcode=%s, got:\n%s%s", fence.CodeStale, rest, stderr.String())
		}
		t.Logf("psycopg2: %s", strings.TrimSpace(string(rest)))
	})

	t.Run("psql", func(t *testing.T) {
		const tok = 20
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, pg.Bin("psql"), "-X", "-d", a.URL("app", "postgres"))
		cmd.Env = clientEnv([]string{fmt.Sprintf("PGOPTIONS=-c fence.resource=billing -c fence.token=%d", tok)})
		var stderr strings.Builder
		cmd.Stderr = &stderr
		stdin, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		stdoutPipe, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		io.WriteString(stdin, "\\set VERBOSITY verbose\nBEGIN;\nINSERT INTO items(tag) VALUES ('f6-psql');\n\\echo inserted\n") //nolint:errcheck
		out := bufio.NewReader(stdoutPipe)
		for {
			line, err := out.ReadString('\n')
			if line == "inserted\n" {
				break
			}
			if err != nil {
				cmd.Wait() //nolint:errcheck
				t.Fatalf("psql: %v\n%s", err, stderr.String())
			}
		}
		raise(t, tok+1)
		io.WriteString(stdin, "COMMIT;\n") //nolint:errcheck
		stdin.Close()
		rest, _ := io.ReadAll(out)
		cmd.Wait() //nolint:errcheck // psql exits non-zero after the lost connection
		if !regexp.MustCompile(`(ERROR|FATAL):  ` + fence.CodeStale + `: stale fencing token`).MatchString(stderr.String()) {
			t.Fatalf("the stale leader's COMMIT through psql: want SQLSTATE %s, got:\nstdout: %s\nstderr: %s", fence.CodeStale, rest, stderr.String())
		}
		t.Logf("psql: %s", strings.TrimSpace(stderr.String()))
	})

	if n := count(t, admin, "SELECT count(*) FROM items WHERE tag LIKE 'f6-%'"); n != 0 {
		t.Fatalf("%d rows of the stale leaders committed", n)
	}
}

// TestSilentServerEndOfStaleSessionIsAnError (F7): a fenced session through
// proxy B (no control database, so it never hears of a raise) whose server
// connection closes without a word must end with an ErrorResponse (08006
// from the proxy, with its hint, or the server's 57P01, or ZF001), never with
// a bare end of the connection.
//
//   - "blocked sending rows", the finding's case: the session runs a query of
//     many MB of rows and its client stops reading; a raise through proxy A
//     ends the backend, blocked sending, and PostgreSQL sends no FATAL then
//     (it would block again, and it may be in the middle of a message:
//     ProcessClientWriteInterrupt). The client then reads everything.
//   - "idle at a message boundary": the session's backend, idle, dies without
//     a word (SIGKILL); the client's next query must get the error.
func TestSilentServerEndOfStaleSessionIsAnError(t *testing.T) {
	t.Parallel()
	pg, admin := fencedDB(t)
	a := fencedProxy(t, pg)
	b := fencedProxy(t, pg, func(c *proxy.Config) { c.StaleWait = 100 * time.Millisecond })

	// fenced opens a raw session of billing tok through B and returns it with
	// its backend's pid.
	fenced := func(t *testing.T, tok int64) (*rawConn, uint32) {
		r := dialRaw(t, proxyAddr(b))
		r.writeRaw(startupPacket(196608, "user", "app", "database", "postgres", "fence.resource", "billing", "fence.token", fmt.Sprint(tok)))
		var pid uint32
		for {
			m, err := r.fe.Receive()
			if err != nil {
				t.Fatalf("fenced startup: %v", err)
			}
			switch m := m.(type) {
			case *pgproto3.BackendKeyData:
				pid = m.ProcessID
			case *pgproto3.ErrorResponse:
				t.Fatalf("fenced startup: %s %s", m.Code, m.Message)
			case *pgproto3.ReadyForQuery:
				return r, pid
			}
		}
	}
	// readToEnd reads until the connection ends and judges the end. It frames
	// the messages itself, to tell an end between two messages from one in
	// the middle of a message.
	readToEnd := func(t *testing.T, r *rawConn) {
		r.conn.SetReadDeadline(time.Now().Add(60 * time.Second)) //nolint:errcheck
		br := bufio.NewReaderSize(r.conn, 1<<16)
		var rows int
		var last *pgproto3.ErrorResponse
		var err error
		cut := false
		for {
			var hdr [5]byte
			if _, err = io.ReadFull(br, hdr[:]); err != nil {
				cut = errors.Is(err, io.ErrUnexpectedEOF)
				break
			}
			body := make([]byte, binary.BigEndian.Uint32(hdr[1:])-4)
			if _, err = io.ReadFull(br, body); err != nil {
				cut = true
				break
			}
			switch hdr[0] {
			case 'D':
				rows++
			case 'E':
				last = &pgproto3.ErrorResponse{}
				if err := last.Decode(body); err != nil {
					t.Fatal(err)
				}
			}
		}
		if !isClosed(err) {
			t.Fatalf("reading the stale session: %v", err)
		}
		if cut {
			t.Fatalf("the stale session ended in the middle of a message after %d rows (last error: %v): the client cannot read an error after it", rows, last)
		}
		if last == nil {
			t.Fatalf("the stale session ended with a bare end of the connection (%v) after %d rows: no error", err, rows)
		}
		switch last.Code {
		case wire.CodeConnectionFailure, wire.CodeAdminShutdown, fence.CodeStale:
		default:
			t.Fatalf("the stale session ended with %s %s: %s; want 08006, 57P01 or ZF001", last.Severity, last.Code, last.Message)
		}
		if last.Severity != wire.SeverityFatal || !strings.Contains(last.Hint, "fenceproxy") && last.Code != fence.CodeStale {
			t.Fatalf("want a FATAL with the proxy's hint, got %s %s: %s (hint %q)", last.Severity, last.Code, last.Message, last.Hint)
		}
		t.Logf("after %d rows: %s %s: %s", rows, last.Severity, last.Code, last.Message)
	}

	t.Run("blocked sending rows", func(t *testing.T) {
		r, _ := fenced(t, 5)
		const query = "SELECT repeat('x', 1000) FROM generate_series(1, 200000)" // 200 MB
		r.send(&pgproto3.Query{String: query})
		// Its backend blocks sending: the client reads nothing.
		deadline := time.Now().Add(20 * time.Second)
		for count(t, admin, `SELECT count(*) FROM pg_stat_activity WHERE usename = 'app' AND query = $1 AND wait_event = 'ClientWrite'`, query) == 0 {
			if time.Now().After(deadline) {
				t.Fatal("the query's backend does not block in ClientWrite within 20 s")
			}
			time.Sleep(20 * time.Millisecond)
		}
		connect(t, a.FenceURL("app", "postgres", "billing", 6)) // ends the backend before it commits
		readToEnd(t, r)
	})

	t.Run("idle at a message boundary", func(t *testing.T) {
		r, pid := fenced(t, 7)
		if err := syscall.Kill(int(pid), syscall.SIGKILL); err != nil {
			t.Fatalf("kill backend %d: %v", pid, err)
		}
		// PostgreSQL restarts after the crash of a backend: wait for it.
		eventually(t, "PostgreSQL accepting connections after the crash", func() error {
			return connectErr(pg.AdminURL())
		})
		// The proxy's wait for news of a raise (Config.StaleWait) runs out
		// and the session ends: the client's query comes after that.
		eventually(t, "proxy B's session ended", func() error {
			if n := testutil.ToFloat64(b.Metrics.Sessions); n != 0 {
				return fmt.Errorf("%v sessions open", n)
			}
			return nil
		})
		r.send(&pgproto3.Query{String: "SELECT 1"})
		readToEnd(t, r)
	})
}

// TestBindIgnoresRoleTimeouts (F9): the role's statement_timeout or
// lock_timeout must not fail the bind of a new leader whose raise takes
// longer (here it waits 300 ms for the token row, which another transaction
// holds, as a raise waits for a stale backend slow to die): the leader is
// admitted, and its session keeps the role's setting.
func TestBindIgnoresRoleTimeouts(t *testing.T) {
	t.Parallel()
	pg, admin := fencedDB(t)
	p := fencedProxy(t, pg)
	for i, setting := range []string{"statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout"} {
		t.Run(setting, func(t *testing.T) {
			mustExec(t, admin, "ALTER ROLE app SET "+setting+" = '50ms'")
			defer mustExec(t, admin, "ALTER ROLE app RESET "+setting)
			tok := int64(10 * (i + 1))
			old := connect(t, p.FenceURL("app", "postgres", "billing", tok))
			release := rvLockTokenRow(t, pg.AdminURL(), "billing")
			time.AfterFunc(300*time.Millisecond, release)
			start := time.Now()
			leader := connect(t, p.FenceURL("app", "postgres", "billing", tok+1))
			if d := time.Since(start); d < 250*time.Millisecond {
				t.Fatalf("the bind took %v: it did not wait for the token row, the test proves nothing", d)
			}
			var v string
			if err := leader.QueryRow(ctxT(t), "SHOW "+setting).Scan(&v); err != nil || v != "50ms" {
				t.Fatalf("the leader's %s is %q (%v), want the role's 50ms", setting, v, err)
			}
			if got := rvStored(t, admin, "billing"); got != tok+1 {
				t.Fatalf("stored token %d, want %d", got, tok+1)
			}
			if _, err := old.Exec(ctxT(t), "SELECT 1"); err == nil {
				t.Fatal("the session of the old token survived the raise")
			}
		})
	}
}

// TestStaleTokenNotDisclosedBeforeAuthentication (F10): a client that has not
// authenticated learns nothing of the admitted tokens. With a wrong password,
// or as an unknown user, and a stale token, the client gets the server's
// authentication error (28P01) and no token number; with the right password
// the same stale token is refused with ZF001.
func TestStaleTokenNotDisclosedBeforeAuthentication(t *testing.T) {
	t.Parallel()
	pg, _ := fencedDB(t, testenv.WithAuth("scram-sha-256"))
	p := fencedProxy(t, pg)
	const admitted = 734
	connect(t, p.URLWithPassword("app", "app", "postgres", "fence.resource=billing", fmt.Sprintf("fence.token=%d", admitted)))
	if h := p.Registry.Highest("postgres", "billing"); h != admitted {
		t.Fatalf("the proxy knows token %d, want %d: the test would prove nothing", h, admitted)
	}
	stale := fmt.Sprintf("fence.token=%d", admitted-1)
	for _, c := range []struct{ name, user, password string }{
		{"wrong password", "app", "wrong"},
		{"unknown user", "nobody", "app"},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := connectErr(p.URLWithPassword(c.user, c.password, "postgres", "fence.resource=billing", stale))
			pe := pgErrorOf(err)
			if pe == nil || pe.Code != "28P01" {
				t.Fatalf("want the server's 28P01, got SQLSTATE %q: %v", sqlstate(err), err)
			}
			for _, s := range []string{pe.Message, pe.Detail, pe.Hint} {
				if strings.Contains(s, fmt.Sprint(admitted)) || strings.Contains(strings.ToLower(s), "token") {
					t.Fatalf("the refusal of an unauthenticated client tells of the tokens: %+v", pe)
				}
			}
		})
	}
	err := connectErr(p.URLWithPassword("app", "app", "postgres", "fence.resource=billing", stale))
	wantStale(t, err)
	if !strings.Contains(err.Error(), fmt.Sprint(admitted)) {
		t.Fatalf("the authenticated client's refusal does not name token %d: %v", admitted, err)
	}
}

// TestDuplicateStartupParameters (F11): PostgreSQL takes the last value of a
// startup parameter given twice. The proxy must prove its bind for the same
// database: a startup with database "nosuchdb" then "postgres" binds and
// works. (A fence parameter given twice with different values is refused.)
func TestDuplicateStartupParameters(t *testing.T) {
	t.Parallel()
	pg, admin := fencedDB(t)
	p := fencedProxy(t, pg)

	t.Run("database twice", func(t *testing.T) {
		r := dialRaw(t, proxyAddr(p))
		r.writeRaw(startupPacket(196608, "user", "app", "database", "nosuchdb", "database", "postgres",
			"fence.resource", "billing", "fence.token", "5"))
		var pid uint32
		for done := false; !done; {
			m, err := r.fe.Receive()
			if err != nil {
				t.Fatalf("startup: %v", err)
			}
			switch m := m.(type) {
			case *pgproto3.BackendKeyData:
				pid = m.ProcessID
			case *pgproto3.ErrorResponse:
				t.Fatalf("startup with database given twice: %s %s: %s", m.Severity, m.Code, m.Message)
			case *pgproto3.ReadyForQuery:
				done = true
			}
		}
		r.send(&pgproto3.Query{String: "INSERT INTO items(tag, token) VALUES ('f11', 5) RETURNING current_database()"})
		var db string
		for done := false; !done; {
			m, err := r.fe.Receive()
			if err != nil {
				t.Fatal(err)
			}
			switch m := m.(type) {
			case *pgproto3.DataRow:
				db = string(m.Values[0])
			case *pgproto3.ErrorResponse:
				t.Fatalf("query: %s: %s", m.Code, m.Message)
			case *pgproto3.ReadyForQuery:
				done = true
			}
		}
		if db != "postgres" {
			t.Fatalf("current_database() %q, want postgres (the last value)", db)
		}
		if n := count(t, admin, `SELECT count(*) FROM fence.bindings WHERE pid = $1 AND resource = 'billing' AND token = 5`, int32(pid)); n != 1 {
			t.Fatalf("%d bindings of backend %d to billing 5, want 1", n, pid)
		}
	})

	t.Run("fence.token twice", func(t *testing.T) {
		r := dialRaw(t, proxyAddr(p))
		tr := r.startup(196608, "user", "app", "database", "postgres",
			"fence.resource", "billing", "fence.token", "5", "fence.token", "6")
		end := tr[len(tr)-1]
		if !strings.HasPrefix(end, "ErrorResponse") || !strings.Contains(end, `"Code":"`+fence.CodeMalformed+`"`) || !strings.Contains(end, "more than once") {
			t.Fatalf("fence.token given twice with different values: want ZF004, got %s", end)
		}
	})
}

// TestRefusedRaiseEndsNobody (F8): a raise that fails because the database
// holds a prepared transaction (ZF011) refuses before it ends anyone: the
// session of the stored token keeps working; once the prepared transaction
// is resolved, the raise goes through and ends it.
func TestRefusedRaiseEndsNobody(t *testing.T) {
	t.Parallel()
	pg, admin := fencedDB(t, testenv.WithConf("max_prepared_transactions", "2"))
	p := fencedProxy(t, pg)
	ctx := ctxT(t)
	s5 := connect(t, p.FenceURL("app", "postgres", "billing", 5))
	twopc := connect(t, pg.AdminURL())
	mustExec(t, twopc, "BEGIN")
	mustExec(t, twopc, "INSERT INTO items(tag) VALUES ('f8-prepared')")
	mustExec(t, twopc, "PREPARE TRANSACTION 'f8'")

	err := connectErr(p.FenceURL("app", "postgres", "billing", 6))
	if sqlstate(err) != fence.CodeRaiseFailed || !strings.Contains(err.Error(), "'f8'") {
		t.Fatalf("the raise to 6 with a prepared transaction: want ZF011 naming it, got %v", err)
	}
	if got := rvStored(t, admin, "billing"); got != 5 {
		t.Fatalf("stored token %d after the refused raise, want 5", got)
	}
	if _, err := s5.Exec(ctx, "INSERT INTO items(tag, token) VALUES ('f8-after-refusal', 5)"); err != nil {
		t.Fatalf("the session of 5 after the refused raise: SQLSTATE %q: %v", sqlstate(err), err)
	}

	mustExec(t, admin, "ROLLBACK PREPARED 'f8'")
	connect(t, p.FenceURL("app", "postgres", "billing", 6))
	if _, err := s5.Exec(ctx, "SELECT 1"); err == nil {
		t.Fatal("the session of 5 survived the raise to 6")
	}
	if n := count(t, admin, "SELECT count(*) FROM items WHERE tag = 'f8-after-refusal'"); n != 1 {
		t.Fatalf("%d rows of the session of 5, want 1", n)
	}
}

// TestServerFatalOfFencedSessionRelayedAlone (found by TestGeneratedSequences
// seed 38 after the F7 fix): when the server ends a fenced session with a
// FATAL error of its own that is not a raise's 57P01 (here the idle-session
// timeout, 57P05), the client gets that error and the end of the connection,
// as directly, and not a second FATAL 08006 "the server closed the
// connection" with a hint that blames a raise.
func TestServerFatalOfFencedSessionRelayedAlone(t *testing.T) {
	t.Parallel()
	pg, _ := fencedDB(t)
	p := fencedProxy(t, pg)
	for _, via := range []struct{ name, addr string }{{"direct", pgAddr(pg)}, {"fenced", proxyAddr(p)}} {
		t.Run(via.name, func(t *testing.T) {
			r := dialRaw(t, via.addr)
			params := []string{"user", "app", "database", "postgres"}
			if via.name == "fenced" {
				params = append(params, "fence.resource", "billing", "fence.token", "5")
			}
			if tr := r.startup(196608, params...); !strings.HasPrefix(tr[len(tr)-1], "ReadyForQuery") {
				t.Fatalf("startup: %q", tr)
			}
			r.send(&pgproto3.Query{String: "SET idle_session_timeout = '200ms'"})
			if _, err := r.readUntil(1, ""); err != nil {
				t.Fatal(err)
			}
			r.conn.SetReadDeadline(time.Now().Add(10 * time.Second)) //nolint:errcheck
			msgs, err := r.readAll()
			if !isClosed(err) {
				t.Fatalf("the session did not end: %v", err)
			}
			var got []string
			for _, m := range msgs {
				if e, ok := m.(*pgproto3.ErrorResponse); ok {
					got = append(got, e.Severity+" "+e.Code+": "+e.Message)
				}
			}
			if len(got) != 1 || !strings.HasPrefix(got[0], "FATAL 57P05: ") {
				t.Fatalf("want the server's FATAL 57P05 alone, got %q", got)
			}
		})
	}
}

// TestFrozenClientGetsEveryAnswerBeforeTheError (second review, finding 01):
// a stale leader's client pipelines a SELECT of 6 MB and an INSERT and stops
// reading; the backend sends everything (most of it backs up between the
// server and the proxy), commits the INSERT and goes idle; a new leader's
// raise ends it; the client wakes up 1.5 s later. Through the proxy that
// hears of the raise, the client must still read every answer the server gave
// (the rows whole, the SELECT's and the INSERT's CommandComplete and
// ReadyForQuery) and only then the proxy's ZF001: before the fix the proxy
// closed the server connection when it heard of the raise, dropped what was
// still buffered and cut the client off inside a row, after 1 s, with no
// error, so the client never learned that its INSERT committed. Through the
// proxy that does not hear of it, the same answers, then the server's end.
func TestFrozenClientGetsEveryAnswerBeforeTheError(t *testing.T) {
	t.Parallel()
	e := v2StartEnv(t, []string{"frozen"})
	ctx := v2Ctx(t)
	for i, listening := range []bool{true, false} {
		t.Run(fmt.Sprintf("listening %t", listening), func(t *testing.T) {
			px, tok := e.a, int64(2*i+1)
			if listening {
				px = e.ah
			}
			// A small receive buffer: most of the result stays on the
			// proxy's side of the client connection and before it.
			s, err := v2DialBuffer(v2Addr(px.Host, px.Port), v2Params("postgres", "frozen", tok), 16<<10)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			s.hold()
			tag := fmt.Sprintf("frozen-%t", listening)
			if err := s.send(v2Q("SELECT repeat('x', 1000) FROM generate_series(1, 6000)"),
				v2Q(fmt.Sprintf("INSERT INTO public.v2_rows (resource, token, tag) VALUES ('frozen', %d, '%s')", tok, tag))); err != nil {
				t.Fatal(err)
			}
			deadline := time.Now().Add(20 * time.Second)
			for {
				var n int
				if err := e.admin.QueryRow(ctx, `SELECT count(*) FROM public.v2_rows WHERE tag = $1`, tag).Scan(&n); err != nil {
					t.Fatal(err)
				}
				if n == 1 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("the INSERT did not commit within 20 s: the result did not fit between the server and the client")
				}
				time.Sleep(10 * time.Millisecond)
			}
			if err := e.raise(ctx, "postgres", "frozen", tok+1); err != nil {
				t.Fatal(err)
			}
			time.Sleep(1500 * time.Millisecond) // frozen a while longer
			s.release()
			msgs, err := s.untilRFQ(0, "ErrorResponse", 30*time.Second)
			if err != nil {
				t.Fatalf("%v after %d messages (last: %s)", err, len(msgs), v2Last(msgs))
			}
			// The client's next unit gets the error again (or finds the
			// connection closed), and the connection ends.
			s.send(v2Probe()...) //nolint:errcheck // closed, maybe
			if rest, err := s.drain(10 * time.Second); err != nil {
				t.Fatalf("after the error: %v (%d more messages)", err, len(rest))
			}
			var rows int
			var tags []string
			var fenceErr *pgproto3.ErrorResponse
			for _, m := range msgs {
				switch {
				case m.Type == "DataRow":
					rows++
					if fenceErr != nil {
						t.Fatalf("a DataRow after the error %s", fenceErr.Code)
					}
				case m.Type == "CommandComplete":
					tags = append(tags, m.Text)
				case m.Type == "ErrorResponse" && fenceErr == nil:
					fenceErr = m.Err
				}
			}
			if rows != 6000 || len(tags) != 2 || !strings.Contains(tags[1], "INSERT 0 1") {
				t.Fatalf("the client read %d of 6000 rows and CommandCompletes %q (want the SELECT's and INSERT 0 1); end: %v; last: %s", rows, tags, s.end, v2Last(msgs))
			}
			switch {
			case fenceErr == nil:
				t.Fatalf("no error after the answers: the session ended silently (%v)", s.end)
			case listening && fenceErr.Code != fence.CodeStale:
				t.Fatalf("the listening proxy said %s %s, want ZF001", fenceErr.Code, fenceErr.Message)
			case !listening && fenceErr.Code != fence.CodeStale && fenceErr.Code != wire.CodeAdminShutdown && fenceErr.Code != wire.CodeConnectionFailure:
				t.Fatalf("the proxy said %s %s, want ZF001, 57P01 or 08006", fenceErr.Code, fenceErr.Message)
			}
		})
	}
}

// TestBindGivenUpIsCancelled (second review, finding 06): a new leader's bind
// whose raise waits for a stale backend that cannot exit (SIGSTOP) runs past
// the login timeout: the client is told "login timeout", and the proxy cancels
// the bind, so that its raise does not commit later, when nobody waits for it
// (before the fix it committed once the stale backend was resumed).
func TestBindGivenUpIsCancelled(t *testing.T) {
	t.Parallel()
	pg, admin := fencedDB(t)
	p := fencedProxy(t, pg, func(c *proxy.Config) { c.LoginTimeout = 2 * time.Second })
	old := connect(t, p.FenceURL("app", "postgres", "billing", 1))
	pid := int(old.PgConn().PID())
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatalf("SIGSTOP backend %d: %v", pid, err)
	}
	resumed := false
	resume := func() {
		if !resumed {
			resumed = true
			syscall.Kill(pid, syscall.SIGCONT) //nolint:errcheck
		}
	}
	defer resume()
	err := connectErr(p.FenceURL("app", "postgres", "billing", 2))
	if err == nil || !strings.Contains(err.Error(), "login timeout") {
		t.Fatalf("the new leader's session: %v, want the login timeout", err)
	}
	resume()
	backendGone(t, admin, uint32(pid), 10*time.Second)
	time.Sleep(500 * time.Millisecond) // time for a raise that was not cancelled to commit
	if got := rvStored(t, admin, "billing"); got != 1 {
		t.Fatalf("stored token %d after the bind was given up, want 1 (a raise nobody waited for committed)", got)
	}
	// The new leader's next attempt goes through.
	connect(t, p.FenceURL("app", "postgres", "billing", 2))
}

// TestBindBackendTerminatedSaysSo (second review, finding 03): any session of
// the application's role may pg_terminate_backend the backend of a new
// leader's bind (PostgreSQL lets a role signal its own backends). The client
// is told the server's 57P01 with a hint that nothing was bound, not
// "fenceproxy lost the server while binding the session: EOF".
func TestBindBackendTerminatedSaysSo(t *testing.T) {
	t.Parallel()
	pg, admin := fencedDB(t)
	p := fencedProxy(t, pg)
	old := connect(t, p.FenceURL("app", "postgres", "billing", 1))
	// The raise of the next bind waits for this backend: stopped, it cannot exit.
	pid := int(old.PgConn().PID())
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatalf("SIGSTOP backend %d: %v", pid, err)
	}
	defer syscall.Kill(pid, syscall.SIGCONT) //nolint:errcheck
	errc := make(chan error, 1)
	go func() { errc <- connectErr(p.FenceURL("app", "postgres", "billing", 2)) }()
	var binding int32
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := admin.QueryRow(ctxT(t), `SELECT pid FROM pg_stat_activity WHERE usename = 'app' AND query LIKE '%fence.bind%' AND state = 'active'`).Scan(&binding)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no bind running within 10 s: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	killer := connect(t, pg.URL("app", "postgres"))
	mustExec(t, killer, "SELECT pg_terminate_backend($1)", binding)
	err := <-errc
	wantCode(t, err, wire.CodeAdminShutdown)
	if !strings.Contains(err.Error(), "terminating connection") {
		t.Fatalf("%v: want the server's own message", err)
	}
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || !strings.Contains(pe.Hint, "nothing was bound") {
		t.Fatalf("%v: want the proxy's hint that nothing was bound", err)
	}
}

// TestLateSyncAfterTheErrorIsAnswered (second review, LOG 01:57): a stale
// session's client sends Parse, Bind, Execute and Flush, reads the proxy's
// ZF001, and sends its Sync 1.5 s later: it gets the ReadyForQuery that ends
// the unit, then the end (before the fix the write deadline of the first
// answer had passed, and the Sync got the end alone).
func TestLateSyncAfterTheErrorIsAnswered(t *testing.T) {
	t.Parallel()
	e := v2StartEnv(t, []string{"latesync"})
	ctx := v2Ctx(t)
	s, err := v2Dial(v2Addr(e.ah.Host, e.ah.Port), v2Params("postgres", "latesync", 1))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := e.raise(ctx, "postgres", "latesync", 2); err != nil {
		t.Fatal(err)
	}
	// The idle client is told at once (FATAL ZF001); the proxy keeps the
	// connection for its next unit.
	if _, err := s.untilRFQ(0, "ErrorResponse", 15*time.Second); err != nil {
		t.Fatalf("the idle stale session was not told: %v", err)
	}
	if err := s.send(append(v2PBE("", "", "SELECT 1"), &pgproto3.Flush{})...); err != nil {
		t.Fatal(err)
	}
	m, err := s.untilRFQ(0, "ErrorResponse", 15*time.Second)
	if err != nil || m[len(m)-1].Err.Code != fence.CodeStale {
		t.Fatalf("the unit's first messages: %v %v, want ERROR ZF001", err, m)
	}
	time.Sleep(1500 * time.Millisecond)
	if err := s.send(&pgproto3.Sync{}); err != nil {
		t.Fatal(err)
	}
	rest, err := s.drain(15 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if len(rest) != 1 || rest[0].Type != "ReadyForQuery" {
		t.Fatalf("the late Sync got %d messages (%s), want one ReadyForQuery, then the end", len(rest), v2Last(rest))
	}
}
