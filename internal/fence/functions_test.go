package fence_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestFenceFunctions runs fence.bind, fence.raise and fence.reset as the proxy and an operator
// do, from real concurrent sessions of an application role.
func TestFenceFunctions(t *testing.T) {
	c := startSchemaCluster(t)
	url := c.migratedDB(t)
	admin := schemaConnect(t, url)
	schemaExec(t, admin, "CREATE TABLE charges (id serial PRIMARY KEY, who text NOT NULL)")
	schemaExec(t, admin, "GRANT ALL ON TABLE charges, charges_id_seq TO PUBLIC")
	c.pg.CreateRole(t, "app", "")
	appURL := c.pg.URL("app", dbName(t, url))
	appConn := func(t *testing.T) *pgx.Conn { return schemaConnect(t, appURL) }

	// Each subtest fences its own resource, so they may share the database.
	t.Run("bind", func(t *testing.T) {
		const resource = "bind"
		steps := []struct {
			name  string
			token int64
			want  int64  // the stored token bind returns
			code  string // or the error
			msg   string
		}{
			{name: "no row: the bind admits its token", token: 33, want: 33},
			{name: "equal", token: 33, want: 33},
			{name: "higher raises", token: 34, want: 34},
			{name: "lower is refused", token: 20, code: fence.CodeStale,
				msg: `stale fencing token: resource "bind" token 20 is lower than the highest admitted token 34`},
			{name: "far higher raises", token: 1 << 62, want: 1 << 62},
			{name: "the previous token is refused now", token: 34, code: fence.CodeStale,
				msg: `stale fencing token: resource "bind" token 34 is lower than the highest admitted token 4611686018427387904`},
		}
		for _, s := range steps {
			t.Run(s.name, func(t *testing.T) {
				conn := appConn(t) // a backend is bound once: a connection per bind
				pid := conn.PgConn().PID()
				got, err := bind(t.Context(), conn, testenv.Key, resource, s.token)
				if s.code == "" {
					if err != nil || got != s.want {
						t.Fatalf("bind(%d) = %d, %v; want %d", s.token, got, err, s.want)
					}
					if res, tok := binding(t, admin, pid); res != resource || tok != s.token {
						t.Fatalf("binding of the backend: %q %d, want %q %d", res, tok, resource, s.token)
					}
					return
				}
				pe := wantPgError(t, err, s.code, s.msg)
				if pe.Hint == "" {
					t.Errorf("refusal without a hint: %+v", pe)
				}
				if res, tok := binding(t, admin, pid); res != "" {
					t.Fatalf("a refused bind bound the backend to %q %d", res, tok)
				}
				// Refused, not bound: the same backend may bind the stored token.
				current := *storedToken(t, admin, resource)
				if got, err := bind(t.Context(), conn, testenv.Key, resource, current); err != nil || got != current {
					t.Fatalf("bind with the stored token %d after a refusal = %d, %v", current, got, err)
				}
			})
		}

		t.Run("a backend is bound once", func(t *testing.T) {
			conn := appConn(t)
			pid := conn.PgConn().PID()
			mustBind(t, conn, resource, 1<<62)
			for _, again := range []struct {
				resource string
				token    int64
			}{{resource, 1 << 62}, {resource, 1<<62 + 1}, {"bind-other", 1}} {
				_, err := bind(t.Context(), conn, testenv.Key, again.resource, again.token)
				wantPgError(t, err, fence.CodeNotAllowed,
					`not allowed in a fenced session: this session is bound to resource "bind" token 4611686018427387904 already`)
			}
			if res, tok := binding(t, admin, pid); res != resource || tok != 1<<62 {
				t.Fatalf("binding after refused re-binds: %q %d", res, tok)
			}
			if got := storedToken(t, admin, resource); got == nil || *got != 1<<62 {
				t.Fatalf("a refused re-bind moved the token to %v", got)
			}
			if got := storedToken(t, admin, "bind-other"); got != nil {
				t.Fatalf("a refused re-bind stored a token for another resource: %d", *got)
			}
		})

		t.Run("a reused pid is a new backend", func(t *testing.T) {
			// A leftover row of an exited backend whose pid is now another backend's does
			// not stand for it: rows match live backends by (pid, backend_start).
			conn := appConn(t)
			pid := conn.PgConn().PID()
			schemaExec(t, admin, "INSERT INTO fence.bindings (pid, backend_start, resource, token) VALUES ($1, now() - interval '1 hour', 'bind', 1)", int32(pid))
			if got := mustBind(t, conn, resource, 1<<62); got != 1<<62 {
				t.Fatalf("bind = %d", got)
			}
			if n := countRows(t, admin, fmt.Sprintf("fence.bindings WHERE pid = %d", pid)); n != 1 {
				t.Fatalf("%d rows for pid %d after its bind, want 1 (the leftover removed)", n, pid)
			}
		})
	})

	// (P1) Binds and raises of one resource serialize. The raise here is the proxy's statement
	// run inside an explicit transaction, held open to stand for one in flight.
	t.Run("a bind waits for an in-flight raise", func(t *testing.T) {
		for _, outcome := range []string{"COMMIT", "ROLLBACK"} {
			t.Run(outcome, func(t *testing.T) {
				resource := "inflight-" + strings.ToLower(outcome)
				mustRaise(t, admin, resource, 50)
				raiser := schemaConnect(t, url)
				schemaExec(t, raiser, "BEGIN")
				q, err := testenv.Key.RaiseSQL(dbName(t, url), resource, 51, raiser.PgConn().PID())
				if err != nil {
					t.Fatal(err)
				}
				schemaExec(t, raiser, q)

				old := appConn(t)
				done := make(chan error, 1)
				go func() {
					_, err := bind(t.Context(), old, testenv.Key, resource, 50)
					done <- err
				}()
				waitBlockedBy(t, admin, raiser.PgConn().PID())
				schemaExec(t, raiser, outcome)
				select {
				case err := <-done:
					if outcome == "ROLLBACK" {
						if err != nil {
							t.Fatalf("bind after the raise rolled back: %v", err)
						}
						return
					}
					wantPgError(t, err, fence.CodeStale, fmt.Sprintf(`stale fencing token: resource "%s" token 50 is lower than the highest admitted token 51`, resource))
				case <-time.After(10 * time.Second):
					t.Fatal("bind still blocked after the raise ended")
				}
			})
		}
	})

	t.Run("a raise waits for an in-flight bind and ends it", func(t *testing.T) {
		const resource = "inflight-bind"
		mustRaise(t, admin, resource, 60)
		old := appConn(t)
		schemaExec(t, old, "BEGIN")
		if got := mustBind(t, old, resource, 60); got != 60 {
			t.Fatalf("bind = %d", got)
		}
		schemaExec(t, old, "INSERT INTO charges (who) VALUES ('inflight-bind')")
		type result struct {
			stored int64
			err    error
		}
		done := make(chan result, 1)
		go func() {
			stored, err := testenv.Key.Raise(t.Context(), admin, resource, 61)
			done <- result{stored, err}
		}()
		// admin is busy in the goroutine: watch from another connection.
		waitBlockedBy(t, schemaConnect(t, url), old.PgConn().PID())
		// The bind commits (with the write it shared its transaction with, ordered before the
		// raise); the raise, which waited for it, then lists it and ends it.
		schemaExec(t, old, "COMMIT")
		select {
		case r := <-done:
			if r.err != nil || r.stored != 61 {
				t.Fatalf("raise = %d, %v; want 61", r.stored, r.err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("the raise is still blocked after the bind committed")
		}
		wantEnded(t, old)
		if n := countRows(t, admin, "charges WHERE who = 'inflight-bind'"); n != 1 {
			t.Fatalf("%d rows of the transaction that committed before the raise, want 1", n)
		}
	})

	t.Run("malformed arguments are ZF004", func(t *testing.T) {
		app := appConn(t)
		for _, f := range []string{"bind", "raise"} {
			for _, args := range []string{
				"'x', 0, 'p'", "'x', -1, 'p'", "'x', NULL, 'p'",
				"'X', 1, 'p'", "'x''; --', 1, 'p'", "NULL, 1, 'p'", "'', 1, 'p'",
				"'" + strings.Repeat("x", 64) + "', 1, 'p'",
			} {
				_, err := app.Exec(t.Context(), "SELECT fence."+f+"("+args+")")
				wantPgError(t, err, fence.CodeMalformed, "malformed fencing")
			}
		}
	})

	t.Run("a bind or raise without the proxy's proof is ZF010", func(t *testing.T) {
		const resource = "proof"
		mustRaise(t, admin, resource, 10)
		app := appConn(t)
		other := appConn(t)
		db := dbName(t, url)
		pid, otherPID := app.PgConn().PID(), other.PgConn().PID()
		tests := []struct {
			name  string
			kind  string // the function called
			token int64
			proof string // SQL
		}{
			{"no proof", "bind", 11, "NULL"},
			{"empty proof", "bind", 11, "''"},
			{"another key", "bind", 11, "'" + fence.Key("not the key stored in the database").Proof("bind", db, resource, 11, pid) + "'"},
			{"another backend's proof (a replay)", "bind", 11, "'" + testenv.Key.Proof("bind", db, resource, 11, otherPID) + "'"},
			{"a raise's proof for a bind", "bind", 11, "'" + testenv.Key.Proof("raise", db, resource, 11, pid) + "'"},
			{"a bind's proof for a raise", "raise", 11, "'" + testenv.Key.Proof("bind", db, resource, 11, pid) + "'"},
			{"another token's proof", "bind", 12, "'" + testenv.Key.Proof("bind", db, resource, 11, pid) + "'"},
			{"another resource's proof", "raise", 11, "'" + testenv.Key.Proof("raise", db, "proof2", 11, pid) + "'"},
			{"another database's proof", "raise", 11, "'" + testenv.Key.Proof("raise", "postgres", resource, 11, pid) + "'"},
			{"upper-case hex", "bind", 11, "'" + strings.ToUpper(testenv.Key.Proof("bind", db, resource, 11, pid)) + "'"},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				_, err := app.Exec(t.Context(), fmt.Sprintf("SELECT fence.%s('%s', %d, %s)", tt.kind, resource, tt.token, tt.proof))
				pe := wantPgError(t, err, fence.CodeProof,
					fmt.Sprintf("fencing proof invalid: fence.%s('%s', %d) was not called by fenceproxy", tt.kind, resource, tt.token))
				if !strings.Contains(pe.Hint, "--key-file") {
					t.Errorf("hint %q does not name --key-file", pe.Hint)
				}
				if got := storedToken(t, admin, resource); got == nil || *got != 10 {
					t.Fatalf("a refused call moved the token to %v", got)
				}
				if res, _ := binding(t, admin, pid); res != "" {
					t.Fatalf("a refused call bound the backend to %q", res)
				}
			})
		}
		// The other backend's own proof is good for it.
		if got := mustBind(t, other, resource, 11); got != 11 {
			t.Fatalf("bind with the backend's own proof = %d", got)
		}
	})

	t.Run("only READ COMMITTED", func(t *testing.T) {
		const resource = "isolation"
		for _, level := range []pgx.TxIsoLevel{pgx.RepeatableRead, pgx.Serializable} {
			t.Run(string(level), func(t *testing.T) {
				conn := appConn(t)
				for _, kind := range []string{"bind", "raise"} {
					tx, err := conn.BeginTx(t.Context(), pgx.TxOptions{IsoLevel: level})
					if err != nil {
						t.Fatal(err)
					}
					build := testenv.Key.BindSQL
					if kind == "raise" {
						build = testenv.Key.RaiseSQL
					}
					q, err := build(conn.Config().Database, resource, 5, conn.PgConn().PID())
					if err != nil {
						t.Fatal(err)
					}
					_, err = tx.Exec(t.Context(), q)
					wantPgError(t, err, fence.CodeUnavailable,
						fmt.Sprintf("fencing unavailable: fence.%s must run under READ COMMITTED, not %s", kind, strings.ToLower(string(level))))
					tx.Rollback(t.Context()) //nolint:errcheck
				}
				if got := storedToken(t, admin, resource); got != nil {
					t.Fatalf("a refused call stored %d", *got)
				}
			})
		}
		// fence.reset has no proof to check but refuses too when it would end backends.
		tx, err := admin.BeginTx(t.Context(), pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
		if err != nil {
			t.Fatal(err)
		}
		_, err = tx.Exec(t.Context(), "SELECT fence.reset('isolation', 5)")
		wantPgError(t, err, fence.CodeUnavailable, `fencing unavailable: a raise of resource "isolation" must run under READ COMMITTED, not repeatable read`)
		tx.Rollback(t.Context()) //nolint:errcheck
	})

	t.Run("prepared transactions stop a raise", func(t *testing.T) {
		const resource = "prepared"
		mustRaise(t, admin, resource, 1)
		stale := appConn(t)
		mustBind(t, stale, resource, 1)
		prep := appConn(t)
		schemaExec(t, prep, "BEGIN")
		schemaExec(t, prep, "INSERT INTO charges (who) VALUES ('prepared')")
		schemaExec(t, prep, "PREPARE TRANSACTION 'fence-test-prepared'")
		t.Cleanup(func() {
			admin.Exec(context.Background(), "ROLLBACK PREPARED 'fence-test-prepared'") //nolint:errcheck // done already when the test passes
		})
		_, err := testenv.Key.Raise(t.Context(), admin, resource, 2)
		pe := wantPgError(t, err, fence.CodeRaiseFailed,
			`fencing raise failed: resource "prepared" was not raised to token 2 because prepared transactions exist in this database: 'fence-test-prepared'`)
		if pe.Hint == "" || pe.Detail == "" {
			t.Errorf("ZF011 without detail or hint: %+v", pe)
		}
		// A bind that would raise is refused the same way; one that does not raise is not.
		_, err = bind(t.Context(), appConn(t), testenv.Key, resource, 2)
		wantPgError(t, err, fence.CodeRaiseFailed, "fencing raise failed")
		if got := mustBind(t, appConn(t), resource, 1); got != 1 {
			t.Fatalf("bind with the stored token while a transaction is prepared = %d", got)
		}
		if got := storedToken(t, admin, resource); got == nil || *got != 1 {
			t.Fatalf("the refused raise stored %v, want 1 kept", got)
		}

		schemaExec(t, admin, "ROLLBACK PREPARED 'fence-test-prepared'")
		if got := mustRaise(t, admin, resource, 2); got != 2 {
			t.Fatalf("raise after the prepared transaction ended = %d", got)
		}
		wantEnded(t, stale)
	})

	t.Run("notifications", func(t *testing.T) {
		const resource = "notified"
		listener := schemaConnect(t, url)
		schemaExec(t, listener, "LISTEN "+fence.Channel)

		mustRaise(t, admin, resource, 7)     // missing row: notifies
		mustRaise(t, admin, resource, 7)     // equal: silent
		mustRaise(t, admin, resource, 6)     // lower: silent
		mustBind(t, appConn(t), resource, 7) // bind at the stored token: silent
		mustBind(t, appConn(t), resource, 8) // a bind that raises: notifies
		// A refused bind: silent.
		_, err := bind(t.Context(), appConn(t), testenv.Key, resource, 3)
		wantPgError(t, err, fence.CodeStale, "stale fencing token")
		mustRaise(t, admin, resource, 9) // higher: notifies
		if _, err := admin.Exec(t.Context(), "SELECT fence.reset($1, $2)", resource, 2); err != nil {
			t.Fatalf("reset: %v", err)
		}
		want := []string{"notified 7", "notified 8", "notified 9", "notified 2 reset"}
		for _, w := range want {
			ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			n, err := listener.WaitForNotification(ctx)
			cancel()
			if err != nil {
				t.Fatalf("waiting for %q: %v", w, err)
			}
			if n.Channel != fence.Channel || n.Payload != w {
				t.Fatalf("notification %s %q, want %s %q", n.Channel, n.Payload, fence.Channel, w)
			}
		}
		ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
		defer cancel()
		if n, err := listener.WaitForNotification(ctx); err == nil {
			t.Fatalf("unexpected notification %q", n.Payload)
		}
	})

	t.Run("reset", func(t *testing.T) {
		const resource = "reset"
		mustRaise(t, admin, resource, 30)
		app := appConn(t)
		_, err := app.Exec(t.Context(), "SELECT fence.reset($1, $2)", resource, 1)
		wantPgError(t, err, "42501", "permission denied")

		// Lowering ends nobody and re-admits lower tokens.
		bound := appConn(t)
		mustBind(t, bound, resource, 30)
		var previous *int64
		if err := admin.QueryRow(t.Context(), "SELECT fence.reset($1, $2)", resource, 3).Scan(&previous); err != nil {
			t.Fatalf("reset: %v", err)
		}
		if previous == nil || *previous != 30 {
			t.Fatalf("reset returned %v, want the previous token 30", previous)
		}
		if !alive(t, admin, bound.PgConn().PID()) {
			t.Fatal("a reset that lowered the token ended a backend")
		}
		low := appConn(t)
		if got := mustBind(t, low, resource, 3); got != 3 {
			t.Fatalf("bind after the reset = %d, want 3", got)
		}

		// Raising through reset ends the backends bound to lower tokens, as a raise does.
		if err := admin.QueryRow(t.Context(), "SELECT fence.reset($1, $2)", resource, 20).Scan(&previous); err != nil {
			t.Fatalf("reset: %v", err)
		}
		if previous == nil || *previous != 3 {
			t.Fatalf("reset returned %v, want 3", previous)
		}
		if alive(t, admin, low.PgConn().PID()) {
			t.Fatal("the backend bound to 3 survived a reset to 20")
		}
		wantEnded(t, low)
		if !alive(t, admin, bound.PgConn().PID()) {
			t.Fatal("the backend bound to 30 was ended by a reset to 20")
		}

		// A resource without a row: reset creates it and returns NULL.
		if err := admin.QueryRow(t.Context(), "SELECT fence.reset('reset-new', 4)").Scan(&previous); err != nil {
			t.Fatalf("reset: %v", err)
		}
		if previous != nil {
			t.Fatalf("reset of a new resource returned %d, want NULL", *previous)
		}
		for _, args := range []string{"'reset', -1", "'reset', NULL", "'Reset', 1", "NULL, 1"} {
			_, err := admin.Exec(t.Context(), "SELECT fence.reset("+args+")")
			wantPgError(t, err, fence.CodeMalformed, "malformed fencing")
		}
	})

	t.Run("application role cannot write tokens, bindings or keys", func(t *testing.T) {
		app := appConn(t)
		mustBind(t, app, "privileges", 1)
		for _, q := range []string{
			"UPDATE fence.tokens SET token = 1",
			"DELETE FROM fence.tokens",
			"INSERT INTO fence.tokens (resource, token) VALUES ('x', 1)",
			"SELECT * FROM fence.tokens FOR SHARE",
			"DELETE FROM fence.bindings",
			"UPDATE fence.bindings SET token = 1 << 62",
			"INSERT INTO fence.bindings (pid, backend_start, resource, token) VALUES (1, now(), 'x', 1)",
			"TRUNCATE fence.bindings",
			"SELECT * FROM fence.bindings FOR UPDATE",
			"SELECT key FROM fence.keys",
			"INSERT INTO fence.keys (id, key) VALUES (1, 'x')",
			"SELECT fence.proof('bind', 'privileges', 1, pg_backend_pid())",
			"SELECT fence.verify('bind', 'privileges', 1, 'x')",
			"SELECT fence.end_stale('privileges', 2, interval '1 second')",
			"SELECT fence.raise_locked('privileges', 2)",
			"SELECT fence.reset('privileges', 2)",
			"CREATE FUNCTION fence.bind(text, integer, text) RETURNS bigint LANGUAGE sql AS 'SELECT 1::bigint'",
			"CREATE TABLE fence.mine (x int)",
		} {
			_, err := app.Exec(t.Context(), q)
			wantPgError(t, err, "42501", "permission denied")
		}
		for _, q := range []string{"DROP TABLE fence.bindings", "ALTER TABLE fence.bindings DISABLE ROW LEVEL SECURITY"} {
			_, err := app.Exec(t.Context(), q)
			wantPgError(t, err, "42501", "must be owner of table bindings")
		}
		if n := countRows(t, app, "fence.tokens"); n == 0 {
			t.Fatal("application role cannot read fence.tokens")
		}
		if n := countRows(t, app, "fence.bindings WHERE pid = pg_backend_pid()"); n != 1 {
			t.Fatalf("application role reads %d rows of its own binding, want 1", n)
		}
		if got := storedToken(t, admin, "privileges"); got == nil || *got != 1 {
			t.Fatalf("the token moved to %v", got)
		}
	})

	t.Run("resource pattern agrees with the table's CHECK", func(t *testing.T) {
		names := []string{
			"a", "billing", "billing.eu-west_1", "a-", "a.", "a_", "z9",
			"a" + strings.Repeat("b", 62), "a" + strings.Repeat("b", 63),
			"", "A", "Billing", "1billing", "_a", "-a", ".a", "bill ing", "bill'ing", `bill"ing`,
			"bill\\ing", "billing\n", "\nbilling", "billé", "bıll", "billing;", "ａ",
		}
		for _, name := range names {
			var ok bool
			err := admin.QueryRow(t.Context(),
				`SELECT $1::text COLLATE "C" ~ '^[a-z][a-z0-9_.-]{0,62}$'`, name).Scan(&ok)
			if err != nil {
				t.Fatal(err)
			}
			if got := fence.ValidResource(name); got != ok {
				t.Errorf("ValidResource(%q) = %t, PostgreSQL says %t", name, got, ok)
			}
			if ok {
				if got := mustRaise(t, admin, name, 1); got != 1 {
					t.Errorf("raise(%q) = %d", name, got)
				}
			}
		}
	})
}
