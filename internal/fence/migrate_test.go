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
	"github.com/fenceproxy/fenceproxy/migrations"
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

// migratedDB creates a database with the fence schema installed and testenv.Key stored.
func (c *schemaCluster) migratedDB(t *testing.T) string {
	t.Helper()
	url := c.createDB(t)
	testenv.Migrate(t, url)
	return url
}

// dbName is the database a URL names.
func dbName(t *testing.T, url string) string {
	t.Helper()
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	return cfg.Database
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

// bind binds conn's backend to (resource, token) with key, as the proxy's bind does (its
// proof for the backend's pid and the connection's database), but as one literal statement
// (BindSQL) in an implicit READ COMMITTED transaction. It returns the stored token.
func bind(ctx context.Context, conn *pgx.Conn, key fence.Key, resource string, token int64) (int64, error) {
	q, err := key.BindSQL(conn.Config().Database, resource, token, conn.PgConn().PID())
	if err != nil {
		return 0, err
	}
	var stored int64
	err = conn.QueryRow(ctx, q).Scan(&stored)
	return stored, err
}

func mustBind(t *testing.T, conn *pgx.Conn, resource string, token int64) int64 {
	t.Helper()
	stored, err := bind(t.Context(), conn, testenv.Key, resource, token)
	if err != nil {
		t.Fatalf("bind(%s, %d): %v", resource, token, err)
	}
	return stored
}

// mustRaise raises through Key.Raise with testenv.Key and returns the stored token.
func mustRaise(t *testing.T, conn *pgx.Conn, resource string, token int64) int64 {
	t.Helper()
	stored, err := testenv.Key.Raise(t.Context(), conn, resource, token)
	if err != nil {
		t.Fatalf("raise(%s, %d): %v", resource, token, err)
	}
	return stored
}

// storedToken reads resource's stored token (nil: no row).
func storedToken(t *testing.T, conn *pgx.Conn, resource string) *int64 {
	t.Helper()
	var tok *int64
	err := conn.QueryRow(t.Context(), "SELECT token FROM fence.tokens WHERE resource = $1", resource).Scan(&tok)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		t.Fatalf("read the token of %s: %v", resource, err)
	}
	return tok
}

// binding is fence.bindings' row for the live backend pid ("", 0: not bound).
func binding(t *testing.T, conn *pgx.Conn, pid uint32) (string, int64) {
	t.Helper()
	var res string
	var tok int64
	err := conn.QueryRow(t.Context(), `SELECT b.resource, b.token FROM fence.bindings AS b
		JOIN pg_stat_activity AS a ON a.pid = b.pid AND a.backend_start = b.backend_start
		WHERE b.pid = $1`, int32(pid)).Scan(&res, &tok)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", 0
	}
	if err != nil {
		t.Fatalf("read the binding of %d: %v", pid, err)
	}
	return res, tok
}

// alive reports whether backend pid is listed in pg_stat_activity. conn must not be inside a
// transaction: pg_stat_activity is read once per transaction.
func alive(t *testing.T, conn *pgx.Conn, pid uint32) bool {
	t.Helper()
	var ok bool
	if err := conn.QueryRow(t.Context(), "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)", int32(pid)).Scan(&ok); err != nil {
		t.Fatal(err)
	}
	return ok
}

