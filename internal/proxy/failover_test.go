package proxy_test

import (
	"context"
	"fmt"
	"strings"
	"syscall"
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
	// trust-database admits on the database's word, which a failover the proxy does not see
	// (no listener) makes a lost timeline's (a review's F3 committed a stale write).
	_, err = proxy.New(proxy.Config{Upstream: "postgres://127.0.0.1:5432", Resources: []string{"billing=locks/billing"}, ConsulDownMode: proxy.ConsulDownTrustDatabase}, proxy.Options{})
	if err == nil || !strings.Contains(err.Error(), "consul-down trust-database needs --control-database") {
		t.Fatalf("--consul-down trust-database without --control-database: %v", err)
	}
	_, err = proxy.New(proxy.Config{Upstream: "postgres://127.0.0.1:5432", ControlDatabase: "postgres://127.0.0.1/x", FailoverStandbys: []string{"slot:"}}, proxy.Options{})
	if err == nil || !strings.Contains(err.Error(), "slot:NAME") {
		t.Fatalf("slot: without a name: %v", err)
	}
	// A reload applies --failover-standbys (TestFailoverMatrix's async-wait cases), except on
	// a proxy started without the control database the wait reads.
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
func waitNewTimeline(t *testing.T, px *testenv.Proxy, resource string) {
	t.Helper()
	eventually(t, 30*time.Second, "the proxy notices the new timeline", func() error {
		if testutil.ToFloat64(px.Metrics.UpstreamChanges.WithLabelValues("timeline")) < 1 {
			return fmt.Errorf("no timeline change seen (it knows token %d)", px.Registry.Highest("postgres", resource))
		}
		return nil
	})
}

// TestFailoverStandbyWaitIgnoresTheClientsSearchPath: the bind's statements and the WAL
// position the standby wait needs run on the client's own backend, under its search_path. A
// client that put a schema of its own ahead of pg_catalog, with a pg_current_wal_flush_lsn()
// answering 0/0, was admitted while the named standby had not flushed its raise, and after a
// failover to that standby the stale token wrote (a review's F4). The names are
// schema-qualified and the bind's transaction pins its search_path.
func TestFailoverStandbyWaitIgnoresTheClientsSearchPath(t *testing.T) {
	pg, _ := replicatedDB(t)
	pg.Exec(t, `CREATE SCHEMA appx AUTHORIZATION app;
		CREATE FUNCTION appx.pg_current_wal_flush_lsn() RETURNS pg_lsn LANGUAGE sql AS $$SELECT '0/0'::pg_lsn$$;
		ALTER FUNCTION appx.pg_current_wal_flush_lsn() OWNER TO app`)
	px := failoverProxy(t, pg, "s1")
	connect(t, px.FenceURL("app", "postgres", "billing", 1)).Close(ctxT(t))
	// The standby stays in pg_stat_replication, its flush position stopped (its walsender
	// frozen): only a position below the raise's tells that it lacks the raise.
	var walsender int
	if err := connect(t, pg.AdminURL()).QueryRow(ctxT(t), "SELECT pid FROM pg_stat_replication WHERE application_name = 's1'").Scan(&walsender); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(walsender, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Kill(walsender, syscall.SIGCONT) }) //nolint:errcheck
	err := connectErr(px.FenceURL("app", "postgres", "billing", 2, "search_path=appx,pg_catalog"))
	wantCode(t, err, fence.CodeUnavailable)
	if !strings.Contains(err.Error(), "standby s1") {
		t.Fatalf("the refusal does not name the standby: %v", err)
	}
}
