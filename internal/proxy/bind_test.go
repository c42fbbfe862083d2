package proxy_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// TestOnlyTheProxyAdmits: only the proxy admits a token; a bound session cannot re-bind.
func TestOnlyTheProxyAdmits(t *testing.T) {
	t.Parallel()
	e := startStaleEnv(t, []string{"proof"})
	ctx := ctxEnv(t)
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
		if got := sqlstate(err); got != tc.code {
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

// lockTokenRow holds res's row of fence.tokens FOR UPDATE on a connection of
// its own until the returned func is called (or the test ends): every bind and
// raise of res waits for it.
func lockTokenRow(t *testing.T, adminURL, res string) (release func()) {
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

// waitLocked waits until a backend of user waits for a lock and returns its
// pid and pg_stat_activity.query, as read by conn.
func waitLocked(t *testing.T, conn querier, user string) (int32, string) {
	t.Helper()
	var pid int32
	var q string
	eventually(t, 20*time.Second, "a backend of "+user+" waits for a lock", func() error {
		err := conn.QueryRow(ctxT(t), `SELECT pid, query FROM pg_stat_activity
			WHERE usename = $1 AND wait_event_type = 'Lock' AND pid <> pg_backend_pid() LIMIT 1`, user).Scan(&pid, &q)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			t.Fatal(err)
		}
		return err
	})
	return pid, q
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
			release := lockTokenRow(t, pg.AdminURL(), "billing")
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
			if got := storedToken(t, admin, "billing"); got != tok+1 {
				t.Fatalf("stored token %d, want %d", got, tok+1)
			}
			if _, err := old.Exec(ctxT(t), "SELECT 1"); err == nil {
				t.Fatal("the session of the old token survived the raise")
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
	if got := storedToken(t, admin, "billing"); got != 1 {
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
	eventually(t, 10*time.Second, "a bind running", func() error {
		return admin.QueryRow(ctxT(t), `SELECT pid FROM pg_stat_activity WHERE usename = 'app' AND query LIKE '%fence.bind%' AND state = 'active'`).Scan(&binding)
	})
	killer := connect(t, pg.URL("app", "postgres"))
	mustExec(t, killer, "SELECT pg_terminate_backend($1)", binding)
	err := <-errc
	wantCode(t, err, wire.CodeAdminShutdown)
	if !strings.Contains(err.Error(), "terminating connection") {
		t.Fatalf("%v: want the server's own message", err)
	}
	pe := pgErrorOf(err)
	if pe == nil || !strings.Contains(pe.Hint, "nothing was committed or bound") {
		t.Fatalf("%v: want the proxy's hint that nothing was bound", err)
	}
}
