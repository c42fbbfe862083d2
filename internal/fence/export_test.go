package fence

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
)

// MigrateTo installs a database at an earlier schema version, or rolls it back to one, for
// tests of upgrades: it applies the migrations that fenceproxy released up to schema version 9
// (testdata/legacy, goose files kept only for these tests) up to version, or their Down sections
// down to it, with goose as those releases did. Not part of the API: the product installs the
// current schema and upgrades (Migrate), never down.
// LegacyVersion is the last schema version released as goose migrations (testdata/legacy):
// MigrateTo installs versions up to it; later versions exist only as the current schema.
const LegacyVersion = 9

func MigrateTo(ctx context.Context, databaseURL string, version int64) error {
	cfg, err := pgx.ParseConfig(databaseURL)
	if err != nil {
		return err
	}
	db := stdlib.OpenDB(*cfg)
	defer db.Close()
	p, err := goose.NewProvider(goose.DialectPostgres, db, os.DirFS("testdata/legacy"),
		goose.WithTableName(versionTable),
		goose.WithDisableGlobalRegistry(true),
		goose.WithLogger(goose.NopLogger()),
	)
	if err != nil {
		return err
	}
	if version > LegacyVersion {
		return fmt.Errorf("fence: MigrateTo %d: the legacy migrations end at version %d", version, LegacyVersion)
	}
	return withLegacyLock(ctx, db, func() error {
		current, err := p.GetDBVersion(ctx)
		if err != nil {
			return err
		}
		if version >= current {
			_, err = p.UpTo(ctx, version)
		} else {
			_, err = p.DownTo(ctx, version)
		}
		return err
	})
}

// withLegacyLock runs fn with the migration lock held and the fence schema created, as the
// releases up to version 9 ran goose.
func withLegacyLock(ctx context.Context, db *sql.DB, fn func() error) (err error) {
	conn, err := db.Conn(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	if _, err := conn.ExecContext(ctx, "SELECT pg_advisory_lock($1)", migrateLockID); err != nil {
		return err
	}
	defer func() {
		_, uerr := conn.ExecContext(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock($1)", migrateLockID)
		err = errors.Join(err, uerr)
	}()
	var exists bool
	if err := conn.QueryRowContext(ctx, "SELECT to_regnamespace($1) IS NOT NULL", Schema).Scan(&exists); err != nil {
		return err
	}
	if !exists {
		if _, err := conn.ExecContext(ctx, "CREATE SCHEMA "+Schema); err != nil {
			return err
		}
	}
	return fn()
}

// Plan is the list of files Migrate runs on a database at schema version from.
func Plan(from int64) ([]string, error) { return plan(from) }

// BindSQL and RaiseSQL are a bind's and a raise's call as one literal statement, for tests that
// bind or raise on a connection of their own with a plain Exec.
func (k Key) BindSQL(database, resource string, token int64, pid uint32) (string, error) {
	return k.literal("bind", database, resource, token, pid)
}

func (k Key) RaiseSQL(database, resource string, token int64, pid uint32) (string, error) {
	return k.literal("raise", database, resource, token, pid)
}

func (k Key) literal(kind, database, resource string, token int64, pid uint32) (string, error) {
	c, err := k.call(kind, database, resource, token, pid)
	if err != nil {
		return "", err
	}
	return "SELECT fence." + kind + "('" + c.Resource + "', " + strconv.FormatInt(c.Token, 10) + ", '" + c.Proof + "')", nil
}
