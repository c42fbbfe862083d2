package proxy_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/fenceproxy/fenceproxy/internal/faulthop"
	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// replicatedDB is fencedDB with a streaming standby "s1" made after the schema, the role and
// the table.
func replicatedDB(t *testing.T, opts ...testenv.PGOption) (*testenv.Postgres, *testenv.Standby) {
	t.Helper()
	pg, _ := fencedDB(t, opts...)
	return pg, testenv.StartStandby(t, pg, "s1")
}

func failoverProxy(t *testing.T, pg *testenv.Postgres, standbys ...string) *testenv.Proxy {
	t.Helper()
	return fencedProxy(t, pg, func(c *proxy.Config) {
		c.ControlDatabase = pg.AdminURL()
		c.FailoverStandbys = standbys
		c.StandbyFlushTimeout = time.Second
	})
}

// TestFailoverStandbyFlushedBeforeSessionStarts (issue 21, setup 1, async standby, bare
// tokens): a session whose bind raised to 34 starts only once the standby has flushed the
// raise, so that after the primary's crash and the standby's promotion 34 is still the stored
// token and a proxy in front of the new primary refuses 33 (ZF001): no stale commit.
func TestFailoverStandbyFlushedBeforeSessionStarts(t *testing.T) {
	pg, sb := replicatedDB(t)
	px := failoverProxy(t, pg, "s1")

	a := connect(t, px.FenceURL("app", "postgres", "billing", 33))
	mustExec(t, a, "INSERT INTO items (tag, token) VALUES ('a', 33)")
	b := connect(t, px.FenceURL("app", "postgres", "billing", 34))
	// The raise was flushed by s1 before b's ReadyForQuery; cut replication at once.
	sb.CutReplication()
	mustExec(t, b, "INSERT INTO items (tag, token) VALUES ('b', 34)")
	pg.Kill(t)
	sb.Promote(t)

	if got := storedToken(t, connect(t, sb.Postgres.AdminURL()), "billing"); got != 34 {
		t.Fatalf("after the failover the stored token is %d, want 34 (the raise acknowledged before it)", got)
	}
	after := testenv.StartProxy(t, sb.Postgres, proxy.Config{Resources: []string{"billing"}})
	wantStale(t, connectErr(after.FenceURL("app", "postgres", "billing", 33)))
	b2 := connect(t, after.FenceURL("app", "postgres", "billing", 34))
	mustExec(t, b2, "INSERT INTO items (tag, token) VALUES ('b', 34)")
	if n := count(t, b2, "SELECT count(*) FROM items WHERE token = 33 AND id > (SELECT min(id) FROM items WHERE token = 34)"); n != 0 {
		t.Fatalf("%d rows of token 33 committed after 34", n)
	}
}

// TestFailoverStandbyNotConfirmingFailsClosed: with the standby's replication cut, a session
// whose bind raises fails to start with ZF007 naming the standby, by name or by slot; with
// replication back, it starts.
func TestFailoverStandbyNotConfirmingFailsClosed(t *testing.T) {
	pg, sb := replicatedDB(t)
	for _, tc := range []struct {
		standbys []string
		named    string
	}{
		{[]string{"s1"}, "standby s1"},
		{[]string{"slot:*"}, "slot s1"},
	} {
		t.Run(strings.Join(tc.standbys, ","), func(t *testing.T) {
			px := failoverProxy(t, pg, tc.standbys...)
			tok := storedToken(t, connect(t, pg.AdminURL()), "billing") + 1
			connect(t, px.FenceURL("app", "postgres", "billing", tok)).Close(ctxT(t))

			sb.CutReplication()
			started := time.Now()
			err := connectErr(px.FenceURL("app", "postgres", "billing", tok+1))
			wantCode(t, err, fence.CodeUnavailable)
			if !strings.Contains(err.Error(), tc.named) || !strings.Contains(err.Error(), "not yet on the standbys") {
				t.Fatalf("the error does not name %q: %v", tc.named, err)
			}
			if d := time.Since(started); d < time.Second || d > 10*time.Second {
				t.Fatalf("refused after %v, want about --standby-flush-timeout (1 s)", d)
			}
			sb.HealReplication()
			sb.WaitFlushed(t, pg.CurrentLSN(t), 30*time.Second)
			connect(t, px.FenceURL("app", "postgres", "billing", tok+1)).Close(ctxT(t))
		})
	}
}

