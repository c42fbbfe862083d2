package proxy_test

import (
	"fmt"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestLeaderLogsOnlyForServedResources: the control database tells the proxy of raises of
// every resource of the database; it logs leader changes and flapping for the resources it
// serves only (it logged them, and warned of flapping, for resources it does not serve).
func TestLeaderLogsOnlyForServedResources(t *testing.T) {
	t.Parallel()
	pg, admin := fencedDB(t)
	core, logs := observer.New(zapcore.InfoLevel)
	p := testenv.StartProxy(t, pg, proxy.Config{Resources: []string{"billing"}, ControlDatabase: pg.AdminURL(), FlapChanges: 1},
		testenv.ProxyOptions{Logger: zap.New(core)})
	<-p.Server.Ready()
	for tok := 1; tok <= 4; tok++ {
		mustExec(t, admin, "SELECT fence.reset('payroll', $1)", tok)
	}
	for tok := 1; tok <= 3; tok++ { // after payroll's: the notifications come in order
		mustExec(t, admin, "SELECT fence.reset('billing', $1)", tok)
		// The listener reads the stored token for each notification: one reset at a time,
		// or a later one is read for an earlier notification and a change goes unlogged.
		eventually(t, 15*time.Second, fmt.Sprintf("the proxy follows billing's reset to %d", tok), func() error {
			if h := p.Server.Registry().Highest("postgres", "billing"); h != int64(tok) {
				return fmt.Errorf("the proxy knows token %d", h)
			}
			return nil
		})
	}
	eventually(t, 15*time.Second, "billing's changes logged", func() error {
		if n := logs.FilterMessage("leader changed").FilterField(zap.String("resource", "billing")).Len(); n != 2 {
			return fmt.Errorf("%d leader changes of billing logged, want 2", n)
		}
		return nil
	})
	if n := logs.FilterField(zap.String("resource", "payroll")).Len(); n != 0 {
		t.Errorf("%d log lines about payroll, which this proxy does not serve: %v", n, logs.FilterField(zap.String("resource", "payroll")).All())
	}
	if n := logs.FilterMessageSnippet("leader flapping").FilterField(zap.String("resource", "billing")).Len(); n != 1 {
		t.Errorf("%d flapping warnings for billing, want 1", n)
	}
}
