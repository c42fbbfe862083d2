package proxy_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestPreparedTransactionBlocksRaise: a transaction prepared by a session that goes stale
// outlives its backend. The raise refuses (ZF011, naming it) while it exists, and raises
// nothing; resolved, the raise goes through.
func TestPreparedTransactionBlocksRaise(t *testing.T) {
	t.Parallel()
	e := startStaleEnv(t, []string{"twophase"})
	ctx := ctxEnv(t)
	const res = "twophase"
	for _, resolve := range []string{"ROLLBACK PREPARED", "COMMIT PREPARED"} {
		t.Run(resolve, func(t *testing.T) {
			var tok int64
			e.admin.QueryRow(ctx, `SELECT coalesce(max(token), 0) + 1 FROM fence.tokens WHERE resource = $1`, res).Scan(&tok) //nolint:errcheck
			gid := fmt.Sprintf("v2-gid-%d", tok)
			stale := testenv.Connect(t, e.a.FenceURL("app", "postgres", res, tok))
			if _, err := stale.Exec(ctx, fmt.Sprintf("BEGIN; INSERT INTO public.v2_rows (resource, token, tag) VALUES ('%s', %d, 'prepared'); PREPARE TRANSACTION '%s'", res, tok, gid),
				pgx.QueryExecModeSimpleProtocol); err != nil {
				t.Fatal(err)
			}
			pid := stale.PgConn().PID()
			started, err := backendStart(ctx, e.admin, pid)
			if err != nil {
				t.Fatal(err)
			}
			err = e.raise(ctx, "postgres", res, tok+1)
			if sqlstate(err) != fence.CodeRaiseFailed || !strings.Contains(err.Error(), gid) {
				t.Fatalf("raise with %s prepared: %v, want ZF011 naming it", gid, err)
			}
			var stored int64
			e.admin.QueryRow(ctx, `SELECT token FROM fence.tokens WHERE resource = $1`, res).Scan(&stored) //nolint:errcheck
			if stored != tok {
				t.Fatalf("stored token %d after the refused raise, want %d", stored, tok)
			}
			alive, _ := backendAlive(ctx, e.admin, pid, started)
			t.Logf("refused: %v; stale backend alive after the refused raise: %t", err, alive)
			// The operator resolves it; the raise goes through.
			if _, err := e.admin.Exec(ctx, fmt.Sprintf("%s '%s'", resolve, gid)); err != nil {
				t.Fatal(err)
			}
			if err := e.raise(ctx, "postgres", res, tok+1); err != nil {
				t.Fatalf("raise after %s: %v", resolve, err)
			}
			if alive, _ := backendAlive(ctx, e.admin, pid, started); alive {
				t.Fatal("stale backend alive after the raise")
			}
			if _, err := stale.Exec(ctx, "SELECT 1"); err == nil {
				t.Fatal("the stale session still works after the raise")
			}
			total, after, err := staleRows(ctx, e.admin, fmt.Sprintf(`SELECT xmin FROM public.v2_rows WHERE resource = $1 AND token = %d`, tok), res)
			if err != nil {
				t.Fatal(err)
			}
			want := 0
			if resolve == "COMMIT PREPARED" {
				want = 1 // committed by the operator, before the raise
			}
			if total != want || after != 0 {
				t.Fatalf("stale rows %d (want %d), %d after the raise", total, want, after)
			}
			if err := connectErr(e.a.FenceURL("app", "postgres", res, tok)); sqlstate(err) != fence.CodeStale {
				t.Fatalf("reconnect with %d: %v, want ZF001", tok, err)
			}
		})
	}
}

