package proxy_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
)

// A stale session's next call fails with ZF001 in the driver's own error type, whether the
// client waited for an answer then or wakes later inside the linger: the unit gets the
// error as an ERROR and its ReadyForQuery (libpq's PQexec keeps a unit's last result, and a
// FATAL then the end would leave psycopg "consuming input failed" without a SQLSTATE), then
// the end follows as PostgreSQL ends a terminated backend's session, a FATAL and the end of
// the connection, which the driver's next call reads (pgx's IsClosed). A client that wakes
// after the linger gets the FATAL it was sent while idle and the end. The DETAIL says
// whether a unit was in flight, and /status lists the end (phase "session") and counts it.
func TestStaleSessionEndsLikeTerminatedBackend(t *testing.T) {
	pg, admin := fencedDB(t)
	p := fencedProxy(t, pg, func(c *proxy.Config) { c.StaleLinger = 3 * time.Second })
	url := func(tok int64) string { return p.FenceURL("app", "postgres", "billing", tok, "password=app") }
	token := int64(0)
	raise := func(t *testing.T) {
		t.Helper()
		token++
		leader := connect(t, url(token))
		mustExec(t, leader, "SELECT 1")
		leader.Close(ctxT(t))
	}

	t.Run("pgx idle in a transaction, then COMMIT", func(t *testing.T) {
		raise(t)
		stale := connect(t, url(token))
		mustExec(t, stale, "BEGIN")
		mustExec(t, stale, "INSERT INTO items(tag) VALUES ('pgx-idle')")
		raise(t)
		_, err := stale.Exec(ctxT(t), "COMMIT")
		wantStale(t, err)
		pe := pgErrorOf(err)
		if pe.Severity != "FATAL" || !strings.Contains(pe.Detail, "waited for no answer") {
			t.Errorf("want a FATAL whose detail says no unit was in flight, got %s: %q", pe.Severity, pe.Detail)
		}
		if !stale.IsClosed() {
			t.Error("pgx: the connection is not closed after the FATAL")
		}
		if n := count(t, admin, "SELECT count(*) FROM items WHERE tag = 'pgx-idle'"); n != 0 {
			t.Fatalf("%d stale rows committed", n)
		}
	})

	t.Run("pgx statement in flight", func(t *testing.T) {
		raise(t)
		stale := connect(t, url(token))
		errc := make(chan error, 1)
		go func() {
			_, err := stale.Exec(context.Background(), "SELECT pg_sleep(30)")
			errc <- err
		}()
		time.Sleep(300 * time.Millisecond)
		raise(t)
		err := <-errc
		wantStale(t, err)
		pe := pgErrorOf(err)
		if pe.Severity != "ERROR" || !strings.Contains(pe.Detail, "may have committed") {
			t.Errorf("want an ERROR whose detail says a statement was in flight, got %s: %q", pe.Severity, pe.Detail)
		}
		// The FATAL and the end follow the unit's ReadyForQuery: the next call reads them.
		_, err = stale.Exec(ctxT(t), "SELECT 1")
		wantStale(t, err)
		if !stale.IsClosed() {
			t.Error("pgx: the connection is not closed after the FATAL")
		}
	})

	t.Run("pgx extended protocol after the end", func(t *testing.T) {
		raise(t)
		stale := connect(t, url(token))
		raise(t)
		time.Sleep(100 * time.Millisecond)
		_, err := stale.Exec(ctxT(t), "INSERT INTO items(tag) VALUES ($1)", "pgx-ext")
		wantStale(t, err)
		if !stale.IsClosed() {
			t.Error("pgx: the connection is not closed after the FATAL")
		}
	})

	// psycopg 3: idle in a transaction, woken inside the linger and after it.
	// Within the linger the COMMIT's answer is the error and its ReadyForQuery: the
	// SQLSTATE. After it, the connection was closed: libpq reads the FATAL and the end
	// in one PQconsumeInput and reports both as "consuming input failed" with the
	// proxy's message and no SQLSTATE (docs/applications.md, Errors in your driver).
	for _, tc := range []struct {
		name  string
		sleep time.Duration
		want  []string
	}{
		{"psycopg COMMIT within the linger", 0, []string{"sqlstate=ZF001", "stale fencing token", "next: sqlstate=None closed=True"}},
		{"psycopg COMMIT after the linger", 4 * time.Second, []string{"closed=True", "status=BAD", "stale fencing token"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			raise(t)
			libpq := p.URL("app", "postgres", "password=app", "options=-c fence.resource=billing -c fence.token="+strconv.FormatInt(token, 10))
			out := runPsycopgStale(t, libpq, tc.sleep, func() { raise(t) })
			for _, want := range tc.want {
				if !strings.Contains(out, want) {
					t.Errorf("psycopg: want %s, got %q", want, out)
				}
			}
		})
	}

	st := p.Server.Status(ctxT(t))
	sessions := 0
	for _, r := range st.Refusals {
		if r.Phase == proxy.PhaseSession && r.SQLState == fence.CodeStale && r.Resource == "billing" {
			sessions++
		}
	}
	if sessions < 5 {
		t.Errorf("/status lists %d stale sessions ended (phase session), want 5: %+v", sessions, st.Refusals)
	}
	for _, r := range st.Resources {
		if r.Resource == "billing" && r.StaleSessionsEnded < 5 {
			t.Errorf("/status: stale_sessions_ended %d, want 5", r.StaleSessionsEnded)
		}
	}
}

