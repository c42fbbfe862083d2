package proxy_test

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestFailoverStandbyOfThePrimarysOwnNameIsWaitedFor: a name of --failover-standbys that is
// also the primary's own (here its cluster_name, as Debian's default gives every host; or a
// symmetric primary_conninfo) is waited for like any other. Skipping it while no standby
// streamed under it (so that a proxy left running across a failover to that standby would
// not refuse every session: a review's F2) admitted a raise the cut-off standby of that
// name never had, and after a failover to it the stale write committed (a second review's
// G2). So the wait fails closed and says the name is the primary's own; after a failover to
// that standby the operator takes the name out and reloads, and the leader is admitted.
func TestFailoverStandbyOfThePrimarysOwnNameIsWaitedFor(t *testing.T) {
	pg, sb := replicatedDB(t, testenv.WithConf("cluster_name", "s1"))
	px := failoverProxy(t, pg, "s1")
	connect(t, px.FenceURL("app", "postgres", "billing", 1)).Close(ctxT(t))

	sb.CutReplication()
	err := connectErr(px.FenceURL("app", "postgres", "billing", 2))
	wantCode(t, err, fence.CodeUnavailable)
	if !strings.Contains(err.Error(), "standby s1 (not streaming from this primary; it is also this primary's own name") {
		t.Fatalf("the refusal does not say s1 is also the primary's own name: %v", err)
	}

	// A failover to s1 (it stores token 1), behind a proxy that still names it.
	pg.Kill(t)
	sb.Promote(t)
	cfg := proxy.Config{Resources: []string{"billing"}, ControlDatabase: sb.Postgres.AdminURL(),
		FailoverStandbys: []string{"s1"}, StandbyFlushTimeout: time.Second}
	after := testenv.StartProxy(t, sb.Postgres, cfg)
	wantCode(t, connectErr(after.FenceURL("app", "postgres", "billing", 2)), fence.CodeUnavailable)
	cfg.Listen = net.JoinHostPort(after.Host, strconv.Itoa(after.Port))
	cfg.Upstream = "postgres://" + net.JoinHostPort(sb.Host, strconv.Itoa(sb.Port))
	cfg.FailoverStandbys = nil
	if applied, skipped, err := after.Server.Reload(cfg); err != nil || len(skipped) > 0 || !strings.Contains(strings.Join(applied, "; "), "failover-standbys") {
		t.Fatalf("reload without s1: applied %q, skipped %q, %v", applied, skipped, err)
	}
	eventually(t, 30*time.Second, "the leader admitted once s1 is out of the list", writes(after, 2))
}

// writes is a session of token tok for billing through px that inserts a row: nil once
// admitted and written, for eventually.
func writes(px *testenv.Proxy, tok int64) func() error {
	return func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		c, err := pgx.Connect(ctx, px.FenceURL("app", "postgres", "billing", tok))
		if err != nil {
			return err
		}
		defer c.Close(ctx)
		_, err = c.Exec(ctx, "INSERT INTO items (tag, token) VALUES ('written', $1)", tok)
		return err
	}
}

// TestFailoverStandbyTwinsUnderOneNameFailClosed: a name of --failover-standbys stands for one
// standby. While a second connection streams under it (pg_basebackup -R names every standby
// walreceiver), every wait fails closed, saying so: one twin must not confirm for the other,
// and a twin that is cut off leaves pg_stat_replication, where nothing could count it (a
// review's F4; a second review's G4 committed a stale write after a failover to it). Here the
// twin is pg_receivewal under the standby's name; once it stops, sessions start again.
func TestFailoverStandbyTwinsUnderOneNameFailClosed(t *testing.T) {
	pg, _ := replicatedDB(t)
	px := failoverProxy(t, pg, "s1")
	connect(t, px.FenceURL("app", "postgres", "billing", 1)).Close(ctxT(t))

	twin := exec.Command(pg.Bin("pg_receivewal"), "--no-loop", "--no-sync", "-D", t.TempDir(), "-d",
		fmt.Sprintf("host=%s port=%d user=%s password=%s application_name=s1", pg.Host, pg.Port, testenv.AdminUser, testenv.AdminPassword))
	if err := twin.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = twin.Process.Kill(); _ = twin.Wait() }()
	admin := connect(t, pg.AdminURL())
	eventually(t, 30*time.Second, "two connections stream as s1", func() error {
		if n := count(t, admin, "SELECT count(*)::int FROM pg_stat_replication WHERE application_name = 's1'"); n != 2 {
			return fmt.Errorf("%d stream as s1", n)
		}
		return nil
	})
	err := connectErr(px.FenceURL("app", "postgres", "billing", 2))
	wantCode(t, err, fence.CodeUnavailable)
	if !strings.Contains(err.Error(), "standby s1 (2 connections stream under this name") {
		t.Fatalf("the refusal does not say two connections stream as s1: %v", err)
	}

	_ = twin.Process.Kill()
	_ = twin.Wait()
	eventually(t, 30*time.Second, "token 2 admitted once the twin is gone", writes(px, 2))
}