func TestFailoverStandbysConfig(t *testing.T) {
	_, err := proxy.New(proxy.Config{Upstream: "postgres://127.0.0.1:5432", FailoverStandbys: []string{"s1"}}, proxy.Options{})
	if err == nil || !strings.Contains(err.Error(), "control-database") {
		t.Fatalf("--failover-standbys without --control-database: %v", err)
	}
	_, err = proxy.New(proxy.Config{Upstream: "postgres://127.0.0.1:5432", ControlDatabase: "postgres://127.0.0.1/x", FailoverStandbys: []string{"slot:"}}, proxy.Options{})
	if err == nil || !strings.Contains(err.Error(), "slot:NAME") {
		t.Fatalf("slot: without a name: %v", err)
	}
	// A reload applies --failover-standbys (after a failover the operator drops the promoted
	// standby so), except on a proxy started without the control database the wait reads.
	srv, err := proxy.New(proxy.Config{Upstream: "postgres://127.0.0.1:5432", Resources: []string{"billing"}, Key: testenv.Key}, proxy.Options{})
	if err != nil {
		t.Fatal(err)
	}
	_, skipped, err := srv.Reload(proxy.Config{Upstream: "postgres://127.0.0.1:5432", Resources: []string{"billing"}, Key: testenv.Key,
		ControlDatabase: "postgres://127.0.0.1/x", FailoverStandbys: []string{"s1"}})
	if err != nil || !strings.Contains(strings.Join(skipped, "; "), "failover-standbys (needs a restart") {
		t.Fatalf("reload adding --failover-standbys without a control database at start: skipped %q, %v", skipped, err)
	}
}

// TestFailoverProxyFollowsNewPrimary (issue 21, setup 4): a proxy left running while its
// upstream address moves to the promoted standby (a virtual IP: a relay retargeted) forgets
// the token it saw on the lost timeline (35, never replicated), counts the change, and admits
// the new primary's legitimate leader (34) instead of locking it out; 33 stays refused.
func TestFailoverProxyFollowsNewPrimary(t *testing.T) {
	pg, sb := replicatedDB(t)
	vip := startVIP(t, pg)
	px := testenv.StartProxy(t, pg, proxy.Config{
		Upstream:        "postgres://" + vip.hop.Addr,
		Resources:       []string{"billing"},
		ControlDatabase: vip.url("postgres"),
	})

	connect(t, px.FenceURL("app", "postgres", "billing", 33)).Close(ctxT(t))
	sb.WaitFlushed(t, pg.CurrentLSN(t), 30*time.Second)
	sb.CutReplication()
	connect(t, px.FenceURL("app", "postgres", "billing", 35)).Close(ctxT(t)) // lost with the primary
	if h := px.Registry.Highest("postgres", "billing"); h != 35 {
		t.Fatalf("the proxy knows token %d, want 35", h)
	}

	vip.failover(t, sb)
	waitNewTimeline(t, px)
	// The control connection counts the change, then reads the new primary's tokens.
	eventually(t, 15*time.Second, "the proxy rebased on the new primary's tokens", func() error {
		if h := px.Registry.Highest("postgres", "billing"); h != 33 {
			return fmt.Errorf("after the failover the proxy knows token %d, want 33 (the new primary's)", h)
		}
		return nil
	})
	c := connect(t, px.FenceURL("app", "postgres", "billing", 34))
	mustExec(t, c, "INSERT INTO items (tag, token) VALUES ('c', 34)")
	wantStale(t, connectErr(px.FenceURL("app", "postgres", "billing", 33)))
}

