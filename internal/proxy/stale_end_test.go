package proxy_test

import (
	"bufio"
	"context"
	"errors"
	"io"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

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
		var pe *pgconn.PgError
		errors.As(err, &pe)
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
		var pe *pgconn.PgError
		errors.As(err, &pe)
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