// TestForgedRaiseNotificationIsNotBelieved (F1): any session may NOTIFY on
// fence_raise. A proxy with a listener must take the stored token, not the
// payload: a forged "billing 999999" from an unfenced session directly on the
// server neither ends the fenced session of the stored token 5 nor refuses a
// new one; a real raise to 6 is still learned and ends the session of 5 with
// ZF001 promptly.
func TestForgedRaiseNotificationIsNotBelieved(t *testing.T) {
	t.Parallel()
	pg, admin := fencedDB(t)
	a := fencedProxy(t, pg, func(c *proxy.Config) { c.ControlDatabase = pg.AdminURL() })
	b := fencedProxy(t, pg)
	ctx := ctxT(t)

	s5 := connect(t, a.FenceURL("app", "postgres", "billing", 5))
	if got := storedToken(t, admin, "billing"); got != 5 {
		t.Fatalf("stored token %d after the bind of 5, want 5", got)
	}
	// The forgeries, from the application's role straight on the server: a
	// raise, a reset, one of a resource that has no stored token, and garbage.
	forger := connect(t, pg.URL("app", "postgres"))
	for _, payload := range []string{"billing 999999", "billing 1 reset", "other 999999", "billing"} {
		mustExec(t, forger, `SELECT pg_notify('fence_raise', $1)`, payload)
	}
	// A real raise of another resource, notified after the forgeries: once the
	// listener has learned it, it has read every forgery (one channel, in
	// commit order).
	connect(t, b.FenceURL("app", "postgres", "other", 3))
	waitStale(t, a, "postgres", "other", 3)
	if _, err := s5.Exec(ctx, "INSERT INTO items(tag, token) VALUES ('f1-after-forgery', 5)"); err != nil {
		t.Fatalf("the fenced session of the stored token 5 was ended by a forged notification: SQLSTATE %q: %v", sqlstate(err), err)
	}
	if h := a.Registry.Highest("postgres", "billing"); h != 5 {
		t.Fatalf("after the forged notifications the proxy believes billing's highest token is %d, want the stored 5", h)
	}
	if h := a.Registry.Highest("postgres", "other"); h != 3 {
		t.Fatalf("the proxy believes other's highest token is %d, want the stored 3", h)
	}
	again := connect(t, a.FenceURL("app", "postgres", "billing", 5))
	if _, err := again.Exec(ctx, "SELECT 1"); err != nil {
		t.Fatalf("a new session of token 5: %v", err)
	}

	// A real raise is still learned.
	start := time.Now()
	connect(t, b.FenceURL("app", "postgres", "billing", 6))
	waitStale(t, a, "postgres", "billing", 6)
	_, err := s5.Exec(ctx, "SELECT 1")
	wantStale(t, err)
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("the session of 5 learned of the raise after %v", d)
	}
	if n := count(t, admin, "SELECT count(*) FROM items WHERE tag = 'f1-after-forgery'"); n != 1 {
		t.Fatalf("%d rows of the session of 5 written after the forgeries, want 1", n)
	}
}

// TestRefusedRaiseEndsNobody (F8): a raise that fails because the database
// holds a prepared transaction (ZF011) refuses before it ends anyone: the
// session of the stored token keeps working; once the prepared transaction
// is resolved, the raise goes through and ends it.
func TestRefusedRaiseEndsNobody(t *testing.T) {
	t.Parallel()
	pg, admin := fencedDB(t, testenv.WithConf("max_prepared_transactions", "2"))
	p := fencedProxy(t, pg)
	ctx := ctxT(t)
	s5 := connect(t, p.FenceURL("app", "postgres", "billing", 5))
	twopc := connect(t, pg.AdminURL())
	mustExec(t, twopc, "BEGIN")
	mustExec(t, twopc, "INSERT INTO items(tag) VALUES ('f8-prepared')")
	mustExec(t, twopc, "PREPARE TRANSACTION 'f8'")

	err := connectErr(p.FenceURL("app", "postgres", "billing", 6))
	if sqlstate(err) != fence.CodeRaiseFailed || !strings.Contains(err.Error(), "'f8'") {
		t.Fatalf("the raise to 6 with a prepared transaction: want ZF011 naming it, got %v", err)
	}
	if got := storedToken(t, admin, "billing"); got != 5 {
		t.Fatalf("stored token %d after the refused raise, want 5", got)
	}
	if _, err := s5.Exec(ctx, "INSERT INTO items(tag, token) VALUES ('f8-after-refusal', 5)"); err != nil {
		t.Fatalf("the session of 5 after the refused raise: SQLSTATE %q: %v", sqlstate(err), err)
	}

	mustExec(t, admin, "ROLLBACK PREPARED 'f8'")
	connect(t, p.FenceURL("app", "postgres", "billing", 6))
	if _, err := s5.Exec(ctx, "SELECT 1"); err == nil {
		t.Fatal("the session of 5 survived the raise to 6")
	}
	if n := count(t, admin, "SELECT count(*) FROM items WHERE tag = 'f8-after-refusal'"); n != 1 {
		t.Fatalf("%d rows of the session of 5, want 1", n)
	}
}