// wantEnded fails unless conn's backend was ended: its next statement fails and the
// connection is closed.
func wantEnded(t *testing.T, conn *pgx.Conn) {
	t.Helper()
	if _, err := conn.Exec(t.Context(), "SELECT 1"); err == nil {
		t.Fatal("a backend that should have been ended answered")
	}
	if !conn.IsClosed() {
		t.Fatal("the connection of an ended backend is not closed")
	}
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

// waitBlockedBy waits until some backend waits for a lock that backend pid holds, and returns
// that backend's pid. conn must not be inside a transaction.
func waitBlockedBy(t *testing.T, conn *pgx.Conn, pid uint32) uint32 {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		var blocked int32
		err := conn.QueryRow(t.Context(),
			"SELECT pid FROM pg_stat_activity WHERE $1 = ANY (pg_blocking_pids(pid)) LIMIT 1", int32(pid)).Scan(&blocked)
		if err == nil {
			return uint32(blocked)
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("no backend waited for a lock of backend %d", pid)
	return 0
}

// allVersions are the schema versions, in order: what a fresh install reports applied.
var allVersions = func() []int64 {
	var vs []int64
	for v := int64(1); v <= migrations.Version; v++ {
		vs = append(vs, v)
	}
	return vs
}()

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
		wantVersion4Objects(t, conn)

		states, err := fence.MigrationStatus(t.Context(), url)
		if err != nil {
			t.Fatalf("MigrationStatus: %v", err)
		}
		if len(states) != len(allVersions) {
			t.Fatalf("MigrationStatus: %d migrations, want %d", len(states), len(allVersions))
		}
		for _, s := range states {
			if !s.Applied {
				t.Errorf("migration %d (%s) not applied", s.Version, s.Name)
			}
		}
		if last := states[len(states)-1]; last.Version != migrations.Version {
			t.Errorf("last migration %+v, want version %d", last, migrations.Version)
		}
		if s := states[3]; s.Version != 4 || s.Name != "00004_bind_sessions.sql" {
			t.Errorf("version 4 is %+v, want its upgrade step 00004_bind_sessions.sql", s)
		}

		// Without a stored key, fencing is unavailable (fail closed), whatever the proof.
		_, err = bind(t.Context(), conn, testenv.Key, "billing", 1)
		wantPgError(t, err, fence.CodeUnavailable, "fencing unavailable: no proxy key is stored in this database")
		_, err = testenv.Key.Raise(t.Context(), conn, "billing", 1)
		wantPgError(t, err, fence.CodeUnavailable, "fencing unavailable: no proxy key is stored in this database")
		if tok := storedToken(t, conn, "billing"); tok != nil {
			t.Fatalf("a refused bind stored token %d", *tok)
		}
	})

	t.Run("status of an empty database changes nothing", func(t *testing.T) {
		url := c.createDB(t)
		states, err := fence.MigrationStatus(t.Context(), url)
		if err != nil {
			t.Fatalf("MigrationStatus: %v", err)
		}
		if len(states) == 0 || states[0].Version != 1 || states[0].Applied {
			t.Fatalf("MigrationStatus = %+v, want version 1 first, pending", states)
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
		if got := countRows(t, conn, "fence.goose_db_version WHERE version_id = 4"); got != 1 {
			t.Fatalf("version 4 recorded %d times", got)
		}
	})

	t.Run("non-superuser owner", func(t *testing.T) {
		url := c.createDB(t)
		db := dbName(t, url)
		c.pg.Exec(t, "DO $$ BEGIN CREATE ROLE fence_owner LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
		c.pg.Exec(t, "DO $$ BEGIN CREATE ROLE owned_app LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
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
		if err := fence.SetKey(t.Context(), ownerURL, testenv.Key); err != nil {
			t.Fatalf("SetKey as the owner: %v", err)
		}
		owner := schemaConnect(t, ownerURL)
		if got := mustRaise(t, owner, "owned", 3); got != 3 {
			t.Fatalf("raise = %d, want 3", got)
		}

		// What the owner needs (migration 4): pg_read_all_stats to see other roles' backends,
		// pg_signal_backend to end them. Without the second, a raise that must end a
		// backend fails, and nothing is raised.
		c.pg.Exec(t, "GRANT pg_read_all_stats TO fence_owner")
		app := schemaConnect(t, c.pg.URL("owned_app", db))
		if got := mustBind(t, app, "owned", 3); got != 3 {
			t.Fatalf("bind = %d, want 3", got)
		}
		_, err := testenv.Key.Raise(t.Context(), owner, "owned", 4)
		// PostgreSQL 15 says "must be a member of the role whose process is being terminated
		// or member of pg_signal_backend"; 16 says "permission denied to terminate process".
		if pe := wantPgError(t, err, "42501", ""); !strings.Contains(pe.Message+pe.Detail, "pg_signal_backend") {
			t.Errorf("the permission error does not name pg_signal_backend: %+v", pe)
		}
		if tok := storedToken(t, owner, "owned"); tok == nil || *tok != 3 {
			t.Fatalf("after the failed raise the stored token is %v, want 3", tok)
		}
		if !alive(t, owner, app.PgConn().PID()) {
			t.Fatal("the bound backend is gone after a failed raise")
		}
		c.pg.Exec(t, "GRANT pg_signal_backend TO fence_owner")
		if got := mustRaise(t, owner, "owned", 4); got != 4 {
			t.Fatalf("raise = %d, want 4", got)
		}
		if alive(t, owner, app.PgConn().PID()) {
			t.Fatal("the backend bound to 3 survived the raise to 4")
		}
		wantEnded(t, app)
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

// version1Objects are the objects of schema versions 1 to 3 that version 4 drops, as
// to_regprocedure, to_regclass or to_regnamespace arguments.
var version1Objects = []struct{ kind, name string }{
	{"procedure", "fence.check(text, bigint)"},
	{"procedure", "fence.check_readonly()"},
	{"procedure", "fence.reject(text, bigint)"},
	{"procedure", "fence.reject_write()"},
	{"procedure", "fence.mirror_token()"},
	{"procedure", "fence.raise(text, bigint)"},
	{"namespace", "fence_token"},
}

// version4Objects are the objects version 4 adds.
var version4Objects = []struct{ kind, name string }{
	{"class", "fence.keys"},
	{"class", "fence.bindings"},
	{"procedure", "fence.proof(text, text, bigint, integer)"},
	{"procedure", "fence.verify(text, text, bigint, text)"},
	{"procedure", "fence.end_stale(text, bigint, interval)"},
	{"procedure", "fence.raise_locked(text, bigint)"},
	{"procedure", "fence.bind(text, bigint, text)"},
	{"procedure", "fence.raise(text, bigint, text)"},
	{"procedure", "fence.reset(text, bigint)"},
}

func objectExists(t *testing.T, conn *pgx.Conn, kind, name string) bool {
	t.Helper()
	var ok bool
	if err := conn.QueryRow(t.Context(), "SELECT to_reg"+kind+"($1) IS NOT NULL", name).Scan(&ok); err != nil {
		t.Fatalf("to_reg%s(%s): %v", kind, name, err)
	}
	return ok
}

// wantVersion4Objects fails unless the database has version 4's objects and none of the
// version-1 objects it drops: no commit-time check, no token mirror, no unproven raise.
func wantVersion4Objects(t *testing.T, conn *pgx.Conn) {
	t.Helper()
	for _, o := range version1Objects {
		if objectExists(t, conn, o.kind, o.name) {
			t.Errorf("version 4 still has %s", o.name)
		}
	}
	for _, o := range version4Objects {
		if !objectExists(t, conn, o.kind, o.name) {
			t.Errorf("version 4 has no %s", o.name)
		}
	}
	if n := countRows(t, conn, "pg_trigger WHERE tgrelid = 'fence.tokens'::regclass AND NOT tgisinternal"); n != 0 {
		t.Errorf("fence.tokens still has %d triggers", n)
	}
	if n := countRows(t, conn, "pg_class WHERE relkind = 'S' AND relnamespace = 'fence'::regnamespace AND relname NOT IN ('goose_db_version_id_seq', 'history_id_seq')"); n != 0 {
		t.Errorf("the fence schema has %d sequences besides goose's and the history's", n)
	}
}

// TestMigrateV4Upgrade: databases at every earlier schema version, with tokens stored through
// version 1's fence.raise(text, bigint), upgrade to version 4 with their tokens kept and the
// version-1 objects gone; from version 3 with a session live inside a checked transaction, the
// migration waits for it and completes after it ends.
func TestMigrateV4Upgrade(t *testing.T) {
	c := startSchemaCluster(t)

	for _, from := range []int64{1, 2, 3} {
		t.Run(fmt.Sprintf("from version %d", from), func(t *testing.T) {
			url := c.createDB(t)
			if err := fence.MigrateTo(t.Context(), url, from); err != nil {
				t.Fatalf("migrate to version %d: %v", from, err)
			}
			conn := schemaConnect(t, url)
			schemaExec(t, conn, "SELECT fence.raise('billing', 7)")
			schemaExec(t, conn, "SELECT fence.raise('eu.billing-2', 3)")
			schemaExec(t, conn, "SELECT fence.reset('zero', 0)")
			applied, err := fence.Migrate(t.Context(), url)
			if want := allVersions[from:]; err != nil || !slices.Equal(applied, want) {
				t.Fatalf("upgrade applied %v, %v; want %v", applied, err, want)
			}
			for resource, want := range map[string]int64{"billing": 7, "eu.billing-2": 3, "zero": 0} {
				if got := storedToken(t, conn, resource); got == nil || *got != want {
					t.Errorf("after the upgrade the token of %s is %v, want %d", resource, got, want)
				}
			}
			wantVersion4Objects(t, conn)
		})
	}

	t.Run("from version 3 with a checked transaction open", func(t *testing.T) {
		url := c.createDB(t)
		if err := fence.MigrateTo(t.Context(), url, 3); err != nil {
			t.Fatalf("migrate to version 3: %v", err)
		}
		admin := schemaConnect(t, url)
		schemaExec(t, admin, "CREATE TABLE charges (id serial PRIMARY KEY, who text NOT NULL)")
		schemaExec(t, admin, "GRANT ALL ON TABLE charges, charges_id_seq TO PUBLIC")
		c.pg.Exec(t, "DO $$ BEGIN CREATE ROLE upgrade_app LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
		appURL := c.pg.URL("upgrade_app", dbName(t, url))
		// Version 3's raise, as a version-3 proxy admits its sessions.
		var stored int64
		if err := admin.QueryRow(t.Context(), "SELECT fence.raise('billing', 7)").Scan(&stored); err != nil || stored != 7 {
			t.Fatalf("version 3 raise = %d, %v", stored, err)
		}
		schemaExec(t, admin, "SELECT fence.raise('payroll', 2)")

		// A version-3 session: it wrote, and the check before its COMMIT passed; its COMMIT
		// has not been sent yet. The check holds a lock on fence_token."billing".
		old := schemaConnect(t, appURL)
		schemaExec(t, old, "BEGIN")
		schemaExec(t, old, "INSERT INTO charges (who) VALUES ('checked before the upgrade')")
		schemaExec(t, old, "SELECT fence.check('billing', 7)")

		type result struct {
			applied []int64
			err     error
		}
		done := make(chan result, 1)
		go func() {
			applied, err := fence.Migrate(t.Context(), url)
			done <- result{applied, err}
		}()
		migrator := waitBlockedBy(t, admin, old.PgConn().PID())
		var query string
		if err := admin.QueryRow(t.Context(), "SELECT query FROM pg_stat_activity WHERE pid = $1", int32(migrator)).Scan(&query); err != nil {
			t.Fatal(err)
		}
		t.Logf("the migration waits for the checked transaction in: %s", query)

		// Another version-3 session arrives while the migration waits: its check waits
		// behind the migration and fails closed after it, with its write rolled back.
		late := schemaConnect(t, appURL)
		lateDone := make(chan error, 1)
		go func() {
			lateDone <- func() error {
				tx, err := late.Begin(t.Context())
				if err != nil {
					return err
				}
				defer tx.Rollback(context.Background()) //nolint:errcheck // after a failure, to end it
				if _, err := tx.Exec(t.Context(), "INSERT INTO charges (who) VALUES ('checked during the upgrade')"); err != nil {
					return err
				}
				if _, err := tx.Exec(t.Context(), "SELECT fence.check('billing', 7)"); err != nil {
					return err
				}
				return tx.Commit(t.Context())
			}()
		}()

		select {
		case r := <-done:
			t.Fatalf("Migrate returned %v, %v while a checked transaction was open", r.applied, r.err)
		case err := <-lateDone:
			t.Fatalf("a version-3 check during the migration returned %v before the migration ended", err)
		case <-time.After(300 * time.Millisecond):
		}

		// The checked transaction commits: version 3 admitted it, and it commits before the
		// upgrade does.
		schemaExec(t, old, "COMMIT")
		var r result
		select {
		case r = <-done:
		case <-time.After(30 * time.Second):
			t.Fatal("Migrate did not complete within 30 s of the checked transaction's end")
		}
		if r.err != nil || !slices.Equal(r.applied, allVersions[3:]) {
			t.Fatalf("upgrade applied %v, %v; want %v", r.applied, r.err, allVersions[3:])
		}
		select {
		case err := <-lateDone:
			if err == nil {
				t.Fatal("a version-3 check that waited for the migration committed after it")
			}
			t.Logf("the version-3 check that waited for the migration failed: %v", err)
		case <-time.After(30 * time.Second):
			t.Fatal("the version-3 check that waited for the migration is still blocked")
		}
		if n := countRows(t, admin, "charges WHERE who = 'checked before the upgrade'"); n != 1 {
			t.Fatalf("the checked transaction left %d rows, want 1", n)
		}
		if n := countRows(t, admin, "charges WHERE who = 'checked during the upgrade'"); n != 0 {
			t.Fatalf("the check that waited for the migration left %d rows, want 0", n)
		}

		// Afterwards: the tokens kept, version 1's objects gone, its calls fail.
		for resource, want := range map[string]int64{"billing": 7, "payroll": 2} {
			if got := storedToken(t, admin, resource); got == nil || *got != want {
				t.Errorf("after the upgrade the token of %s is %v, want %d", resource, got, want)
			}
		}
		wantVersion4Objects(t, admin)
		app := schemaConnect(t, appURL)
		_, err := app.Exec(t.Context(), "SELECT fence.raise('billing', 8)")
		wantPgError(t, err, "42883", "function fence.raise(unknown, integer) does not exist")
		_, err = app.Exec(t.Context(), "SELECT fence.check('billing', 7)")
		wantPgError(t, err, "42883", "function fence.check(unknown, integer) does not exist")
		if got := storedToken(t, admin, "billing"); got == nil || *got != 7 {
			t.Fatalf("the old raise moved the token to %v", got)
		}

		// Bind works with the key; the stored tokens hold.
		if err := fence.SetKey(t.Context(), url, testenv.Key); err != nil {
			t.Fatalf("SetKey: %v", err)
		}
		if got := mustBind(t, app, "billing", 7); got != 7 {
			t.Fatalf("bind with the stored token = %d, want 7", got)
		}
		_, err = bind(t.Context(), schemaConnect(t, appURL), testenv.Key, "billing", 6)
		wantPgError(t, err, fence.CodeStale, `stale fencing token: resource "billing" token 6 is lower than the highest admitted token 7`)
		if got := mustBind(t, schemaConnect(t, appURL), "billing", 8); got != 8 {
			t.Fatalf("bind with a higher token = %d, want 8", got)
		}
		wantEnded(t, app) // bound to 7
		_, err = bind(t.Context(), schemaConnect(t, appURL), fence.Key("another key, not the stored one"), "payroll", 2)
		wantPgError(t, err, fence.CodeProof, "fencing proof invalid")
	})
}

// TestMigrateV4Down: versions 9 (the stores' words), 8 (the review fixes), 7 (Consul), 6 (the history) and 5 (the lease) migrate down to version 4 and up again; version 4
// cannot be migrated down: the attempt fails and leaves the schema at version 4, fencing
// intact.
func TestMigrateV4Down(t *testing.T) {
	c := startSchemaCluster(t)
	url := c.createDB(t)
	if err := fence.MigrateTo(t.Context(), url, fence.LegacyVersion); err != nil {
		t.Fatal(err)
	}
	if err := fence.SetKey(t.Context(), url, testenv.Key); err != nil {
		t.Fatal(err)
	}
	conn := schemaConnect(t, url)
	mustRaise(t, conn, "billing", 5)

	for _, to := range []int64{3, 0} {
		err := fence.MigrateTo(t.Context(), url, to)
		if err == nil {
			t.Fatalf("migrating version 4 down to %d succeeded", to)
		}
		if !strings.Contains(err.Error(), "fence schema version 4 cannot be migrated down") {
			t.Errorf("down to %d: %v, want the migration's own message", to, err)
		}
	}
	states, err := fence.MigrationStatus(t.Context(), url)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range states {
		if s.Applied != (s.Version <= 4) {
			t.Errorf("after the failed down migration, %d (%s): applied %t, want %t", s.Version, s.Name, s.Applied, s.Version <= 4)
		}
	}
	wantVersion4Objects(t, conn)
	var leases bool
	if err := conn.QueryRow(t.Context(), "SELECT to_regclass('fence.leases') IS NOT NULL").Scan(&leases); err != nil || leases {
		t.Errorf("fence.leases after migrating version 5 down: exists %t, %v", leases, err)
	}
	var history bool
	if err := conn.QueryRow(t.Context(), "SELECT to_regclass('fence.history') IS NOT NULL").Scan(&history); err != nil || history {
		t.Errorf("fence.history after migrating version 6 down: exists %t, %v", history, err)
	}
	if got := storedToken(t, conn, "billing"); got == nil || *got != 5 {
		t.Fatalf("after the failed down migration the token is %v, want 5", got)
	}
	if got := mustBind(t, schemaConnect(t, url), "billing", 5); got != 5 {
		t.Fatalf("bind after the failed down migration = %d", got)
	}
	if applied, err := fence.Migrate(t.Context(), url); err != nil || !slices.Equal(applied, allVersions[4:]) {
		t.Fatalf("Migrate after the failed down migration = %v, %v; want %v", applied, err, allVersions[4:])
	}
	if got := mustBind(t, schemaConnect(t, url), "billing", 5); got != 5 {
		t.Fatalf("bind at version 5 again = %d", got)
	}
}
