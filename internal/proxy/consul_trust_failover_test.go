package proxy_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestConsulTrustDatabaseRefusesAfterFailover (a review's F6): with --consul-down
// trust-database, a proxy cut off from Consul that sees an asynchronous failover of the
// database must not admit a token on the new primary's word: the standby missed the raise
// to a higher token, so the new primary stores the stale one again. It refuses (ZF007)
// until Consul answers.
func TestConsulTrustDatabaseRefusesAfterFailover(t *testing.T) {
	pg, sb := replicatedDB(t)
	consul := testenv.StartConsul(t)
	_, tok := consulLock(t, consul.Client(t), "locks/billing")
	px, _, _ := startConsulGuarded(t, pg, proxy.Config{
		Upstream:              hostsURL("?target_session_attrs=read-write", pg, sb.Postgres),
		ControlDatabase:       controlURL(pg, sb.Postgres),
		UpstreamCheckInterval: 100 * time.Millisecond,
		Resources:             []string{"billing=locks/billing"},
		ConsulAddr:            consul.Addr,
		ConsulDownMode:        proxy.ConsulDownTrustDatabase,
		ConsulAnswerTimeout:   time.Second,
		Key:                   testenv.Key,
	})
	url := func(tok int64) string { return px.FenceURL("app", "postgres", "billing", tok) }
	a := connect(t, url(tok))
	mustExec(t, a, "INSERT INTO items (tag, token) VALUES ('a', $1)", tok)
	a.Close(ctxT(t))
	standby := connect(t, sb.Postgres.AdminURL())
	eventually(t, 10*time.Second, "the standby stores the token", func() error {
		if got := storedToken(t, standby, "billing"); got != tok {
			return fmt.Errorf("standby stores %d", got)
		}
		return nil
	})
	standby.Close(ctxT(t))

	// Consul goes away from this proxy and replication is cut; a higher token (as another
	// proxy that reaches Consul would admit it) is raised on the primary only.
	consul.Stop(t)
	sb.CutReplication()
	b := connect(t, url(tok+1))
	mustExec(t, b, "INSERT INTO items (tag, token) VALUES ('b', $1)", tok+1)
	b.Close(ctxT(t))
	wantStale(t, connectErr(url(tok)))

	pg.Kill(t)
	sb.Promote(t)
	var last error
	eventually(t, 30*time.Second, "the stale token refused on the new primary", func() error {
		err := connectErr(url(tok))
		last = err
		switch {
		case err == nil:
			return nil // a violation, reported below
		case sqlstate(err) == fence.CodeUnavailable && strings.Contains(err.Error(), "after the failover"):
			return nil
		}
		return fmt.Errorf("got %v", err)
	})
	if last == nil {
		t.Fatalf("token %d (stale: %d was admitted before the failover) admitted on the new primary's word", tok, tok+1)
	}
}
