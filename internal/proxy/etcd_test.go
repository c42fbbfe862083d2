package proxy_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestEtcdGuard runs the proxy with an EtcdGuard against a real etcd and PostgreSQL: the
// current leader's token is admitted, others are refused with their SQLSTATE, a new leader's
// token is raised before it connects (ending the old leader's session), an unreachable etcd
// refuses new sessions (ZF007), and a restore that moves revisions back fails closed (ZF007).
func TestEtcdGuard(t *testing.T) {
	t.Parallel()
	pg, admin := fencedDB(t)
	etcd := testenv.StartEtcd(t)
	cli := etcd.Client(t)
	cfg := proxy.Config{
		Upstream:        fmt.Sprintf("postgres://%s:%d", pg.Host, pg.Port),
		Resources:       []string{"billing"},
		EtcdEndpoints:   []string{etcd.Endpoint},
		EtcdResources:   []string{"billing=locks/billing"},
		ControlDatabase: pg.AdminURL(),
		Key:             testenv.Key, // the guard's proactive raise needs the proof
	}
	reg := fence.NewRegistry()
	ctx, cancel := context.WithCancel(context.Background())
	g, err := proxy.NewEtcdGuard(ctx, cfg, proxy.EtcdGuardOptions{Registry: reg, Logger: zapNop()})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { g.Run(ctx); close(done) }() //nolint:errcheck
	t.Cleanup(func() { cancel(); <-done })
	px := testenv.StartProxy(t, pg, cfg, testenv.ProxyOptions{Admitter: g, Registry: reg})
	url := func(tok int64) string { return px.FenceURL("app", "postgres", "billing", tok) }
	store := func(holder string) *lease.EtcdStore {
		return &lease.EtcdStore{Client: cli, TTL: 5 * time.Second, Holder: holder}
	}
	campaign := func(holder string) lease.Lease {
		t.Helper()
		l, err := store(holder).Campaign(ctxT(t), "billing")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			rctx, rcancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer rcancel()
			_ = l.Release(rctx)
		})
		return l
	}
	stored := func() int64 {
		return int64(count(t, admin, "SELECT coalesce((SELECT token FROM fence.tokens WHERE resource = 'billing'), 0)::int"))
	}

	wantCode(t, connectErr(url(1)), fence.CodeNotHeld)
	a := campaign("a")
	eventually(t, "the first leader's token raised", func() error {
		if got := stored(); got != a.Token() {
			return fmt.Errorf("stored token %d, want %d", got, a.Token())
		}
		return nil
	})
	conn := connect(t, url(a.Token()))
	mustExec(t, conn, "INSERT INTO items (tag, token) VALUES ('a', $1)", a.Token())
	wantCode(t, connectErr(url(a.Token()+1)), fence.CodeNotIssued)

	// A new leader: its token is raised before it connects, which ends a's session.
	if err := a.Release(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	b := campaign("b")
	eventually(t, "the new leader's token raised", func() error {
		if got := stored(); got != b.Token() {
			return fmt.Errorf("stored token %d, want %d", got, b.Token())
		}
		return nil
	})
	_, err = conn.Exec(ctxT(t), "INSERT INTO items (tag, token) VALUES ('a late', $1)", a.Token())
	wantStale(t, err)
	wantStale(t, connectErr(url(a.Token())))
	bc := connect(t, url(b.Token()))
	mustExec(t, bc, "INSERT INTO items (tag, token) VALUES ('b', $1)", b.Token())
	bc.Close(ctxT(t))

	// etcd unreachable: no new session without its word.
	backup := etcd.Backup(t) // taken while b leads
	etcd.Stop(t)
	wantCode(t, connectErr(url(b.Token())), fence.CodeUnavailable)
	etcd.Start(t)
	if err := b.Release(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	c := campaign("c")
	eventually(t, "the third leader admitted", func() error { return connectErr(url(c.Token())) })
	if err := c.Release(ctxT(t)); err != nil {
		t.Fatal(err)
	}

	// A restore to the backup moves revisions back: the resource fails closed. Every token
	// is refused: the restored leader's (b's, lower than the highest admitted) early, as
	// stale; any other, even one admitted before, with ZF007.
	etcd.Restore(t, backup)
	eventually(t, "fail closed after the restore", func() error {
		err := connectErr(url(c.Token()))
		if sqlstate(err) != fence.CodeUnavailable {
			return fmt.Errorf("session with the last admitted token: %v, want ZF007", err)
		}
		return nil
	})
	wantStale(t, connectErr(url(b.Token())))
	if n := count(t, admin, "SELECT count(*)::int FROM items WHERE tag = 'a late'"); n != 0 {
		t.Errorf("%d late rows of the old leader, want 0", n)
	}
}
