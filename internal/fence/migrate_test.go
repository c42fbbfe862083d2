package fence_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// schemaCluster is one PostgreSQL cluster shared by a test's subtests, each of which gets a
// database of its own (createDB), so that subtests start from an empty database without
// paying for an initdb each.
type schemaCluster struct {
	pg *testenv.Postgres
	n  atomic.Int64
}

func startSchemaCluster(t *testing.T) *schemaCluster {
	t.Helper()
	return &schemaCluster{pg: testenv.StartPostgres(t)}
}

// createDB creates an empty database and returns the superuser's URL for it.
func (c *schemaCluster) createDB(t *testing.T) string {
	t.Helper()
	name := fmt.Sprintf("fence_%d", c.n.Add(1))
	c.pg.Exec(t, "CREATE DATABASE "+name)
	return c.pg.URL(testenv.AdminUser, name)
}

// migratedDB creates a database with the fence schema installed.
func (c *schemaCluster) migratedDB(t *testing.T) string {
	t.Helper()
	url := c.createDB(t)
	if _, err := fence.Migrate(t.Context(), url); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	return url
}

func schemaConnect(t *testing.T, url string) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

func schemaExec(t *testing.T, conn *pgx.Conn, sql string, args ...any) {
	t.Helper()
	if _, err := conn.Exec(t.Context(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// raise runs fence.raise through the SQL the proxy injects and returns the stored token.
func raise(ctx context.Context, conn *pgx.Conn, resource string, token int64) (int64, error) {
	q, err := fence.RaiseSQL(resource, token)
	if err != nil {
		return 0, err
	}
	var stored int64
	err = conn.QueryRow(ctx, q).Scan(&stored)
	return stored, err
}

func mustRaise(t *testing.T, conn *pgx.Conn, resource string, token int64) int64 {
	t.Helper()
	stored, err := raise(t.Context(), conn, resource, token)
	if err != nil {
		t.Fatalf("raise(%s, %d): %v", resource, token, err)
	}
	return stored
}

// check runs fence.check through the SQL the proxy injects.
func check(ctx context.Context, conn *pgx.Conn, resource string, token int64) error {
	q, err := fence.CheckSQL(resource, token)
	if err != nil {
		return err
	}
	_, err = conn.Exec(ctx, q)
	return err
}

// wantPgError fails unless err is a server error with SQLSTATE code whose message starts with
// prefix, and returns it.
func wantPgError(t *testing.T, err error, code, prefix string) *pgconn.PgError {
	t.Helper()
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		t.Fatalf("error = %v, want SQLSTATE %s", err, code)
	}
	if pe.Code != code || !strings.HasPrefix(pe.Message, prefix) {
		t.Fatalf("error = %s %q, want %s %q...", pe.Code, pe.Message, code, prefix)
	}
	return pe
}

func countRows(t *testing.T, conn *pgx.Conn, table string) int {
	t.Helper()
	var n int
	if err := conn.QueryRow(t.Context(), "SELECT count(*) FROM "+table).Scan(&n); err != nil {
		t.Fatalf("count %s: %v", table, err)
	}
	return n
}

func TestMigrate(t *testing.T) {
	c := startSchemaCluster(t)

	t.Run("fresh database then again is a no-op", func(t *testing.T) {
		url := c.createDB(t)
		applied, err := fence.Migrate(t.Context(), url)
		if err != nil {
			t.Fatalf("first Migrate: %v", err)
		}
		if !slices.Equal(applied, allVersions) {
			t.Fatalf("first Migrate applied %v, want %v", applied, allVersions)
		}
		applied, err = fence.Migrate(t.Context(), url)
		if err != nil {
			t.Fatalf("second Migrate: %v", err)
		}
		if len(applied) != 0 {
			t.Fatalf("second Migrate applied %v, want nothing", applied)
		}

		conn := schemaConnect(t, url)
		var inFence, inPublic bool
		err = conn.QueryRow(t.Context(),
			"SELECT to_regclass('fence.goose_db_version') IS NOT NULL, to_regclass('public.goose_db_version') IS NOT NULL",
		).Scan(&inFence, &inPublic)
		if err != nil {
			t.Fatal(err)
		}
		if !inFence || inPublic {
			t.Fatalf("version table in fence: %t, in public: %t; want only in fence", inFence, inPublic)
		}
		var objects int
		err = conn.QueryRow(t.Context(),
			"SELECT count(*) FROM pg_class WHERE relnamespace = 'public'::regnamespace").Scan(&objects)
		if err != nil {
			t.Fatal(err)
		}
		if objects != 0 {
			t.Fatalf("migration left %d objects in schema public", objects)
		}

		states, err := fence.MigrationStatus(t.Context(), url)
		if err != nil {
			t.Fatalf("MigrationStatus: %v", err)
		}
		if len(states) == 0 {
			t.Fatal("MigrationStatus: no migrations")
		}
		for _, s := range states {
			if !s.Applied {
				t.Errorf("migration %d (%s) not applied", s.Version, s.Name)
			}
		}
	})

	t.Run("status of an empty database changes nothing", func(t *testing.T) {
		url := c.createDB(t)
		states, err := fence.MigrationStatus(t.Context(), url)
		if err != nil {
			t.Fatalf("MigrationStatus: %v", err)
		}
		if len(states) == 0 || states[0].Version != 1 || states[0].Name != "00001_fence_schema.sql" || states[0].Applied {
			t.Fatalf("MigrationStatus = %+v, want 00001_fence_schema.sql first, pending", states)
		}
		var exists bool
		if err := schemaConnect(t, url).QueryRow(t.Context(),
			"SELECT to_regnamespace('fence') IS NOT NULL").Scan(&exists); err != nil {
			t.Fatal(err)
		}
		if exists {
			t.Fatal("MigrationStatus created the fence schema")
		}
	})

	t.Run("concurrent migrations apply once", func(t *testing.T) {
		url := c.createDB(t)
		const n = 4
		var wg sync.WaitGroup
		results := make([][]int64, n)
		errs := make([]error, n)
		start := make(chan struct{})
		began := time.Now()
		for i := range n {
			wg.Go(func() {
				<-start
				results[i], errs[i] = fence.Migrate(t.Context(), url)
			})
		}
		close(start)
		wg.Wait()
		t.Logf("%d concurrent migrations of an empty database took %v", n, time.Since(began))
		var appliers int
		for i := range n {
			if errs[i] != nil {
				t.Errorf("Migrate #%d: %v", i, errs[i])
			}
			switch {
			case slices.Equal(results[i], allVersions):
				appliers++
			case len(results[i]) != 0:
				t.Errorf("Migrate #%d applied %v", i, results[i])
			}
		}
		if appliers != 1 {
			t.Fatalf("%d migrations applied the versions, want exactly 1", appliers)
		}
		conn := schemaConnect(t, url)
		if got := countRows(t, conn, "fence.goose_db_version WHERE version_id = 1"); got != 1 {
			t.Fatalf("version 1 recorded %d times", got)
		}
	})

	t.Run("non-superuser owner", func(t *testing.T) {
		url := c.createDB(t)
		db := url[strings.LastIndex(url, "/")+1 : strings.Index(url, "?")]
		c.pg.Exec(t, "DO $$ BEGIN CREATE ROLE fence_owner LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
		c.pg.Exec(t, "GRANT CREATE ON DATABASE "+db+" TO fence_owner")
		ownerURL := c.pg.URL("fence_owner", db)
		if _, err := fence.Migrate(t.Context(), ownerURL); err != nil {
			t.Fatalf("Migrate as a non-superuser: %v", err)
		}
		// Again, after CREATE on the database is gone: the schema exists, so it needs none.
		c.pg.Exec(t, "REVOKE CREATE ON DATABASE "+db+" FROM fence_owner")
		if applied, err := fence.Migrate(t.Context(), ownerURL); err != nil || len(applied) != 0 {
			t.Fatalf("second Migrate = %v, %v; want nothing applied", applied, err)
		}
		conn := schemaConnect(t, ownerURL)
		if got := mustRaise(t, conn, "owned", 3); got != 3 {
			t.Fatalf("raise = %d, want 3", got)
		}
	})

	t.Run("cancelled while waiting", func(t *testing.T) {
		url := c.migratedDB(t)
		blocker := schemaConnect(t, url)
		schemaExec(t, blocker, "BEGIN")
		schemaExec(t, blocker, "LOCK TABLE fence.goose_db_version IN ACCESS EXCLUSIVE MODE")
		ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
		defer cancel()
		began := time.Now()
		_, err := fence.Migrate(ctx, url)
		if err == nil {
			t.Fatal("Migrate succeeded while its version table was locked")
		}
		if d := time.Since(began); d > 5*time.Second {
			t.Fatalf("Migrate returned %v after its context ended", d)
		}
		schemaExec(t, blocker, "ROLLBACK")
	})

	t.Run("bad URL", func(t *testing.T) {
		for _, url := range []string{"", "postgres://%zz"} {
			if _, err := fence.Migrate(t.Context(), url); err == nil {
				t.Errorf("Migrate(%q) succeeded", url)
			}
		}
	})
}

// TestFenceFunctions runs fence.raise and fence.check as the proxy does, from real concurrent
// sessions, at every isolation level.
func TestFenceFunctions(t *testing.T) {
	c := startSchemaCluster(t)
	url := c.migratedDB(t)
	admin := schemaConnect(t, url)
	schemaExec(t, admin, "CREATE TABLE charges (id serial PRIMARY KEY, who text NOT NULL)")
	schemaExec(t, admin, "GRANT ALL ON TABLE charges, charges_id_seq TO PUBLIC")
	db := url[strings.LastIndex(url, "/")+1 : strings.Index(url, "?")]
	c.pg.CreateRole(t, "app", "")
	appURL := c.pg.URL("app", db)

	// Each subtest fences its own resource, so they may share the database.
	t.Run("raise", func(t *testing.T) {
		app := schemaConnect(t, appURL)
		steps := []struct {
			name  string
			token int64
			want  int64
		}{
			{"missing row is inserted", 33, 33},
			{"equal keeps it", 33, 33},
			{"lower keeps the stored one", 20, 33},
			{"higher raises", 34, 34},
			{"far higher raises", 1 << 62, 1 << 62},
		}
		for _, s := range steps {
			t.Run(s.name, func(t *testing.T) {
				if got := mustRaise(t, app, "raise", s.token); got != s.want {
					t.Fatalf("raise(%d) = %d, want %d", s.token, got, s.want)
				}
			})
		}
		t.Run("malformed arguments are ZF004", func(t *testing.T) {
			for _, q := range []string{
				"SELECT fence.raise('raise', 0)",
				"SELECT fence.raise('raise', -1)",
				"SELECT fence.raise('raise', NULL)",
				"SELECT fence.raise('Raise', 1)",
				"SELECT fence.raise('raise''; --', 1)",
				"SELECT fence.raise(NULL, 1)",
			} {
				_, err := app.Exec(t.Context(), q)
				wantPgError(t, err, "ZF004", "malformed fencing")
			}
		})
	})

	t.Run("check", func(t *testing.T) {
		app := schemaConnect(t, appURL)
		mustRaise(t, app, "check", 34)
		tests := []struct {
			name       string
			token      int64
			write      bool
			wantCode   string
			wantPrefix string
		}{
			{name: "current token commits", token: 34, write: true},
			{name: "higher token commits", token: 35, write: true},
			{name: "stale token is refused", token: 33, write: true, wantCode: "ZF001",
				wantPrefix: `stale fencing token: resource "check" token 33 is lower than the highest admitted token 34`},
			{name: "stale token may read", token: 33},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				before := countRows(t, app, "charges")
				tx, err := app.Begin(t.Context())
				if err != nil {
					t.Fatal(err)
				}
				defer tx.Rollback(context.Background())
				if tt.write {
					schemaExec(t, app, "INSERT INTO charges (who) VALUES ('check')")
				} else {
					schemaExec(t, app, "SELECT count(*) FROM charges")
				}
				err = check(t.Context(), app, "check", tt.token)
				if tt.wantCode == "" {
					if err != nil {
						t.Fatalf("check: %v", err)
					}
					if !tt.write {
						var xid *string
						if err := app.QueryRow(t.Context(), "SELECT pg_current_xact_id_if_assigned()::text").Scan(&xid); err != nil {
							t.Fatal(err)
						}
						if xid != nil {
							t.Fatalf("check of a read-only transaction assigned xid %s", *xid)
						}
					}
					if err := tx.Commit(t.Context()); err != nil {
						t.Fatalf("commit: %v", err)
					}
					want := before
					if tt.write {
						want++
					}
					if got := countRows(t, app, "charges"); got != want {
						t.Fatalf("%d rows after commit, want %d", got, want)
					}
					return
				}
				pe := wantPgError(t, err, tt.wantCode, tt.wantPrefix)
				if pe.Detail == "" || pe.Hint == "" {
					t.Errorf("error without detail or hint: %+v", pe)
				}
				tx.Rollback(t.Context())
				if got := countRows(t, app, "charges"); got != before {
					t.Fatalf("%d rows after the refused commit, want %d", got, before)
				}
			})
		}
		t.Run("no row for the resource is refused", func(t *testing.T) {
			tx, err := app.Begin(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(context.Background())
			schemaExec(t, app, "INSERT INTO charges (who) VALUES ('nobody')")
			wantPgError(t, check(t.Context(), app, "never-raised", 5), "ZF001",
				`stale fencing token: resource "never-raised" token 5 was not admitted`)
		})
	})

	// The old leader's transaction wrote and stays open (frozen); the new leader raises from
	// another session; then the old one wakes and tries to commit.
	isolation := []struct {
		level      pgx.TxIsoLevel
		wantPrefix string
	}{
		{pgx.ReadCommitted, `stale fencing token: resource "%s" token 40 is lower than the highest admitted token 41`},
		// The check reads the token's sequence, not through the snapshot (migration 3).
		{pgx.RepeatableRead, `stale fencing token: resource "%s" token 40 is lower than the highest admitted token 41`},
		{pgx.Serializable, `stale fencing token: resource "%s" token 40 is lower than the highest admitted token 41`},
	}
	for i, iso := range isolation {
		t.Run("frozen old leader under "+string(iso.level), func(t *testing.T) {
			resource := fmt.Sprintf("frozen-%d", i)
			old := schemaConnect(t, appURL)
			newer := schemaConnect(t, appURL)
			mustRaise(t, old, resource, 40)

			tx, err := old.BeginTx(t.Context(), pgx.TxOptions{IsoLevel: iso.level})
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(context.Background())
			schemaExec(t, old, "INSERT INTO charges (who) VALUES ($1)", resource)

			ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
			defer cancel()
			began := time.Now()
			if got, err := raise(ctx, newer, resource, 41); err != nil || got != 41 {
				t.Fatalf("new leader's raise = %d, %v; want 41 within 2 s while the old transaction is open", got, err)
			}
			t.Logf("raise committed in %v while the old leader's transaction was open", time.Since(began))

			pe := wantPgError(t, check(t.Context(), old, resource, 40), "ZF001", fmt.Sprintf(iso.wantPrefix, resource))
			t.Logf("%s: %s", pe.Code, pe.Message)
			tx.Rollback(t.Context())
			if got := countRows(t, newer, "charges WHERE who = '"+resource+"'"); got != 0 {
				t.Fatalf("the old leader's %d rows are visible", got)
			}
		})
	}

	t.Run("check waits for an in-flight raise", func(t *testing.T) {
		for _, outcome := range []string{"COMMIT", "ROLLBACK"} {
			t.Run(outcome, func(t *testing.T) {
				resource := "inflight-" + strings.ToLower(outcome)
				old := schemaConnect(t, appURL)
				newer := schemaConnect(t, appURL)
				mustRaise(t, old, resource, 50)

				schemaExec(t, newer, "BEGIN")
				mustRaise(t, newer, resource, 51)

				tx, err := old.Begin(t.Context())
				if err != nil {
					t.Fatal(err)
				}
				defer tx.Rollback(context.Background())
				schemaExec(t, old, "INSERT INTO charges (who) VALUES ($1)", resource)
				oldPID := old.PgConn().PID()
				done := make(chan error, 1)
				go func() { done <- check(t.Context(), old, resource, 50) }()

				waitForLockWait(t, admin, oldPID)
				schemaExec(t, newer, outcome)
				select {
				case err := <-done:
					if outcome == "ROLLBACK" {
						if err != nil {
							t.Fatalf("check after the raise rolled back: %v", err)
						}
						return
					}
					wantPgError(t, err, "ZF001", fmt.Sprintf(`stale fencing token: resource "%s" token 50 is lower than the highest admitted token 51`, resource))
				case <-time.After(10 * time.Second):
					t.Fatal("check still blocked after the raise ended")
				}
			})
		}
	})

	t.Run("raise waits for a checked transaction to commit", func(t *testing.T) {
		// The check took its lock first: the old leader's commit is ordered before the new
		// token's admission, and both succeed.
		const resource = "ordered"
		old := schemaConnect(t, appURL)
		newer := schemaConnect(t, appURL)
		mustRaise(t, old, resource, 60)
		tx, err := old.Begin(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(context.Background())
		schemaExec(t, old, "INSERT INTO charges (who) VALUES ($1)", resource)
		if err := check(t.Context(), old, resource, 60); err != nil {
			t.Fatalf("check: %v", err)
		}
		type result struct {
			stored int64
			err    error
		}
		done := make(chan result, 1)
		newerPID := newer.PgConn().PID()
		go func() {
			stored, err := raise(t.Context(), newer, resource, 61)
			done <- result{stored, err}
		}()
		waitForLockWait(t, admin, newerPID)
		if err := tx.Commit(t.Context()); err != nil {
			t.Fatalf("commit of the checked transaction: %v", err)
		}
		r := <-done
		if r.err != nil || r.stored != 61 {
			t.Fatalf("raise = %d, %v; want 61", r.stored, r.err)
		}
		if got := countRows(t, old, "charges WHERE who = 'ordered'"); got != 1 {
			t.Fatalf("%d rows committed, want 1", got)
		}
	})

	t.Run("notifications", func(t *testing.T) {
		const resource = "notified"
		listener := schemaConnect(t, url)
		schemaExec(t, listener, "LISTEN "+fence.Channel)
		app := schemaConnect(t, appURL)
		owner := schemaConnect(t, url)

		mustRaise(t, app, resource, 7) // missing row: notifies
		mustRaise(t, app, resource, 7) // equal: silent
		mustRaise(t, app, resource, 6) // lower: silent
		mustRaise(t, app, resource, 9) // higher: notifies
		if _, err := owner.Exec(t.Context(), "SELECT fence.reset($1, $2)", resource, 2); err != nil {
			t.Fatalf("reset: %v", err)
		}
		want := []string{"notified 7", "notified 9", "notified 2 reset"}
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
		app := schemaConnect(t, appURL)
		mustRaise(t, app, resource, 30)
		_, err := app.Exec(t.Context(), "SELECT fence.reset($1, $2)", resource, 1)
		wantPgError(t, err, "42501", "permission denied")
		var previous *int64
		if err := admin.QueryRow(t.Context(), "SELECT fence.reset($1, $2)", resource, 3).Scan(&previous); err != nil {
			t.Fatalf("reset: %v", err)
		}
		if previous == nil || *previous != 30 {
			t.Fatalf("reset returned %v, want the previous token 30", previous)
		}
		if got := mustRaise(t, app, resource, 4); got != 4 {
			t.Fatalf("raise after reset = %d, want 4", got)
		}
	})

	t.Run("application role cannot write tokens", func(t *testing.T) {
		app := schemaConnect(t, appURL)
		for _, q := range []string{
			"UPDATE fence.tokens SET token = 1",
			"DELETE FROM fence.tokens",
			"INSERT INTO fence.tokens (resource, token) VALUES ('x', 1)",
			"SELECT * FROM fence.tokens FOR SHARE",
			"CREATE FUNCTION fence.check(text, integer) RETURNS void LANGUAGE sql AS ''",
			// The sequences fence.check reads (migration 3): readable, never movable.
			`SELECT setval('fence_token."reset"', 1)`,
			`SELECT nextval('fence_token."reset"')`,
			"CREATE SEQUENCE fence_token.mine",
			`SELECT fence.mirror_token()`,
		} {
			_, err := app.Exec(t.Context(), q)
			wantPgError(t, err, "42501", "permission denied")
		}
		for _, q := range []string{
			`ALTER SEQUENCE fence_token."reset" RESTART WITH 1`,
			`DROP SEQUENCE fence_token."reset"`,
		} {
			_, err := app.Exec(t.Context(), q)
			wantPgError(t, err, "42501", "must be owner of sequence reset")
		}
		var last int64
		if err := app.QueryRow(t.Context(), `SELECT pg_sequence_last_value('fence_token."reset"')`).Scan(&last); err != nil || last != 4 {
			t.Fatalf("application role reads the token's sequence: %d, %v; want 4 (the reset subtest's last raise)", last, err)
		}
		if n := countRows(t, app, "fence.tokens"); n == 0 {
			t.Fatal("application role cannot read fence.tokens")
		}
	})

	t.Run("check_readonly", func(t *testing.T) {
		app := schemaConnect(t, appURL)
		for _, write := range []bool{false, true} {
			tx, err := app.Begin(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			if write {
				schemaExec(t, app, "INSERT INTO charges (who) VALUES ('readonly')")
			} else {
				schemaExec(t, app, "SELECT count(*) FROM charges")
			}
			_, err = app.Exec(t.Context(), fence.CheckReadOnlySQL())
			if write {
				wantPgError(t, err, "25006", "fenceproxy: this session is read-only (no fencing token)")
			} else if err != nil {
				t.Fatalf("check_readonly of a read-only transaction: %v", err)
			}
			tx.Rollback(t.Context())
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

// waitForLockWait waits until the backend pid waits for a lock. conn must not be inside a
// transaction: pg_stat_activity is read once per transaction.
func waitForLockWait(t *testing.T, conn *pgx.Conn, pid uint32) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		var waiting bool
		err := conn.QueryRow(t.Context(),
			"SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid = $1", int32(pid)).Scan(&waiting)
		if err != nil {
			t.Fatal(err)
		}
		if waiting {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("backend %d never waited for a lock", pid)
}

// allVersions are the embedded migrations, in order.
var allVersions = []int64{1, 2, 3}

// TestMigrateV3Upgrade: a database with tokens stored under schema version 2 gets the token
// sequences that version 3's check reads, with the stored tokens; version 3's Down goes back
// to version 2's check, which refuses stale tokens again, and Up again restores version 3.
func TestMigrateV3Upgrade(t *testing.T) {
	c := startSchemaCluster(t)
	url := c.createDB(t)
	if err := fence.MigrateTo(t.Context(), url, 2); err != nil {
		t.Fatalf("migrate to version 2: %v", err)
	}
	conn := schemaConnect(t, url)
	schemaExec(t, conn, "CREATE TABLE charges (id serial PRIMARY KEY, who text)")
	mustRaise(t, conn, "billing", 7)
	mustRaise(t, conn, "eu.billing-2", 3)
	schemaExec(t, conn, "SELECT fence.reset('zero', 0)")

	mirror := func(resource string) *int64 {
		t.Helper()
		var v *int64
		if err := conn.QueryRow(t.Context(),
			"SELECT pg_sequence_last_value(to_regclass('fence_token.' || quote_ident($1)))", resource).Scan(&v); err != nil {
			t.Fatalf("read the mirror of %s: %v", resource, err)
		}
		return v
	}
	// checkedInsert runs a write and the check of resource and token in one transaction.
	checkedInsert := func(resource string, token int64) error {
		tx, err := conn.Begin(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(context.Background()) //nolint:errcheck
		if _, err := tx.Exec(t.Context(), "INSERT INTO charges (who) VALUES ($1)", resource); err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(t.Context(), "SELECT fence.check($1, $2)", resource, token); err != nil {
			return err
		}
		return tx.Commit(t.Context())
	}

	if applied, err := fence.Migrate(t.Context(), url); err != nil || !slices.Equal(applied, []int64{3}) {
		t.Fatalf("upgrade applied %v, %v; want [3]", applied, err)
	}
	for resource, want := range map[string]int64{"billing": 7, "eu.billing-2": 3, "zero": 0} {
		if got := mirror(resource); got == nil || *got != want {
			t.Fatalf("after the upgrade the mirror of %s is %v, want %d", resource, got, want)
		}
	}
	if err := checkedInsert("billing", 7); err != nil {
		t.Fatalf("version 3: the stored token passes: %v", err)
	}
	wantPgError(t, checkedInsert("billing", 6), fence.CodeStale, `stale fencing token: resource "billing" token 6 is lower than the highest admitted token 7`)
	wantPgError(t, checkedInsert("eu.billing-2", 2), fence.CodeStale, "stale fencing token")

	if err := fence.MigrateTo(t.Context(), url, 2); err != nil {
		t.Fatalf("down to version 2: %v", err)
	}
	var schemaLeft bool
	if err := conn.QueryRow(t.Context(), "SELECT to_regnamespace('fence_token') IS NOT NULL").Scan(&schemaLeft); err != nil || schemaLeft {
		t.Fatalf("after Down, fence_token still exists: %v %v", schemaLeft, err)
	}
	mustRaise(t, conn, "billing", 8) // under version 2, no mirror
	if err := checkedInsert("billing", 8); err != nil {
		t.Fatalf("version 2 after Down: the stored token passes: %v", err)
	}
	wantPgError(t, checkedInsert("billing", 7), fence.CodeStale, "stale fencing token")

	if applied, err := fence.Migrate(t.Context(), url); err != nil || !slices.Equal(applied, []int64{3}) {
		t.Fatalf("up again applied %v, %v; want [3]", applied, err)
	}
	if got := mirror("billing"); got == nil || *got != 8 {
		t.Fatalf("after Up again the mirror of billing is %v, want 8", got)
	}
	wantPgError(t, checkedInsert("billing", 7), fence.CodeStale, "stale fencing token")
}
