package proxy_test

import (
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"

	"github.com/fenceproxy/fenceproxy/internal/fence"
)

// TestLeaseTokens: a resource led through the PostgreSQL lease (fence.leases) is admitted by
// the proxy with no other service: fence.bind checks each token against the lease row. Only
// the current generation of a held lease binds; a made-up higher token is refused (ZF002)
// without raising anything, so it cannot lock the real leader out; a lease that expired or
// was released admits no new session (ZF006); a takeover ends the old holder's sessions.
func TestLeaseTokens(t *testing.T) {
	t.Parallel()
	pg, admin := fencedDB(t)
	px := fencedProxy(t, pg)
	url := func(token int64) string { return px.FenceURL("app", "postgres", "billing", token, "password=app") }
	acquire := func(holder string) int64 {
		t.Helper()
		var g int64
		if err := admin.QueryRow(ctxT(t), "SELECT generation FROM fence.lease_acquire('billing', $1, '10 seconds') WHERE acquired", holder).Scan(&g); err != nil {
			t.Fatalf("acquire as %s: %v", holder, err)
		}
		return g
	}
	stored := func() int {
		return count(t, admin, "SELECT token::int FROM fence.tokens WHERE resource = 'billing'")
	}

	g := acquire("leader")
	leader := connect(t, url(g))
	mustExec(t, leader, "INSERT INTO items (tag, token) VALUES ('leader', $1)", g)

	for _, forged := range []int64{g + 1, 1_000_000} {
		err := connectErr(url(forged))
		wantCode(t, err, fence.CodeNotIssued)
		if !strings.Contains(err.Error(), "fencing token not issued") {
			t.Errorf("token %d: %v", forged, err)
		}
	}
	if got := stored(); got != int(g) {
		t.Fatalf("stored token %d after the made-up tokens, want %d", got, g)
	}
	var m dto.Metric
	if err := px.Metrics.Rejections.WithLabelValues(fence.CodeNotIssued).Write(&m); err != nil || m.GetCounter().GetValue() != 2 {
		t.Errorf("fenceproxy_rejections_total{sqlstate=ZF002} = %v (%v), want 2", m.GetCounter().GetValue(), err)
	}
	mustExec(t, leader, "INSERT INTO items (tag, token) VALUES ('leader', $1)", g) // still leads

	// The lease is released (or expires): no new session with its generation.
	mustExec(t, admin, "SELECT fence.lease_release('billing', 'leader', $1)", g)
	wantCode(t, connectErr(url(g)), fence.CodeNotHeld)

	// A takeover ends the old holder's session before it commits; the new holder writes.
	g2 := acquire("successor")
	if g2 != g+1 {
		t.Fatalf("takeover generation %d, want %d", g2, g+1)
	}
	_, err := leader.Exec(ctxT(t), "INSERT INTO items (tag, token) VALUES ('stale', $1)", g)
	if err == nil {
		t.Fatal("the old holder's write succeeded after the takeover")
	}
	wantCode(t, connectErr(url(g)), fence.CodeStale)
	successor := connect(t, url(g2))
	mustExec(t, successor, "INSERT INTO items (tag, token) VALUES ('successor', $1)", g2)
	if n := count(t, admin, "SELECT count(*) FROM items WHERE tag = 'stale'"); n != 0 {
		t.Errorf("%d stale rows committed", n)
	}
}
