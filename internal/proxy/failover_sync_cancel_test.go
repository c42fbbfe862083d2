package proxy_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
)

// With a synchronous standby, a raise whose wait for the standby is cancelled is committed on
// the primary only (PostgreSQL answers the cancel with a WARNING and the commit). No session
// may start on it before the standby has it (D3 of docs/proof.md): neither the session whose
// login timeout cancelled the raise, nor a retry of the same token (whose bind raises nothing:
// it started at once, and after a failover to the standby the stale token's write committed:
// a review's F1), nor a session whose bind's wait an administrator cancelled (its WARNING:
// ZF007). Once the standby streams again, the token is admitted.
func TestFailoverSyncStandbyCancelledWaitAdmitsNobody(t *testing.T) {
	pg, sb := replicatedDB(t)
	makeSynchronous(t, pg, "s1")
	px := fencedProxy(t, pg, func(c *proxy.Config) { c.LoginTimeout = 2 * time.Second })

	connect(t, px.FenceURL("app", "postgres", "billing", 1)).Close(ctxT(t))
	sb.WaitFlushed(t, pg.CurrentLSN(t), 30*time.Second)
	sb.CutReplication()

	err := connectErr(px.FenceURL("app", "postgres", "billing", 2))
	if err == nil {
		t.Fatal("the session raising to 2 started with its synchronous standby cut off")
	}
	// The refusal points at the bind's wait, and says the raise may be committed (a review:
	// "did not complete startup" sent the operator to the network).
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || !strings.Contains(pe.Message, "the bind of the session to its fencing token did not finish") ||
		!strings.Contains(pe.Detail, "synchronous standbys") || !strings.Contains(pe.Hint, "may be committed") {
		t.Fatalf("the login timeout's refusal: %#v", err)
	}
	// The backend ends its commit after the cancel, and the proxy answers the client without
	// waiting for it (under load the read came first: 'stores 1').
	admin0 := connect(t, pg.AdminURL())
	eventually(t, 10*time.Second, "the primary stores 2 (the raise whose wait the login timeout cancelled)", func() error {
		if got := storedToken(t, admin0, "billing"); got != 2 {
			return fmt.Errorf("the primary stores %d", got)
		}
		return nil
	})
	if err := connectErr(px.FenceURL("app", "postgres", "billing", 2)); err == nil {
		t.Fatal("a retry of token 2 started before the synchronous standby had its raise")
	}

	// An administrator cancels the bind's wait: the commit returns with a WARNING, and the
	// session is refused; also for a client that asked for no warnings (client_min_messages =
	// error in its startup options, as an ORM may: PostgreSQL then sent none, and the proxy
	// admitted it; a second review's G1): the bind's commit raises it to warning.
	slow := fencedProxy(t, pg, func(c *proxy.Config) { c.LoginTimeout = time.Minute })
	admin := connect(t, pg.AdminURL())
	for _, c := range []struct {
		tok    int64
		params []string
		end    string // what ends the wait
	}{{3, nil, "pg_cancel_backend"}, {4, []string{"client_min_messages=error"}, "pg_cancel_backend"}, {5, nil, "pg_terminate_backend"}} {
		tok, params := c.tok, c.params
		errc := make(chan error, 1)
		// The client waits as long as the proxy's login timeout: under load the bind reaches
		// its SyncRep wait late, and a 20 s client gave up before the cancel's answer.
		go func() {
			errc <- connectErrWithin(time.Minute, slow.FenceURL("app", "postgres", "billing", tok, params...))
		}()
		eventually(t, 30*time.Second, "the bind waits for the synchronous standby", func() error {
			var n int
			if err := admin.QueryRow(ctxT(t), "SELECT count(*) FILTER (WHERE "+c.end+"(pid)) FROM pg_stat_activity WHERE wait_event = 'SyncRep' AND usename = 'app'").Scan(&n); err != nil {
				return err
			}
			if n == 0 {
				return errors.New("no backend of app waits for SyncRep")
			}
			return nil
		})
		select {
		case err := <-errc:
			if err == nil {
				t.Fatalf("token %d (startup %v) admitted, its bind's wait for the synchronous standby cancelled", tok, params)
			}
			if c.end == "pg_terminate_backend" {
				// The backend ended during the COMMIT's wait: the raise is committed on the
				// primary, and the hint says it may be (it said "nothing was bound").
				var pe *pgconn.PgError
				if !errors.As(err, &pe) || !strings.Contains(pe.Hint, "its COMMIT had begun: a raise of its token may be committed") {
					t.Fatalf("token %d, backend terminated in its COMMIT's wait: %#v", tok, err)
				}
				break
			}
			wantCode(t, err, fence.CodeUnavailable)
		case <-time.After(time.Minute):
			t.Fatalf("the session of token %d whose bind's wait was cancelled did not end", tok)
		}
	}

	sb.HealReplication()
	eventually(t, 30*time.Second, "token 5 admitted once the standby streams again", writes(px, 5))
}
