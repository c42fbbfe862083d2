package proxy_test

import (
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
)

// TestAdmissionAfterControlConnectionsEnded: on every path whose admission or raise goes
// through the control database (a guard's fence.consul_admit, its proactive raise), a session
// that starts after the server ended the proxy's idle control connections (pg_terminate_backend
// by an administrator or by a client's own SQL, idle_session_timeout) is admitted on a new
// control connection; it was refused with ZF007 ("could not be updated: FATAL: terminating
// connection due to administrator command") when the guard used the dead pooled connection:
// node-postgres's connection-pool/error-tests.js, which ends backends, failed so through the
// Consul path.
func TestAdmissionAfterControlConnectionsEnded(t *testing.T) {
	s := sharedServers(t)
	for _, path := range admissionPaths {
		if !path.guarded() {
			continue
		}
		t.Run(path.name, func(t *testing.T) {
			t.Parallel()
			resource := "ended." + path.name
			// A role of its own for the control connections (the guards name their
			// application themselves), so that only this proxy's are ended.
			role := "ended_control_" + strings.ReplaceAll(path.name, "-", "_")
			ctx := ctxT(t)
			if _, err := s.admin.Exec(ctx, "CREATE ROLE "+role+" LOGIN SUPERUSER PASSWORD 'ended'"); err != nil && !strings.Contains(err.Error(), "42710") {
				t.Fatal(err)
			}
			p := startPathProxy(t, s, path, []string{resource}, func(cfg *proxy.Config) {
				cfg.ControlDatabase = s.pg.URLWithPassword(role, "ended", "postgres")
			})
			h, err := holder(ctx, s, path, resource, resource, 1)
			if err != nil {
				t.Fatal(err)
			}
			defer h.release()
			connect := func() error {
				conn, err := pgx.ConnectConfig(ctx, mustConfig(t, p.URL("app", "postgres"), h.options(resource)))
				if err != nil {
					return err
				}
				defer conn.Close(ctx)
				_, err = conn.Exec(ctx, "SELECT 1")
				return err
			}
			if err := connect(); err != nil {
				t.Fatalf("first session: %v", err)
			}
			var ended int
			if err := s.admin.QueryRow(ctx, "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity WHERE usename = $1", role).Scan(&ended); err != nil {
				t.Fatal(err)
			}
			if ended == 0 {
				t.Fatal("no control connection of the proxy to end")
			}
			for i := range 3 {
				if err := connect(); err != nil {
					t.Fatalf("session %d after the server ended %d control connections: %v", i+1, ended, err)
				}
			}
		})
	}
}

// mustConfig is url's connection config with options as its startup option.
func mustConfig(t *testing.T, url, options string) *pgx.ConnConfig {
	t.Helper()
	c, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	c.RuntimeParams["options"] = options
	return c
}
