package fence_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
	"github.com/fenceproxy/fenceproxy/migrations"
)

// catalogQuery lists what the fence schema is made of, one row an object or attribute: every
// function's definition (pg_get_functiondef: arguments, result, language, volatility, security,
// SET clauses and body), owner, privileges and comment; every relation's kind, persistence,
// privileges and comment; every column's type, nullability, default, identity and collation;
// constraints, indexes, triggers; the schemas named fence*; and the recorded versions.
const catalogQuery = `
SELECT 'function', p.oid::regprocedure::text, pg_get_functiondef(p.oid),
       coalesce(p.proacl::text, ''), coalesce(obj_description(p.oid, 'pg_proc'), ''), pg_get_userbyid(p.proowner)::text
FROM pg_proc AS p WHERE p.pronamespace = 'fence'::regnamespace
UNION ALL
SELECT 'relation', c.relname::text, c.relkind::text || c.relpersistence::text,
       coalesce(c.relacl::text, ''), coalesce(obj_description(c.oid, 'pg_class'), ''), pg_get_userbyid(c.relowner)::text
FROM pg_class AS c WHERE c.relnamespace = 'fence'::regnamespace
UNION ALL
SELECT 'column', c.relname || '.' || a.attname,
       format_type(a.atttypid, a.atttypmod) || ' notnull=' || a.attnotnull::text || ' default=' ||
       coalesce(pg_get_expr(d.adbin, d.adrelid), '') || ' identity=' || a.attidentity::text || ' collation=' ||
       coalesce((SELECT l.collname::text FROM pg_collation AS l WHERE l.oid = a.attcollation), ''),
       coalesce(a.attacl::text, ''), coalesce(col_description(c.oid, a.attnum), ''), a.attnum::text
FROM pg_class AS c
JOIN pg_attribute AS a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
LEFT JOIN pg_attrdef AS d ON d.adrelid = c.oid AND d.adnum = a.attnum
WHERE c.relnamespace = 'fence'::regnamespace
UNION ALL
SELECT 'constraint', conrelid::regclass::text || '.' || conname, pg_get_constraintdef(oid), '', '', ''
FROM pg_constraint WHERE connamespace = 'fence'::regnamespace
UNION ALL
SELECT 'index', indexrelid::regclass::text, pg_get_indexdef(indexrelid), '', '', ''
FROM pg_index WHERE indrelid IN (SELECT oid FROM pg_class WHERE relnamespace = 'fence'::regnamespace)
UNION ALL
SELECT 'trigger', tgrelid::regclass::text || '.' || tgname, pg_get_triggerdef(oid), '', '', ''
FROM pg_trigger WHERE tgrelid IN (SELECT oid FROM pg_class WHERE relnamespace = 'fence'::regnamespace)
UNION ALL
SELECT 'schema', nspname::text, '', coalesce(nspacl::text, ''), coalesce(obj_description(oid, 'pg_namespace'), ''),
       pg_get_userbyid(nspowner)::text
FROM pg_namespace WHERE nspname LIKE 'fence%'
UNION ALL
SELECT 'version', string_agg(version_id::text, ',' ORDER BY version_id), '', '', '', ''
FROM fence.goose_db_version WHERE is_applied
ORDER BY 1, 2`

// catalog reads catalogQuery in the database at url, one string a row.
func catalog(t *testing.T, url string) []string {
	t.Helper()
	rows, err := schemaConnect(t, url).Query(t.Context(), catalogQuery)
	if err != nil {
		t.Fatalf("read the catalog: %v", err)
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (string, error) {
		var f [6]string
		if err := r.Scan(&f[0], &f[1], &f[2], &f[3], &f[4], &f[5]); err != nil {
			return "", err
		}
		return strings.Join(f[:], " | "), nil
	})
	if err != nil {
		t.Fatalf("read the catalog: %v", err)
	}
	return got
}

// wantSameCatalog fails with the rows that differ unless got and want are the same.
func wantSameCatalog(t *testing.T, what string, got, want []string) {
	t.Helper()
	if slices.Equal(got, want) {
		return
	}
	var only []string
	for _, r := range got {
		if !slices.Contains(want, r) {
			only = append(only, "+ "+r)
		}
	}
	for _, r := range want {
		if !slices.Contains(got, r) {
			only = append(only, "- "+r)
		}
	}
	t.Fatalf("%s: the catalog differs from a fresh install's (+ only here, - only in the fresh install):\n%s", what, strings.Join(only, "\n"))
}