// psycopgStale is run by /usr/bin/python3: a session that writes in a transaction, says
// "ready", waits for a line (the raise), sleeps, commits, and prints what psycopg saw.
const psycopgStale = `
import sys, time, psycopg
conn = psycopg.connect(sys.argv[1])
conn.execute("INSERT INTO items(tag) VALUES ('psycopg')")
print("ready", flush=True)
sys.stdin.readline()
time.sleep(float(sys.argv[2]))
try:
    conn.commit()
    print("committed")
except psycopg.Error as e:
    print("sqlstate=%s closed=%s status=%s error=%r" % (e.sqlstate, conn.closed, conn.info.status.name, str(e)))
try:
    conn.execute("SELECT 1")
    print("next: ran")
except psycopg.Error as e:
    print("next: sqlstate=%s closed=%s error=%r" % (e.sqlstate, conn.closed, str(e)))
`

func runPsycopgStale(t *testing.T, url string, sleep time.Duration, raise func()) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctxT(t), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, psycopg2Python, "-c", psycopgStale, url, strconv.FormatFloat(sleep.Seconds(), 'f', -1, 64))
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	r := bufio.NewReader(stdout)
	if line, err := r.ReadString('\n'); err != nil || line != "ready\n" {
		t.Fatalf("psycopg: %q %v\n%s", line, err, stderr.String())
	}
	raise()
	io.WriteString(stdin, "go\n") //nolint:errcheck
	rest, _ := io.ReadAll(r)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("psycopg: %v\n%s%s", err, rest, stderr.String())
	}
	return string(rest)
}

// psycopg2StaleScript opens a transaction with an insert, says "inserted", waits
// for a line on stdin, then commits and prints the outcome's SQLSTATE.
const psycopg2StaleScript = `
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
	if err := os.WriteFile(script, []byte(psycopg2StaleScript), 0o644); err != nil {
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

// TestLateSyncAfterTheErrorIsAnswered (second review, LOG 01:57): a stale
// session's client sends Parse, Bind, Execute and Flush, reads the proxy's
// ZF001, and sends its Sync 1.5 s later: it gets the ReadyForQuery that ends
// the unit, then the end (before the fix the write deadline of the first
// answer had passed, and the Sync got the end alone).
func TestLateSyncAfterTheErrorIsAnswered(t *testing.T) {
	t.Parallel()
	e := startStaleEnv(t, []string{"latesync"})
	ctx := ctxEnv(t)
	s, err := dialSession(addrOf(e.ah.Host, e.ah.Port), fenceParams("postgres", "latesync", 1))
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
	if err := s.send(append(parseBindExecute("", "", "SELECT 1"), &pgproto3.Flush{})...); err != nil {
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
		t.Fatalf("the late Sync got %d messages (%s), want one ReadyForQuery, then the end", len(rest), lastText(rest))
	}
}

// TestStaleSessionsGiveBackTheirClientSlots: sessions a raise ended linger to answer their
// client (up to 5 minutes for one that does not read), without a backend: they hold no
// --max-clients slot, so the new leader gets its connections (a review's new leader was
// refused 53300 while its frozen predecessor's sessions lingered).
func TestStaleSessionsGiveBackTheirClientSlots(t *testing.T) {
	pg, _ := fencedDB(t)
	px := fencedProxy(t, pg, func(c *proxy.Config) { c.MaxClients = 3 })
	old1 := connect(t, px.FenceURL("app", "postgres", "billing", 1))
	old2 := connect(t, px.FenceURL("app", "postgres", "billing", 1))
	defer old1.Close(ctxT(t))
	defer old2.Close(ctxT(t))
	connect(t, px.FenceURL("app", "postgres", "billing", 2)) // the third slot; ends old1, old2
	for i := range 2 {
		eventually(t, 15*time.Second, fmt.Sprintf("the new leader's connection %d", i+2), func() error {
			c, err := pgx.Connect(ctxT(t), px.FenceURL("app", "postgres", "billing", 2))
			if err != nil {
				return err
			}
			t.Cleanup(func() { c.Close(context.Background()) })
			return nil
		})
	}
}
