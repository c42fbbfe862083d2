package proxy_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/fence"
)

// TestConsulResourceWithLeftoverLeaseRefusedUntilRemoved: a PostgreSQL lease row left by an
// earlier trial of the resource (`fenceproxy lock --store postgres`) makes the Consul lock's
// tokens fail with ZF004 saying the resource is led through the lease and how to move it,
// not ZF002 "not issued" with a lease hint, nor a LockIndex regression (a newcomer's report);
// once the schema's owner deleted the row, the holder is admitted (L12 of docs/proof.md).
func TestConsulResourceWithLeftoverLeaseRefusedUntilRemoved(t *testing.T) {
	s := startConsulProxy(t)
	s.pg.Exec(t, `SELECT fence.lease_acquire('billing', 'earlier-trial', '10 s');
		SELECT fence.lease_release('billing', 'earlier-trial', 1)`)
	_, tok := consulLock(t, s.client, "locks/billing")
	eventually(t, 15*time.Second, "the lock's token refused, naming the lease", func() error {
		err := connectErr(s.url(tok))
		var pe *pgconn.PgError
		if sqlstate(err) != fence.CodeMalformed || !strings.Contains(err.Error(), `resource "billing" is led through the PostgreSQL lease`) ||
			!errors.As(err, &pe) || !strings.Contains(pe.Hint, "DELETE FROM fence.leases WHERE resource = 'billing'") {
			return fmt.Errorf("got %v", err)
		}
		return nil
	})
	s.pg.Exec(t, "DELETE FROM fence.leases WHERE resource = 'billing'")
	eventually(t, 15*time.Second, "the lock's holder admitted once the row is gone", func() error { return connectErr(s.url(tok)) })
}
