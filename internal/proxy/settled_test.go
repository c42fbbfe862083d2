package proxy_test

import (
	"context"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// TestServerEndExplainedByAsking: with --control-database a proxy that hears of
// no raise (no listener here, and the raise goes through another proxy) still
// tells a session that a raise ended ZF001, by asking the database
// (fence.settled), and relays a backend ended for another reason promptly as
// the server's 57P01. The registry wait that would otherwise decide is set to
// a minute, so an answer within the 10 s of each step can only come from the
// database.
func TestServerEndExplainedByAsking(t *testing.T) {
	t.Parallel()
	pg, admin := fencedDB(t)
	a := fencedProxy(t, pg, func(c *proxy.Config) {
		c.ControlDatabase = pg.URLWithPassword(testenv.AdminUser, testenv.AdminPassword, "postgres", "application_name=control")
		c.StaleWait = time.Minute
	})
	b := fencedProxy(t, pg)

	step := func(name string, token, raiseTo int64, busy bool, end func(pid uint32)) string {
		t.Helper()
		s := connect(t, a.FenceURL("app", "postgres", "billing", token))
		pid := s.PgConn().PID()
		errc := make(chan error, 1)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if busy {
			go func() { _, err := s.Exec(ctx, "SELECT pg_sleep(30)"); errc <- err }()
			waitActive(t, admin, pid, "pg_sleep")
		}
		if raiseTo > 0 {
			connect(t, b.FenceURL("app", "postgres", "billing", raiseTo))
		} else {
			end(pid)
		}
		if !busy {
			// The backend is gone; the proxy's answer reaches the next query.
			backendGone(t, admin, pid, 10*time.Second)
			_, err := s.Exec(ctx, "SELECT 1")
			errc <- err
		}
		err := <-errc
		if err == nil {
			t.Fatalf("%s: the session's query succeeded after its backend ended", name)
		}
		if ctx.Err() != nil {
			t.Fatalf("%s: no answer within 10 s: the proxy did not ask the database (%v)", name, err)
		}
		return sqlstate(err)
	}

	if code := step("idle session, raise through another proxy", 5, 6, false, nil); code != "ZF001" {
		t.Fatalf("idle session ended by a raise: SQLSTATE %q, want ZF001", code)
	}
	if code := step("busy session, raise through another proxy", 6, 7, true, nil); code != "ZF001" {
		t.Fatalf("busy session ended by a raise: SQLSTATE %q, want ZF001", code)
	}
	terminate := func(pid uint32) { mustExec(t, admin, "SELECT pg_terminate_backend($1)", int32(pid)) }
	if code := step("busy session, administrator's terminate", 7, 0, true, terminate); code != wire.CodeAdminShutdown {
		t.Fatalf("busy session ended by pg_terminate_backend: SQLSTATE %q, want the server's %s", code, wire.CodeAdminShutdown)
	}
	if got := a.Registry.Highest("postgres", "billing"); got != 7 {
		t.Fatalf("proxy a's registry says %d after asking, want 7", got)
	}
	// The control connections (the pool's, idle now, and the listener's) are
	// ended by an administrator; the pool hears of it only when it next uses
	// one. The next raise must still be explained: an error that says the
	// server is going away on a pooled connection is asked again on another.
	endControl := func(pid uint32) {
		connect(t, b.FenceURL("app", "postgres", "billing", 8))
	}
	mustExec(t, admin, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'control'")
	if code := step("busy session, raise after the control connections were ended", 7, 0, true, endControl); code != "ZF001" {
		t.Fatalf("busy session ended by a raise after the control connections were ended: SQLSTATE %q, want ZF001", code)
	}
}
