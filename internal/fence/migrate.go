package fence

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/migrations"
)

// Schema is the PostgreSQL schema that holds the fencing tokens, the bindings, the functions
// the proxy calls and the schema's version table.
const Schema = "fence"

// SchemaVersion is the version of the fence schema this fenceproxy needs (migrations.Version,
// where it is stated). Messages that send an operator to `fenceproxy migrate` name it.
const SchemaVersion = migrations.Version

// versionTable records the schema versions a database has. fenceproxy up to schema version 9
// applied its migrations with goose, whose table this is; its name, layout and rows (one per
// version, and goose's row 0) are kept, so that every database installed since reads the same.
// It lives in the fence schema, not in public, so that the product leaves nothing outside its
// own schema.
const versionTable = Schema + ".goose_db_version"

// migrateLockID is the session advisory lock that serialises concurrent migrations of one
// database (several proxies starting at once). It is fenceproxy's own, not goose's default, so
// that an application that uses goose in the same database never waits for us nor we for it.
// The value is the first 8 bytes of SHA-256("fenceproxy migrate").
const migrateLockID int64 = 0x7330eb8e9bfdc972

// MigrationState is one schema version and whether the database has it.
type MigrationState struct {
	Version int64
	// Name is the file of the version's upgrade step (e.g. "00004_bind_sessions.sql"), empty
	// for a version that changed functions only.
	Name    string
	Applied bool
}

// Migrate installs or upgrades the fence schema in the database at databaseURL (a libpq URL or
// key=value string, as pgx accepts) to migrations.Version, and returns the versions the
// database did not have before (1 to migrations.Version on a fresh install), empty when it was
// up to date.
//
// In one transaction: a database without the schema gets migrations/baseline.sql (the tables
// of the current version, nothing of an earlier one), a database at an earlier version gets
// the upgrade steps above its version (migrations/upgrade/), and then both get every function
// file (migrations/functions/, CREATE OR REPLACE), so that each function is exactly as its one
// file says; a database that is up to date gets the function files alone, which changes nothing
// unless a function was altered by hand. Sessions live throughout: they see the old functions
// until the transaction commits, and the new ones from their next call.
//
// It is safe to run from several processes at once: a session advisory lock, held from before
// the schema is created until the transaction has committed, serialises them. The role it
// connects as needs the right to create the fence schema (CREATE on the database), or to own it
// when it exists; the functions it creates run with that role's rights (SECURITY DEFINER), so
// it should not be an application's role. A database whose schema is newer than this code's is
// left alone, with an error.
func Migrate(ctx context.Context, databaseURL string) (applied []int64, err error) {
	err = underLock(ctx, databaseURL, func(conn *pgx.Conn) error {
		tx, err := conn.Begin(ctx)
		if err != nil {
			return fmt.Errorf("fence: migrate: %w", err)
		}
		defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // after a commit, a no-op
		applied, err = migrateTx(ctx, tx)
		if err != nil {
			return err
		}
		if err := tx.Commit(ctx); err != nil {
			return fmt.Errorf("fence: migrate: commit: %w", err)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return applied, nil
}

// migrateTx does Migrate's work inside tx.
func migrateTx(ctx context.Context, tx pgx.Tx) ([]int64, error) {
	// The files name every object with its schema; pinning search_path keeps an object a role
	// created elsewhere from standing in for a built-in one.
	if _, err := tx.Exec(ctx, "SET LOCAL search_path = pg_catalog, pg_temp"); err != nil {
		return nil, fmt.Errorf("fence: migrate: %w", err)
	}
	if err := createSchema(ctx, tx); err != nil {
		return nil, err
	}
	from, err := schemaVersion(ctx, tx)
	if err != nil {
		return nil, err
	}
	if from > migrations.Version {
		return nil, fmt.Errorf("fence: migrate: the database's fence schema is version %d, newer than this fenceproxy's %d: run a newer fenceproxy's migrate", from, migrations.Version)
	}
	scripts, err := plan(from)
	if err != nil {
		return nil, err
	}
	bodiesUnchecked := false
	for _, name := range scripts {
		if strings.HasPrefix(name, "functions/") && !bodiesUnchecked {
			// The function files run in name order, and a LANGUAGE sql body names functions
			// of later files (fence.bind's fence.bind_full and fence.mac): each body is checked
			// when it is first called, as pg_dump's restores do.
			if _, err := tx.Exec(ctx, "SET LOCAL check_function_bodies = off"); err != nil {
				return nil, fmt.Errorf("fence: migrate: %w", err)
			}
			bodiesUnchecked = true
		}
		sql, err := fs.ReadFile(migrations.FS, name)
		if err != nil {
			return nil, fmt.Errorf("fence: migrate: %w", err)
		}
		if _, err := tx.Exec(ctx, string(sql)); err != nil {
			return nil, fmt.Errorf("fence: migrate: %s: %w", name, err)
		}
	}
	if from == 0 {
		// goose's layout and its row 0 (see versionTable).
		if _, err := tx.Exec(ctx, `CREATE TABLE `+versionTable+` (
			id integer PRIMARY KEY GENERATED BY DEFAULT AS IDENTITY,
			version_id bigint NOT NULL,
			is_applied boolean NOT NULL,
			tstamp timestamp NOT NULL DEFAULT now()
		)`); err != nil {
			return nil, fmt.Errorf("fence: migrate: create %s: %w", versionTable, err)
		}
		if _, err := tx.Exec(ctx, "INSERT INTO "+versionTable+" (version_id, is_applied) VALUES (0, true)"); err != nil {
			return nil, fmt.Errorf("fence: migrate: %w", err)
		}
	}
	var applied []int64
	for v := from + 1; v <= migrations.Version; v++ {
		if _, err := tx.Exec(ctx, "INSERT INTO "+versionTable+" (version_id, is_applied) VALUES ($1, true)", v); err != nil {
			return nil, fmt.Errorf("fence: migrate: record version %d: %w", v, err)
		}
		applied = append(applied, v)
	}
	return applied, nil
}

// plan lists the files that bring a database at version from (0: no fence schema yet) to
// migrations.Version, in the order they run: the baseline or the upgrade steps above from, then
// every function file in name order.
func plan(from int64) ([]string, error) {
	steps, err := upgradeSteps()
	if err != nil {
		return nil, err
	}
	var files []string
	if from == 0 {
		files = append(files, "baseline.sql")
	} else {
		for v := from + 1; v <= migrations.Version; v++ {
			if name, ok := steps[v]; ok {
				files = append(files, path.Join("upgrade", name))
			}
		}
	}
	functions, err := fs.Glob(migrations.FS, "functions/*.sql")
	if err != nil {
		return nil, fmt.Errorf("fence: migrate: %w", err)
	}
	sort.Strings(functions)
	return append(files, functions...), nil
}

// upgradeSteps maps a version to its upgrade step's file name in migrations/upgrade.
func upgradeSteps() (map[int64]string, error) {
	entries, err := fs.ReadDir(migrations.FS, "upgrade")
	if err != nil {
		return nil, fmt.Errorf("fence: migrate: %w", err)
	}
	steps := make(map[int64]string, len(entries))
	for _, e := range entries {
		prefix, _, ok := strings.Cut(e.Name(), "_")
		v, err := strconv.ParseInt(prefix, 10, 64)
		if !ok || err != nil || v < 2 || v > migrations.Version || !strings.HasSuffix(e.Name(), ".sql") {
			return nil, fmt.Errorf("fence: migrate: upgrade/%s: want NNNNN_name.sql for a version from 2 to %d", e.Name(), migrations.Version)
		}
		if other, dup := steps[v]; dup {
			return nil, fmt.Errorf("fence: migrate: two upgrade steps to version %d: %s and %s", v, other, e.Name())
		}
		steps[v] = e.Name()
	}
	return steps, nil
}

// schemaVersion is the fence schema version of the database q reads: 0 without a version table.
// goose deleted a version's row when it migrated down, so the highest row is the version.
func schemaVersion(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) (int64, error) {
	var exists bool
	if err := q.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", versionTable).Scan(&exists); err != nil {
		return 0, fmt.Errorf("fence: schema version: %w", err)
	}
	if !exists {
		return 0, nil
	}
	var v int64
	if err := q.QueryRow(ctx, "SELECT coalesce(max(version_id), 0) FROM "+versionTable+" WHERE is_applied").Scan(&v); err != nil {
		return 0, fmt.Errorf("fence: schema version: %w", err)
	}
	return v, nil
}

// MigrationStatus reports every schema version up to migrations.Version and whether the
// database at databaseURL has it. It changes nothing: on a database without the fence schema
// every version is reported pending.
func MigrationStatus(ctx context.Context, databaseURL string) (_ []MigrationState, err error) {
	conn, err := connect(ctx, databaseURL)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, conn.Close(context.WithoutCancel(ctx))) }()
	current, err := schemaVersion(ctx, conn)
	if err != nil {
		return nil, err
	}
	steps, err := upgradeSteps()
	if err != nil {
		return nil, err
	}
	states := make([]MigrationState, 0, migrations.Version)
	for v := int64(1); v <= migrations.Version; v++ {
		states = append(states, MigrationState{Version: v, Name: steps[v], Applied: v <= current})
	}
	return states, nil
}

