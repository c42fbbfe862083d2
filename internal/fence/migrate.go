package fence

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/fenceproxy/fenceproxy/migrations"
)

// Schema is the PostgreSQL schema that holds the fencing tokens, the bindings, the functions
// the proxy calls and goose's version table.
const Schema = "fence"

// SchemaVersion is the version of the fence schema this fenceproxy needs: its highest
// migration (migrations/NNNNN_*.sql). Messages that send an operator to `fenceproxy migrate`
// name it; TestSchemaVersionIsTheLastMigration keeps it in step with the files.
const SchemaVersion = 10

// versionTable is goose's record of applied migrations. It lives in the fence schema, not in
// public, so that the product leaves nothing outside its own schema.
const versionTable = Schema + ".goose_db_version"

// migrateLockID is the session advisory lock that serialises concurrent migrations of one
// database (several proxies starting at once). It is fenceproxy's own, not goose's default, so
// that an application that also uses goose in the same database never waits for us nor we for
// it. The value is the first 8 bytes of SHA-256("fenceproxy migrate").
const migrateLockID int64 = 0x7330eb8e9bfdc972

// MigrationState is one migration and whether it is applied.
type MigrationState struct {
	Version int64
	Name    string // file name, e.g. "00001_fence_schema.sql"
	Applied bool
}

// Migrate applies the pending migrations of the fence schema to the database at databaseURL
// (a libpq URL or key=value string, as pgx accepts) and returns the versions it applied, empty
// when the schema was up to date.
//
// It is safe to run from several processes at once: a session advisory lock, held from before
// the schema is created until goose is done, serialises them, and the later ones find nothing
// left to apply. The role it connects as needs the right to create the fence schema (CREATE on
// the database), or to own it when it exists; the functions it creates run with that role's
// rights (SECURITY DEFINER), so it should not be an application's role.
func Migrate(ctx context.Context, databaseURL string) (applied []int64, err error) {
	err = underLock(ctx, databaseURL, func(p *goose.Provider) error {
		results, err := p.Up(ctx)
		if err != nil {
			return fmt.Errorf("fence: migrate: %w", err)
		}
		for _, r := range results {
			applied = append(applied, r.Source.Version)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return applied, nil
}

// underLock runs fn with goose's provider for the database at databaseURL, the migration lock
// held and the fence schema created (see lockAndCreateSchema).
func underLock(ctx context.Context, databaseURL string, fn func(*goose.Provider) error) (err error) {
	p, db, err := migrator(databaseURL)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, db.Close()) }()
	unlock, err := lockAndCreateSchema(ctx, db)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, unlock()) }()
	return fn(p)
}

// MigrationStatus reports every known migration of the fence schema and whether the database at
// databaseURL has it applied. Unlike goose's own status it changes nothing: on a database
// without the fence schema every migration is reported pending.
func MigrationStatus(ctx context.Context, databaseURL string) (_ []MigrationState, err error) {
	p, db, err := migrator(databaseURL)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, db.Close()) }()

	var exists bool
	if err := db.QueryRowContext(ctx, "SELECT to_regclass($1) IS NOT NULL", versionTable).Scan(&exists); err != nil {
		return nil, fmt.Errorf("fence: migration status: %w", err)
	}
	if !exists {
		var states []MigrationState
		for _, s := range p.ListSources() {
			states = append(states, MigrationState{Version: s.Version, Name: path.Base(s.Path)})
		}
		return states, nil
	}

	status, err := p.Status(ctx)
	if err != nil {
		return nil, fmt.Errorf("fence: migration status: %w", err)
	}
	states := make([]MigrationState, 0, len(status))
	for _, s := range status {
		states = append(states, MigrationState{
			Version: s.Source.Version,
			Name:    path.Base(s.Source.Path),
			Applied: s.State == goose.StateApplied,
		})
	}
	return states, nil
}

func openDB(databaseURL string) (*sql.DB, error) {
	if databaseURL == "" {
		return nil, errors.New("fence: migrate: empty database URL")
	}
	cfg, err := pgx.ParseConfig(databaseURL)
	if err != nil {
		return nil, fmt.Errorf("fence: migrate: %w", err)
	}
	return stdlib.OpenDB(*cfg), nil
}

// migrator opens the database at databaseURL and returns goose's provider for the embedded
// migrations, and the handle for the caller to close.
func migrator(databaseURL string) (*goose.Provider, *sql.DB, error) {
	db, err := openDB(databaseURL)
	if err != nil {
		return nil, nil, err
	}
	p, err := goose.NewProvider(goose.DialectPostgres, db, migrations.FS,
		goose.WithTableName(versionTable),
		goose.WithDisableGlobalRegistry(true),
		goose.WithLogger(goose.NopLogger()),
	)
	if err != nil {
		return nil, nil, errors.Join(fmt.Errorf("fence: migrate: %w", err), db.Close())
	}
	return p, db, nil
}

// lockAndCreateSchema takes the migration lock on a connection of its own and creates the
// fence schema if it is missing; the caller releases the lock by calling unlock.
//
// Why not goose's lock.NewPostgresSessionLocker: goose creates its version table before it
// takes a session lock (Provider.Up checks for pending migrations first, unlocked), and that
// table lives in the fence schema, so the schema must exist before goose runs at all; creating
// it under the lock keeps two first-time migrations from racing on it (CREATE SCHEMA IF NOT
// EXISTS is not safe against a concurrent creation: it can fail with a unique violation).
// Holding the lock around all of goose's work also keeps concurrent first runs from racing on
// the version table (goose retries that race after a one-second sleep). And goose's locker polls
// pg_try_advisory_lock at intervals of at least a second, where pg_advisory_lock returns as soon
// as the lock is free, and is cancelled with ctx by the driver.
func lockAndCreateSchema(ctx context.Context, db *sql.DB) (unlock func() error, err error) {
	conn, err := db.Conn(ctx)
	if err != nil {
		return nil, fmt.Errorf("fence: migrate: connect: %w", err)
	}
	if _, err := conn.ExecContext(ctx, "SELECT pg_advisory_lock($1)", migrateLockID); err != nil {
		return nil, errors.Join(fmt.Errorf("fence: migrate: take migration lock: %w", err), conn.Close())
	}
	unlock = func() error {
		// Closing the connection releases the session lock as well; unlocking first keeps the
		// lock from outliving a connection that the pool might keep. Not cancelled with ctx.
		_, err := conn.ExecContext(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock($1)", migrateLockID)
		if err != nil {
			err = fmt.Errorf("fence: migrate: release migration lock: %w", err)
		}
		return errors.Join(err, conn.Close())
	}

	var exists bool
	if err := conn.QueryRowContext(ctx, "SELECT to_regnamespace($1) IS NOT NULL", Schema).Scan(&exists); err != nil {
		return nil, errors.Join(fmt.Errorf("fence: migrate: look up schema %s: %w", Schema, err), unlock())
	}
	if !exists {
		// Only when missing: CREATE SCHEMA IF NOT EXISTS would still demand CREATE on the
		// database from a role that owns an existing schema.
		if _, err := conn.ExecContext(ctx, "CREATE SCHEMA "+Schema); err != nil {
			return nil, errors.Join(fmt.Errorf("fence: migrate: create schema %s: %w", Schema, err), unlock())
		}
	}
	return unlock, nil
}