// vip is a virtual IP in front of the primary: a relay that a failover retargets to the
// promoted standby, as a VIP or DNS switch does.
type vip struct{ hop *faulthop.Hop }

func startVIP(t *testing.T, pg *testenv.Postgres) *vip {
	t.Helper()
	hop, err := faulthop.Start("", fmt.Sprintf("%s:%d", pg.Host, pg.Port))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = hop.Close(context.Background()) })
	return &vip{hop: hop}
}

// url is the admin URL of database db through the VIP.
func (v *vip) url(db string) string {
	return fmt.Sprintf("postgres://%s:%s@%s/%s?sslmode=disable", testenv.AdminUser, testenv.AdminPassword, v.hop.Addr, db)
}

// failover kills the primary, promotes sb, and moves the VIP to it (cutting what it carried).
func (v *vip) failover(t *testing.T, sb *testenv.Standby) {
	t.Helper()
	sb.Primary.Kill(t)
	sb.Promote(t)
	v.hop.Retarget(fmt.Sprintf("%s:%d", sb.Host, sb.Port))
	v.hop.Cut()
}

// waitNewTimeline waits until px's control connection has seen the promoted standby's timeline
// (it counts it before it reads the new primary's tokens).
func waitNewTimeline(t *testing.T, px *testenv.Proxy) {
	t.Helper()
	eventually(t, 30*time.Second, "the proxy notices the new timeline", func() error {
		if testutil.ToFloat64(px.Metrics.UpstreamChanges.WithLabelValues("timeline")) < 1 {
			return fmt.Errorf("no timeline change seen (it knows token %d)", px.Registry.Highest("postgres", "billing"))
		}
		return nil
	})
}

// TestFailoverSyncStandbyRoleSyncCommitOff (issue 21, setup 3): with a synchronous standby
// (synchronous_standby_names) and ALTER ROLE app SET synchronous_commit = off, a raise must
// still wait for the standby: with replication cut, the session whose bind raises does not
// start, and after the failover the stale leader's token is refused or its raise is there.
// fence.commit_durably makes every raise commit with synchronous_commit = on.
func TestFailoverSyncStandbyRoleSyncCommitOff(t *testing.T) {
	pg, sb := replicatedDB(t) // testenv: synchronous_commit off by default; on for the raise only
	makeSynchronous(t, pg, "s1")
	pg.Exec(t, "ALTER ROLE app SET synchronous_commit = off")
	px := fencedProxy(t, pg, func(c *proxy.Config) { c.LoginTimeout = 2 * time.Second })

	connect(t, px.FenceURL("app", "postgres", "billing", 33)).Close(ctxT(t))
	sb.WaitFlushed(t, pg.CurrentLSN(t), 30*time.Second)
	sb.CutReplication()
	err := connectErr(px.FenceURL("app", "postgres", "billing", 34))
	if err == nil {
		pg.Kill(t)
		sb.Promote(t)
		t.Fatalf("the session raising to 34 started with its synchronous standby cut off; after the failover the stored token is %d", storedToken(t, connect(t, sb.Postgres.AdminURL()), "billing"))
	}
	pg.Kill(t)
	sb.Promote(t)
	if got := storedToken(t, connect(t, sb.Postgres.AdminURL()), "billing"); got != 33 {
		t.Fatalf("stored token %d after the failover, want 33", got)
	}
}

