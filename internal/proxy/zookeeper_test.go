package proxy_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap/zaptest"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/lease/zookeeper"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestZooKeeperGuard runs the proxy with a ZooKeeperGuard against a real ZooKeeper and
// PostgreSQL: the current lock holder's token (its node's czxid) is admitted, others are
// refused with their SQLSTATE, a new holder's token is raised before it connects (ending
// the old holder's session), an unreachable ZooKeeper refuses new sessions (ZF007), and a
// restore from an old backup or a wiped data folder, which move zxids back, fail closed
// (ZF007).
func TestZooKeeperGuard(t *testing.T) {
	t.Parallel()
	pg, admin := fencedDB(t)
	z := testenv.StartZooKeeper(t)
	cfg := proxy.Config{
		Upstream:        fmt.Sprintf("postgres://%s:%d", pg.Host, pg.Port),
		Resources:       []string{"billing", "ledger"},
		ZKServers:       []string{z.Addr},
		ZKResources:     []string{"billing=/locks/billing", "ledger"}, // ledger: /locks/ledger
		ControlDatabase: pg.AdminURL(),
		Key:             testenv.Key, // the guard's proactive raise needs the proof
	}
	reg := fence.NewRegistry()
	metrics := prometheus.NewRegistry()
	ctx, cancel := context.WithCancel(context.Background())
	g, err := lockGuard(ctx, cfg, proxy.LockGuardOptions{Registry: reg, Logger: zaptest.NewLogger(t), Registerer: metrics})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { g.Run(ctx); close(done) }() //nolint:errcheck
	t.Cleanup(func() { cancel(); <-done })
	px := testenv.StartProxy(t, pg, cfg, testenv.ProxyOptions{Admitter: g, Registry: reg})
	// Each token's session names its holder's ZooKeeper session (fence.session), as
	// fenceproxy lock passes it; a token no holder has has none.
	holders := map[int64]string{}
	url := func(res string, tok int64) string {
		if h, ok := holders[tok]; ok {
			return px.FenceURL("app", "postgres", res, tok, "fence.session="+h)
		}
		return px.FenceURL("app", "postgres", res, tok)
	}
	lock := func(holder, res string) lease.Lease {
		t.Helper()
		s := &zookeeper.Store{Servers: []string{z.Addr}, TTL: 5 * time.Second, Holder: holder}
		l, err := s.Campaign(ctxT(t), res)
		if err != nil {
			t.Fatal(err)
		}
		holders[l.Token()] = l.Holder()
		t.Cleanup(func() {
			rctx, rcancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer rcancel()
			_ = l.Release(rctx)
		})
		return l
	}
	stored := func(res string) int64 {
		return int64(count(t, admin, "SELECT coalesce((SELECT token FROM fence.tokens WHERE resource = $1), 0)::bigint::int", res))
	}
	raised := func(res string, l lease.Lease) {
		t.Helper()
		eventually(t, 15*time.Second, "the holder's token raised", func() error {
			if got := stored(res); got != l.Token() {
				return fmt.Errorf("stored token %d, want %d", got, l.Token())
			}
			return nil
		})
	}
	// failsClosed polls (a restarted server takes a while, and the guard opens a new
	// client session when the old one is refused) until tok is refused with ZF007 for a
	// regression, not because ZooKeeper cannot be read.
	failsClosed := func(res string, tok int64) {
		t.Helper()
		eventually(t, 90*time.Second, fmt.Sprintf("%s token %d fails closed", res, tok), func() error {
			err := connectErr(url(res, tok))
			if sqlstate(err) == fence.CodeUnavailable && strings.Contains(err.Error(), "went backwards") {
				return nil
			}
			return fmt.Errorf("%v, want ZF007 saying the zxids went backwards", err)
		})
	}

	wantCode(t, connectErr(url("billing", 1)), fence.CodeNotHeld)
	a := lock("a", "billing")
	raised("billing", a)
	conn := connect(t, url("billing", a.Token()))
	mustExec(t, conn, "INSERT INTO items (tag, token) VALUES ('a', $1)", a.Token())
	wantCode(t, connectErr(url("billing", a.Token()+1)), fence.CodeNotIssued)
	// The session must name the holder's ZooKeeper session: one that names another, or
	// none, is refused (a ZooKeeper that lost its data can issue the czxid again to another
	// holder while no proxy watches: TestEtcdGuardSameTokenUnrecorded for etcd).
	wantCode(t, connectErr(px.FenceURL("app", "postgres", "billing", a.Token())), fence.CodeMissing)
	err = connectErr(px.FenceURL("app", "postgres", "billing", a.Token(), "fence.session=1234abcd"))
	wantCode(t, err, fence.CodeHolderMismatch)
	if !strings.Contains(err.Error(), "ZooKeeper session "+a.Holder()) {
		t.Errorf("refusal does not name the holder's session %s: %v", a.Holder(), err)
	}
	connect(t, px.FenceURL("app", "postgres", "billing", a.Token(), "fence.session="+strings.ToUpper(a.Holder()))).Close(ctxT(t))

	// A new holder: its token is raised before it connects, which ends a's session.
	if err := a.Release(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	b := lock("b", "billing")
	raised("billing", b)
	_, err = conn.Exec(ctxT(t), "INSERT INTO items (tag, token) VALUES ('a late', $1)", a.Token())
	wantStale(t, err)
	wantStale(t, connectErr(url("billing", a.Token())))
	bc := connect(t, url("billing", b.Token()))
	mustExec(t, bc, "INSERT INTO items (tag, token) VALUES ('b', $1)", b.Token())
	bc.Close(ctxT(t))
	x := lock("x", "ledger")
	raised("ledger", x)

	// ZooKeeper unreachable: no new session without its word.
	z.Stop(t)
	wantCode(t, connectErr(url("billing", b.Token())), fence.CodeUnavailable)
	backup := z.Backup(t) // taken while b holds; starts the server again
	if err := b.Release(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	c := lock("c", "billing")
	eventually(t, 15*time.Second, "the third holder admitted", func() error { return connectErr(url("billing", c.Token())) })
	if err := c.Release(ctxT(t)); err != nil {
		t.Fatal(err)
	}

	// A restore to the backup moves zxids back: the resource fails closed. Every token is
	// refused with ZF007: the last one admitted, and the restored holder's (b's).
	z.Restore(t, backup)
	failsClosed("billing", c.Token())
	failsClosed("billing", b.Token())
	if n := count(t, admin, "SELECT count(*)::int FROM items WHERE tag = 'a late'"); n != 0 {
		t.Errorf("%d late rows of the old holder, want 0", n)
	}
	if got := gathered(t, metrics, "fenceproxy_zookeeper_regressions_total", "billing"); got != 1 {
		t.Errorf("billing regressions counted: %v, want 1", got)
	}

	// A wiped data folder starts zxids over: the next ledger holder's token is far below
	// the stored one, and ledger fails closed too.
	z.Wipe(t)
	y := lock("y", "ledger")
	if y.Token() >= x.Token() {
		t.Fatalf("token after the wipe %d, before %d: want lower", y.Token(), x.Token())
	}
	failsClosed("ledger", y.Token())
	if got := stored("ledger"); got != x.Token() {
		t.Errorf("ledger's stored token %d after the wipe, want %d (never lowered)", got, x.Token())
	}
}

// gathered is the value of reg's metric name for resource (labelled store="zookeeper"), 0
// when it has none.
func gathered(t *testing.T, reg *prometheus.Registry, name, resource string) float64 {
	t.Helper()
	v, _ := metricValue(t, reg, name, map[string]string{"resource": resource, "store": lease.StoreZooKeeper})
	return v
}

// TestZooKeeperGuardConfig: a misconfigured --zk-resource fails the start with the cause.
func TestZooKeeperGuardConfig(t *testing.T) {
	t.Parallel()
	base := proxy.Config{
		Upstream:  "postgres://127.0.0.1:5432",
		Resources: []string{"billing", "orders=locks/orders"},
		ZKServers: []string{"127.0.0.1:2181"},
		Key:       testenv.Key,
	}
	for _, tc := range []struct {
		servers   []string
		resources []string
		want      string
	}{
		{nil, []string{"billing"}, "zk-resource needs zk-servers"},
		{base.ZKServers, []string{"ledger"}, "ledger is not a --resource"},
		{base.ZKServers, []string{"orders"}, `resource "orders" is declared with a Consul key (locks/orders) and --zk-resource`},
		{base.ZKServers, []string{"billing=locks/billing"}, "absolute lock folder"},
	} {
		cfg := base
		cfg.ZKServers, cfg.ZKResources = tc.servers, tc.resources
		g, err := lockGuard(context.Background(), cfg, proxy.LockGuardOptions{Registry: fence.NewRegistry()})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("servers %v, resources %v: %v, %v; want an error saying %q", tc.servers, tc.resources, g, err, tc.want)
		}
	}
}
