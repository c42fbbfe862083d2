package testenv_test

import (
	"bytes"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestMigrate: Migrate installs the fence schema and stores Key, so that a session bound with
// Key is admitted and one bound with another key is not; running it again changes nothing.
func TestMigrate(t *testing.T) {
	pg := testenv.StartPostgres(t)
	testenv.Migrate(t, pg.AdminURL())
	testenv.Migrate(t, pg.AdminURL()) // idempotent

	if len(testenv.Key) < 16 {
		t.Fatalf("testenv.Key has %d bytes; fence.keys needs 16 or more", len(testenv.Key))
	}
	admin := connect(t, pg.AdminURL())
	var stored []byte
	if err := admin.QueryRow(t.Context(), "SELECT key FROM fence.keys").Scan(&stored); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(stored, testenv.Key) {
		t.Fatalf("fence.keys holds %q, want testenv.Key %q", stored, testenv.Key)
	}
	states, err := fence.MigrationStatus(t.Context(), pg.AdminURL())
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range states {
		if !s.Applied {
			t.Errorf("migration %s not applied", s.Name)
		}
	}

	bindWith := func(conn *pgx.Conn, key fence.Key) error {
		c, err := key.BindCall(conn.Config().Database, "testenv", 1, conn.PgConn().PID())
		if err != nil {
			return err
		}
		_, err = conn.Exec(t.Context(), fence.BindQuery, c.Resource, c.Token, c.Proof)
		return err
	}
	if err := bindWith(connect(t, pg.AdminURL()), testenv.Key); err != nil {
		t.Fatalf("bind with testenv.Key: %v", err)
	}
	err = bindWith(connect(t, pg.AdminURL()), fence.Key("some other key of 32 bytes......"))
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != fence.CodeProof {
		t.Fatalf("bind with another key: %v, want SQLSTATE %s", err, fence.CodeProof)
	}
}