// TestFailoverLeaseAsyncStandbyIssuesNoGenerationTwice (issue 21, setup 2: asynchronous
// replication, the PostgreSQL lease, no --failover-standbys): b's acquisition of the next
// generation commits on the primary and never reaches the standby; b writes; the primary
// crashes and the standby is promoted. The lease row failed over without b's generation, yet
// the new primary must not issue that generation again (to c), and b, who still believes it
// holds it, must be refused there: before c's acquisition (not issued there, ZF002) and after
// it (stale, ZF001). The generations carry the timeline (schema 11, L11 of docs/proof.md): c's
// is above every generation of the lost timeline. The old holder a stays refused; c writes.
func TestFailoverLeaseAsyncStandbyIssuesNoGenerationTwice(t *testing.T) {
	pg, sb := replicatedDB(t)
	cfg := proxy.Config{LeaseResources: []string{"billing"}}
	px := testenv.StartProxy(t, pg, cfg)
	acquire := func(p *testenv.Postgres, holder string) int64 {
		t.Helper()
		conn := connect(t, p.AdminURL())
		defer conn.Close(ctxT(t))
		var g int64
		if err := conn.QueryRow(ctxT(t), "SELECT generation FROM fence.lease_acquire('billing', $1, '60 seconds') WHERE acquired", holder).Scan(&g); err != nil {
			t.Fatalf("acquire as %s: %v", holder, err)
		}
		return g
	}
	url := func(p *testenv.Proxy, g int64) string {
		return p.FenceURL("app", "postgres", "billing", g, "password=app")
	}

	// a leads and writes; it releases the lease (as fenceproxy lock does on exit); all of it
	// reaches the standby.
	ga := acquire(pg, "a")
	a := connect(t, url(px, ga))
	mustExec(t, a, "INSERT INTO items (tag, token) VALUES ('a', $1)", ga)
	mustExec(t, connect(t, pg.AdminURL()), "SELECT fence.lease_release('billing', 'a', $1)", ga)
	sb.WaitFlushed(t, pg.CurrentLSN(t), 30*time.Second)
	sb.CutReplication()

	// b's acquisition and write commit on the primary only.
	gb := acquire(pg, "b")
	b := connect(t, url(px, gb))
	mustExec(t, b, "INSERT INTO items (tag, token) VALUES ('b lost', $1)", gb)
	pg.Kill(t)
	sb.Promote(t)

	after := testenv.StartProxy(t, sb.Postgres, cfg)
	// b's generation was never issued on the new timeline.
	err := connectErr(url(after, gb))
	wantCode(t, err, fence.CodeNotIssued)

	gc := acquire(sb.Postgres, "c")
	if gc <= gb {
		t.Errorf("the new primary issued generation %d to c; b holds %d from the lost timeline: issued twice or below", gc, gb)
	}
	t.Logf("generations: a %d, b %d (lost timeline), c %d (new timeline)", ga, gb, gc)
	c := connect(t, url(after, gc))
	mustExec(t, c, "INSERT INTO items (tag, token) VALUES ('c', $1)", gc)

	// b and a, from the lost timeline, are refused next to c; c keeps writing.
	wantStale(t, connectErr(url(after, gb)))
	wantStale(t, connectErr(url(after, ga)))
	mustExec(t, c, "INSERT INTO items (tag, token) VALUES ('c', $1)", gc)

	check := connect(t, sb.AdminURL())
	if n := count(t, check, "SELECT count(*)::int FROM items WHERE token <> $1 AND id > (SELECT min(id) FROM items WHERE token = $1)", gc); n != 0 {
		t.Errorf("%d stale rows committed after c's first write", n)
	}
	if n := count(t, check, "SELECT count(*)::int FROM items WHERE token = $1", gb); n != 0 {
		t.Errorf("%d rows of b's generation %d on the new primary", n, gb)
	}
	var holder string
	var gen int64
	if err := check.QueryRow(ctxT(t), "SELECT holder, generation FROM fence.leases WHERE resource = 'billing'").Scan(&holder, &gen); err != nil {
		t.Fatal(err)
	}
	if holder != "c" || gen != gc {
		t.Errorf("the lease is held by %q with generation %d, want c with %d", holder, gen, gc)
	}
}
