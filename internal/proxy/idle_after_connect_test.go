package proxy_test

import (
	"testing"

	"github.com/jackc/pgx/v5"
)

// TestIdleAfterConnect: right after a session is admitted, through every admission path,
// the client is told the session is idle (ReadyForQuery 'I'). A slice aliasing the
// server reader's buffer, kept across the bind that reuses that buffer, once told a
// psycopg 3 client 'T' through a Consul resource, and it skipped its first BEGIN.
func TestIdleAfterConnect(t *testing.T) {
	s := sharedServers(t)
	for _, path := range admissionPaths {
		t.Run(path.name, func(t *testing.T) {
			t.Parallel()
			resource := "idle." + path.name
			p := startPathProxy(t, s, path, []string{resource}, nil)
			h, err := holder(ctxT(t), s, path, resource, resource, 1)
			if err != nil {
				t.Fatal(err)
			}
			defer h.release()
			conn := connectCfg(t, p.URL("app", "postgres"), func(c *pgx.ConnConfig) {
				if !path.unfenced {
					c.RuntimeParams["options"] = h.options(resource)
				}
			})
			if st := conn.PgConn().TxStatus(); st != 'I' {
				t.Errorf("transaction status %q right after connecting, want 'I'", st)
			}
		})
	}
}