func connect(ctx context.Context, databaseURL string) (*pgx.Conn, error) {
	if databaseURL == "" {
		return nil, errors.New("fence: migrate: empty database URL")
	}
	cfg, err := pgx.ParseConfig(databaseURL)
	if err != nil {
		return nil, fmt.Errorf("fence: migrate: %w", err)
	}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("fence: migrate: connect: %w", err)
	}
	return conn, nil
}

// underLock runs fn on a connection to the database at databaseURL that holds the migration
// lock (pg_advisory_lock returns as soon as the lock is free, and is cancelled with ctx).
func underLock(ctx context.Context, databaseURL string, fn func(*pgx.Conn) error) (err error) {
	conn, err := connect(ctx, databaseURL)
	if err != nil {
		return err
	}
	// Closing the connection releases the session lock as well; not cancelled with ctx.
	defer func() { err = errors.Join(err, conn.Close(context.WithoutCancel(ctx))) }()
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", migrateLockID); err != nil {
		return fmt.Errorf("fence: migrate: take migration lock: %w", err)
	}
	defer func() {
		if conn.IsClosed() {
			return
		}
		if _, uerr := conn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock($1)", migrateLockID); uerr != nil {
			err = errors.Join(err, fmt.Errorf("fence: migrate: release migration lock: %w", uerr))
		}
	}()
	return fn(conn)
}

// createSchema creates the fence schema when it is missing. Only then: CREATE SCHEMA IF NOT
// EXISTS would still demand CREATE on the database from a role that owns an existing schema.
// Under the migration lock, so two first-time migrations do not race on it.
func createSchema(ctx context.Context, tx pgx.Tx) error {
	var exists bool
	if err := tx.QueryRow(ctx, "SELECT to_regnamespace($1) IS NOT NULL", Schema).Scan(&exists); err != nil {
		return fmt.Errorf("fence: migrate: look up schema %s: %w", Schema, err)
	}
	if exists {
		return nil
	}
	if _, err := tx.Exec(ctx, "CREATE SCHEMA "+Schema); err != nil {
		return fmt.Errorf("fence: migrate: create schema %s: %w", Schema, err)
	}
	return nil
}