// TestMigrateEveryVersion: a database at every earlier schema version (1 to
// fence.LegacyVersion, installed with the migrations those releases shipped) is upgraded with
// sessions live; the result has the same catalog as a fresh install. From version 4 on, bound
// sessions of an application role stay bound through the upgrade and stay fenced: a lower
// token is refused, a raise ends the stale ones and only them, and a raise to a token below one
// that a stale session had cannot happen. From versions 1 to 3 (no bindings yet) the stored
// tokens are kept and bind after it.
func TestMigrateEveryVersion(t *testing.T) {
	c := startSchemaCluster(t)
	fresh := c.migratedDB(t)
	freshCatalog := catalog(t, fresh)
	if len(freshCatalog) < 50 {
		t.Fatalf("a fresh install's catalog has %d rows", len(freshCatalog))
	}
	c.pg.Exec(t, "DO $$ BEGIN CREATE ROLE every_app LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")

	for from := int64(1); from <= fence.LegacyVersion; from++ {
		t.Run(fmt.Sprintf("from version %d", from), func(t *testing.T) {
			began := time.Now()
			url := c.createDB(t)
			if err := fence.MigrateTo(t.Context(), url, from); err != nil {
				t.Fatalf("install version %d: %v", from, err)
			}
			admin := schemaConnect(t, url)
			appURL := c.pg.URL("every_app", dbName(t, url))
			var leader, other *pgx.Conn
			if from < 4 {
				// Version 1's raise, unproven.
				schemaExec(t, admin, "SELECT fence.raise('billing', 5)")
				schemaExec(t, admin, "SELECT fence.raise('payroll', 3)")
			} else {
				if err := fence.SetKey(t.Context(), url, testenv.Key); err != nil {
					t.Fatalf("SetKey at version %d: %v", from, err)
				}
				leader = schemaConnect(t, appURL)
				if got := mustBind(t, leader, "billing", 5); got != 5 {
					t.Fatalf("bind at version %d = %d", from, got)
				}
				other = schemaConnect(t, appURL)
				if got := mustBind(t, other, "payroll", 3); got != 3 {
					t.Fatalf("bind at version %d = %d", from, got)
				}
			}

			applied, err := fence.Migrate(t.Context(), url)
			want := make([]int64, 0, migrations.Version)
			for v := from + 1; v <= migrations.Version; v++ {
				want = append(want, v)
			}
			if err != nil || !slices.Equal(applied, want) {
				t.Fatalf("upgrade from %d applied %v, %v; want %v", from, applied, err, want)
			}
			wantSameCatalog(t, fmt.Sprintf("upgraded from version %d", from), catalog(t, url), freshCatalog)
			wantVersion4Objects(t, admin)
			for resource, want := range map[string]int64{"billing": 5, "payroll": 3} {
				if got := storedToken(t, admin, resource); got == nil || *got != want {
					t.Errorf("after the upgrade the token of %s is %v, want %d", resource, got, want)
				}
			}
			if from < 4 {
				if err := fence.SetKey(t.Context(), url, testenv.Key); err != nil {
					t.Fatalf("SetKey: %v", err)
				}
				leader = schemaConnect(t, appURL)
				if got := mustBind(t, leader, "billing", 5); got != 5 {
					t.Fatalf("bind after the upgrade = %d", got)
				}
				other = schemaConnect(t, appURL)
				if got := mustBind(t, other, "payroll", 3); got != 3 {
					t.Fatalf("bind after the upgrade = %d", got)
				}
			}

			// The sessions bound before the upgrade are still bound, and fenced.
			for conn, want := range map[*pgx.Conn]string{leader: "billing 5", other: "payroll 3"} {
				res, tok := binding(t, admin, conn.PgConn().PID())
				if got := fmt.Sprintf("%s %d", res, tok); got != want {
					t.Errorf("backend %d is bound to %q after the upgrade, want %q", conn.PgConn().PID(), got, want)
				}
				schemaExec(t, conn, "SELECT 1")
			}
			_, err = bind(t.Context(), schemaConnect(t, appURL), testenv.Key, "billing", 4)
			wantPgError(t, err, fence.CodeStale, `stale fencing token: resource "billing" token 4 is lower than the highest admitted token 5`)
			_, err = bind(t.Context(), leader, testenv.Key, "billing", 6)
			wantPgError(t, err, fence.CodeNotAllowed, "not allowed in a fenced session: this session is bound to resource \"billing\" token 5 already")

			// A raise ends the stale session, and nobody else; and is durable where a failover
			// can take it (D1) in the upgraded schema too.
			raiser := schemaConnect(t, admin.Config().ConnString())
			schemaExec(t, raiser, "SET synchronous_commit = off")
			tx, err := raiser.Begin(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			q, err := testenv.Key.RaiseSQL(raiser.Config().Database, "billing", 6, raiser.PgConn().PID())
			if err != nil {
				t.Fatal(err)
			}
			var got int64
			if err := tx.QueryRow(t.Context(), q).Scan(&got); err != nil || got != 6 {
				t.Fatalf("raise after the upgrade = %d, %v", got, err)
			}
			var setting string
			if err := tx.QueryRow(t.Context(), "SHOW synchronous_commit").Scan(&setting); err != nil || setting != "on" {
				t.Fatalf("the raise's transaction commits with synchronous_commit %q, %v; want on (D1)", setting, err)
			}
			if err := tx.Commit(t.Context()); err != nil {
				t.Fatal(err)
			}
			wantEnded(t, leader)
			if !alive(t, admin, other.PgConn().PID()) {
				t.Fatal("the raise of billing ended the session bound to payroll")
			}
			schemaExec(t, other, "SELECT 1")
			if got := mustBind(t, schemaConnect(t, appURL), "billing", 6); got != 6 {
				t.Fatalf("bind with the raised token = %d", got)
			}
			if applied, err := fence.Migrate(t.Context(), url); err != nil || len(applied) != 0 {
				t.Fatalf("Migrate again = %v, %v; want nothing applied", applied, err)
			}
			wantSameCatalog(t, "migrated again", catalog(t, url), freshCatalog)
			t.Logf("version %d: installed, bound, upgraded and checked in %v", from, time.Since(began).Round(time.Millisecond))
		})
	}

	t.Run("newer schema refused", func(t *testing.T) {
		url := c.migratedDB(t)
		admin := schemaConnect(t, url)
		schemaExec(t, admin, "INSERT INTO fence.goose_db_version (version_id, is_applied) VALUES ($1, true)", migrations.Version+1)
		_, err := fence.Migrate(t.Context(), url)
		if err == nil || !strings.Contains(err.Error(), "newer than this fenceproxy's") {
			t.Fatalf("Migrate of a newer schema = %v, want a refusal", err)
		}
		schemaExec(t, admin, "DELETE FROM fence.goose_db_version WHERE version_id = $1", migrations.Version+1)
		wantSameCatalog(t, "after the refusal", catalog(t, url), freshCatalog)
	})
}

// TestMigratePlan: a fresh install runs the baseline and no upgrade step; an upgrade runs the
// steps above its version and no baseline; both then run every function file, each function
// defined in exactly one of them.
func TestMigratePlan(t *testing.T) {
	fresh, err := fence.Plan(0)
	if err != nil {
		t.Fatal(err)
	}
	if fresh[0] != "baseline.sql" || slices.ContainsFunc(fresh, func(f string) bool { return strings.HasPrefix(f, "upgrade/") }) {
		t.Fatalf("fresh install runs %v", fresh)
	}
	from3, err := fence.Plan(3)
	if err != nil {
		t.Fatal(err)
	}
	if slices.Contains(from3, "baseline.sql") || from3[0] != "upgrade/00004_bind_sessions.sql" {
		t.Fatalf("upgrade from 3 runs %v", from3)
	}
	current, err := fence.Plan(migrations.Version)
	if err != nil {
		t.Fatal(err)
	}
	defined := map[string]string{}
	for _, f := range current {
		if !strings.HasPrefix(f, "functions/") {
			t.Fatalf("an up-to-date database runs %s", f)
		}
		text, err := migrations.FS.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		n := strings.Count(string(text), "CREATE OR REPLACE FUNCTION ")
		if n != 1 || strings.Count(string(text), "CREATE FUNCTION") != 0 {
			t.Errorf("%s defines %d functions with CREATE OR REPLACE, want exactly one", f, n)
		}
		name := strings.TrimSuffix(strings.TrimPrefix(f, "functions/"), ".sql")
		if !strings.Contains(string(text), "CREATE OR REPLACE FUNCTION "+name+"(") {
			t.Errorf("%s does not define %s", f, name)
		}
		if prev, dup := defined[name]; dup {
			t.Errorf("%s defined in %s and %s", name, prev, f)
		}
		defined[name] = f
	}
	for _, f := range append([]string{"baseline.sql"}, from3...) {
		if strings.HasPrefix(f, "functions/") {
			continue
		}
		text, err := migrations.FS.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(text), "FUNCTION fence.") && !strings.Contains(string(text), "DROP FUNCTION") {
			t.Errorf("%s defines a function: functions belong in functions/", f)
		}
	}
}
