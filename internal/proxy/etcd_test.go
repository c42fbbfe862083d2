package proxy_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/lease/etcd"
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
	px, _ := startEtcdGuarded(t, pg, cfg)
	// Each token's session names its leader's lease (fence.session), as fenceproxy lock
	// passes it; a token no leader holds has none.
	holders := map[int64]string{}
	url := func(tok int64) string {
		if h, ok := holders[tok]; ok {
			return px.FenceURL("app", "postgres", "billing", tok, "fence.session="+h)
		}
		return px.FenceURL("app", "postgres", "billing", tok)
	}
	campaign := func(holder string) lease.Lease {
		l := etcdCampaign(t, cli, holder)
		holders[l.Token()] = l.Holder()
		return l
	}
	stored := func() int64 {
		return int64(count(t, admin, "SELECT coalesce((SELECT token FROM fence.tokens WHERE resource = 'billing'), 0)::int"))
	}

	wantCode(t, connectErr(url(1)), fence.CodeNotHeld)
	a := campaign("a")
	eventually(t, 15*time.Second, "the first leader's token raised", func() error {
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
	eventually(t, 15*time.Second, "the new leader's token raised", func() error {
		if got := stored(); got != b.Token() {
			return fmt.Errorf("stored token %d, want %d", got, b.Token())
		}
		return nil
	})
	_, err := conn.Exec(ctxT(t), "INSERT INTO items (tag, token) VALUES ('a late', $1)", a.Token())
	wantStale(t, err)
	wantStale(t, connectErr(url(a.Token())))
	bc := connect(t, url(b.Token()))
	mustExec(t, bc, "INSERT INTO items (tag, token) VALUES ('b', $1)", b.Token())
	bc.Close(ctxT(t))
	// The status names the store and the leader's session lease.
	st := px.Server.Status(ctxT(t))
	if len(st.Resources) != 1 || st.Resources[0].Store != lease.StoreEtcd || st.Resources[0].Holder != "etcd lease "+b.Holder() {
		t.Errorf("status %+v, want store etcd and holder etcd lease %s", st.Resources, b.Holder())
	}

	// etcd unreachable: no new session without its word.
	backup := etcd.Backup(t) // taken while b leads
	etcd.Stop(t)
	wantCode(t, connectErr(url(b.Token())), fence.CodeUnavailable)
	etcd.Start(t)
	if err := b.Release(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	c := campaign("c")
	eventually(t, 15*time.Second, "the third leader admitted", func() error { return connectErr(url(c.Token())) })
	if err := c.Release(ctxT(t)); err != nil {
		t.Fatal(err)
	}

	// A restore to the backup moves revisions back: the resource fails closed. Every token
	// is refused with ZF007, a regression: the last one admitted, and the restored leader's
	// (b's, lower than the highest admitted), as ZooKeeper's are (issue 25: it was told
	// stale, ZF001, before etcd's guard was ZooKeeper's).
	etcd.Restore(t, backup)
	eventually(t, 15*time.Second, "fail closed after the restore", func() error {
		err := connectErr(url(c.Token()))
		if sqlstate(err) != fence.CodeUnavailable {
			return fmt.Errorf("session with the last admitted token: %v, want ZF007", err)
		}
		return nil
	})
	if err := connectErr(url(b.Token())); sqlstate(err) != fence.CodeUnavailable || !strings.Contains(err.Error(), "went backwards") {
		t.Errorf("session with the restored leader's token: %v, want ZF007 saying etcd's revisions went backwards", err)
	}
	if n := count(t, admin, "SELECT count(*)::int FROM items WHERE tag = 'a late'"); n != 0 {
		t.Errorf("%d late rows of the old leader, want 0", n)
	}
}

// TestEtcdGuardOneHolderPerToken: etcd loses its data (a restore to an early backup), and
// its revisions come up again until a new leader key gets the very revision an earlier
// leader was admitted with. A proxy that did not see the restore happen (here: one started
// after it; in a review, one frozen through it) must not admit the second holder of that
// number: the database's record of (token, session lease) refuses it with ZF007, keeps
// the regression for every proxy, and ends the first holder's sessions.
func TestEtcdGuardOneHolderPerToken(t *testing.T) {
	t.Parallel()
	pg, admin := fencedDB(t)
	etcd := testenv.StartEtcd(t)
	cli := etcd.Client(t)
	backup := etcd.Backup(t) // before any leader
	cfg := proxy.Config{
		Upstream:        fmt.Sprintf("postgres://%s:%d", pg.Host, pg.Port),
		Resources:       []string{"billing"},
		EtcdEndpoints:   []string{etcd.Endpoint},
		EtcdResources:   []string{"billing=locks/billing"},
		ControlDatabase: pg.AdminURL(),
		Key:             testenv.Key,
	}
	campaign := func(holder string) lease.Lease { return etcdCampaign(t, cli, holder) }

	px1, stop1 := startEtcdGuarded(t, pg, cfg)
	a := campaign("a")
	conn := connect(t, px1.FenceURL("app", "postgres", "billing", a.Token(), "fence.session="+a.Holder()))
	mustExec(t, conn, "INSERT INTO items (tag, token) VALUES ('a', $1)", a.Token())
	stop1() // px1's guard sees nothing of what follows

	// etcd back to the backup, then written until the next key's revision is a's token.
	etcd.Restore(t, backup)
	etcdClimb(t, cli, a.Token()-1)
	b := campaign("b")
	if b.Token() != a.Token() {
		t.Fatalf("the new leader's key has revision %d, want a's %d (the test could not make etcd repeat it)", b.Token(), a.Token())
	}

	px2, _ := startEtcdGuarded(t, pg, cfg)
	err := connectErr(px2.FenceURL("app", "postgres", "billing", b.Token(), "fence.session="+b.Holder()))
	wantCode(t, err, fence.CodeUnavailable)
	if !strings.Contains(err.Error(), "issued") && !strings.Contains(err.Error(), "etcd lease") {
		t.Errorf("refusal does not say the token has another holder: %v", err)
	}
	if n := count(t, admin, "SELECT count(*)::int FROM fence.consul_tokens WHERE resource = 'billing' AND regression IS NOT NULL"); n != 1 {
		t.Errorf("regression not recorded in the database (rows %d)", n)
	}
	// Its first holder is deposed too (migration 8's C5): neither holder of the number
	// issued twice writes on.
	if _, err := conn.Exec(ctxT(t), "INSERT INTO items (tag, token) VALUES ('a again', $1)", a.Token()); err == nil {
		t.Error("the first holder of the token etcd issued twice still writes")
	}
}

// TestEtcdGuardSameTokenUnrecorded: as TestEtcdGuardOneHolderPerToken, but the first holder
// never connected before etcd lost its data (frozen right after it won), so no database
// recorded it, and no proxy watched the restore. The new holder of the same revision is
// admitted; the first one, thawed, presents the same token and is refused because its
// session names another lease (ZF009), or none (ZF003). A review had both commit, the stale
// one last, in 6 runs of 6, when fence.session was not checked for etcd.
func TestEtcdGuardSameTokenUnrecorded(t *testing.T) {
	t.Parallel()
	pg, admin := fencedDB(t)
	etcd := testenv.StartEtcd(t)
	cli := etcd.Client(t)
	backup := etcd.Backup(t) // before any leader
	cfg := proxy.Config{
		Upstream:        fmt.Sprintf("postgres://%s:%d", pg.Host, pg.Port),
		Resources:       []string{"billing"},
		EtcdEndpoints:   []string{etcd.Endpoint},
		EtcdResources:   []string{"billing=locks/billing"},
		ControlDatabase: pg.AdminURL(),
		Key:             testenv.Key,
	}
	a := etcdCampaign(t, cli, "a") // wins, and freezes before it connects: nothing recorded
	etcd.Restore(t, backup)
	etcdClimb(t, cli, a.Token()-1)
	b := etcdCampaign(t, cli, "b")
	if b.Token() != a.Token() || b.Holder() == a.Holder() {
		t.Fatalf("the new leader has revision %d and lease %s, want a's revision %d under another lease than %s (the test could not make etcd repeat it)",
			b.Token(), b.Holder(), a.Token(), a.Holder())
	}
	px, _ := startEtcdGuarded(t, pg, cfg) // started after the restore: it saw nothing go back
	url := func(params ...string) string { return px.FenceURL("app", "postgres", "billing", b.Token(), params...) }
	bc := connect(t, url("fence.session="+b.Holder()))
	mustExec(t, bc, "INSERT INTO items (tag, token) VALUES ('b', $1)", b.Token())

	err := connectErr(url("fence.session=" + a.Holder()))
	wantCode(t, err, fence.CodeHolderMismatch)
	if !strings.Contains(err.Error(), "etcd lease "+b.Holder()) {
		t.Errorf("refusal does not name the holder's lease %s: %v", b.Holder(), err)
	}
	wantCode(t, connectErr(url()), fence.CodeMissing)
	err = connectErr(url("fence.session=garbage"))
	wantCode(t, err, fence.CodeHolderMismatch)
	if pe := pgErrorOf(err); pe == nil || !strings.Contains(pe.Hint, "ID in hex") {
		t.Errorf("a mismatched session's hint does not say the ID is hex: %v", err)
	}
	mustExec(t, bc, "INSERT INTO items (tag, token) VALUES ('b again', $1)", b.Token())
	if n := count(t, admin, "SELECT count(*)::int FROM items WHERE tag LIKE 'a%'"); n != 0 {
		t.Errorf("%d rows of the first holder, want 0", n)
	}
}

// etcdClimb writes an unrelated key until etcd's revision is at least rev: after a restore,
// the next key then gets rev+1, a revision issued before.
func etcdClimb(t *testing.T, cli *clientv3.Client, rev int64) {
	t.Helper()
	for {
		resp, err := cli.Get(ctxT(t), "unrelated")
		if err != nil {
			t.Fatal(err)
		}
		if resp.Header.Revision >= rev {
			return
		}
		if _, err := cli.Put(ctxT(t), "unrelated", "x"); err != nil {
			t.Fatal(err)
		}
	}
}

// etcdCampaign wins the election of resource billing as holder (TTL 5 s), released when
// the test ends.
func etcdCampaign(t *testing.T, cli *clientv3.Client, holder string) lease.Lease {
	t.Helper()
	l, err := (&etcd.Store{Client: cli, TTL: 5 * time.Second, Holder: holder}).Campaign(ctxT(t), "billing")
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

// startEtcdGuarded starts a proxy with an EtcdGuard for cfg; stop stops the guard (also at
// the test's end), leaving the proxy running without it.
func startEtcdGuarded(t *testing.T, pg *testenv.Postgres, cfg proxy.Config) (*testenv.Proxy, func()) {
	t.Helper()
	reg := fence.NewRegistry()
	ctx, cancel := context.WithCancel(context.Background())
	g, err := lockGuard(ctx, cfg, proxy.LockGuardOptions{Registry: reg, Logger: zapNop()})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { g.Run(ctx); close(done) }() //nolint:errcheck
	var once sync.Once
	stop := func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return testenv.StartProxy(t, pg, cfg, testenv.ProxyOptions{Admitter: g, Registry: reg}), stop
}
