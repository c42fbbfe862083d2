package proxy_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestFailoverNamedStandbyPromotedIsNotWaitedFor: --failover-standbys names the cluster's
// standbys, and after a failover the promoted one is the primary itself. The proxy, left
// running, must not wait for it (a review's F2 and a newcomer's first bug: every fenced
// session was refused with ZF007 "standby s1 (not streaming)" until the proxy restarted,
// the new primary's leader locked out): a name that is the server's own, with no standby
// streaming under it, is skipped. The leader writes on the new primary.
func TestFailoverNamedStandbyPromotedIsNotWaitedFor(t *testing.T) {
	pg, sb := replicatedDB(t)
	vip := startVIP(t, pg)
	px := testenv.StartProxy(t, pg, proxy.Config{
		Upstream:         "postgres://" + vip.hop.Addr,
		Resources:        []string{"billing"},
		ControlDatabase:  vip.url("postgres"),
		FailoverStandbys: []string{"s1"},
	})
	connect(t, px.FenceURL("app", "postgres", "billing", 1)).Close(ctxT(t))

	vip.failover(t, sb)
	waitNewTimeline(t, px, "billing")
	eventually(t, 30*time.Second, "the leader is admitted on the promoted standby", writes(px, 2))
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