// TestFailoverCascadingStandbyFailsClosedAndNotReady: a standby that streams from another
// standby (cascading) is not in the primary's pg_stat_replication, so nothing on the primary
// can tell what it flushed. Named in --failover-standbys it fails every fenced start closed;
// the refusal and /readyz say it does not stream from this primary and that a cascading
// standby cannot be waited for (a third review's H1: the refusal said "not streaming" while
// the standby streamed, and /readyz said ready). Naming its upstream instead admits.
func TestFailoverCascadingStandbyFailsClosedAndNotReady(t *testing.T) {
	// A base backup from a standby needs full_page_writes (testenv turns it off for speed).
	pg, sb := replicatedDB(t, testenv.WithConf("full_page_writes", "on"))
	testenv.StartStandby(t, sb.Postgres, "s2", testenv.WithConf("full_page_writes", "on"))
	px := failoverProxy(t, pg, "s2")
	err := connectErr(px.FenceURL("app", "postgres", "billing", 1))
	wantCode(t, err, fence.CodeUnavailable)
	if !strings.Contains(err.Error(), "standby s2 (not streaming from this primary: down, cut off, or cascading from another standby") {
		t.Fatalf("the refusal does not say s2 does not stream from this primary: %v", err)
	}
	// It names what streams (a review's S1 for s1 read "not streaming" and nothing more).
	if !strings.Contains(err.Error(), "names are case-sensitive, and streaming now: s1)") {
		t.Fatalf("the refusal does not name the standbys that stream: %v", err)
	}
	why := strings.Join(px.Server.NotReady(ctxT(t)), "\n")
	if !strings.Contains(why, "failover standbys cannot confirm") || !strings.Contains(why, "standby s2 (not streaming from this primary") {
		t.Fatalf("/readyz does not say s2 cannot confirm: %q", why)
	}

	upstream := failoverProxy(t, pg, "s1")
	eventually(t, 15*time.Second, "a proxy naming the streaming s1 ready", func() error {
		if why := upstream.Server.NotReady(ctxT(t)); len(why) > 0 {
			return fmt.Errorf("not ready: %q", why)
		}
		return nil
	})
	connect(t, upstream.FenceURL("app", "postgres", "billing", 1)).Close(ctxT(t))
}

// TestFailoverSlotWithoutStandbyIsNotReady: a physical slot keeps the position its standby
// reached whether the standby streams or not; one that no standby streams from confirms no
// new commit, so /readyz says not ready, naming it (a review's /readyz said ready with the
// standby of slot:s1 stopped while every fenced start that raised failed).
func TestFailoverSlotWithoutStandbyIsNotReady(t *testing.T) {
	pg, sb := replicatedDB(t)
	px := failoverProxy(t, pg, "slot:s1")
	eventually(t, 15*time.Second, "ready while s1 streams", func() error {
		if why := px.Server.NotReady(ctxT(t)); len(why) > 0 {
			return fmt.Errorf("not ready: %q", why)
		}
		return nil
	})
	sb.Stop(t)
	eventually(t, 30*time.Second, "not ready, naming the slot", func() error {
		if why := strings.Join(px.Server.NotReady(ctxT(t)), "\n"); !strings.Contains(why, "slot s1 (no standby streams from it)") {
			return fmt.Errorf("not ready for: %q", why)
		}
		return nil
	})
}
