package proxy_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestFreeLockIsNotBlocked: a lock nobody holds (between leaders, or nothing running) is
// shown as free, not as a red "blocked" resource, and fenceproxy_resource_blocked stays 0
// (it fires FenceproxyResourceBlocked); fenceproxy_lock_free says it instead.
func TestFreeLockIsNotBlocked(t *testing.T) {
	t.Parallel()
	s := startConsulProxy(t)
	reg := prometheus.NewRegistry()
	cfg := proxy.Config{Resources: []string{"billing=locks/billing"}, ConsulAddr: s.consul.Addr, ControlDatabase: s.pg.AdminURL()}
	p := testenv.StartProxy(t, s.pg, cfg, testenv.ProxyOptions{Admitter: s.guard, Registry: s.proxy.Registry, Registerer: reg})
	sess, tok := consulLock(t, s.client, "locks/billing")
	connect(t, p.FenceURL("app", "postgres", "billing", tok))
	if _, _, err := s.client.KV().Release(&api.KVPair{Key: "locks/billing", Session: sess}, nil); err != nil {
		t.Fatal(err)
	}
	eventually(t, 15*time.Second, "the free lock in the status", func() error {
		st := p.Server.Status(ctxT(t))
		if len(st.Resources) != 1 || !st.Resources[0].Free || st.Resources[0].Blocked != "" {
			return fmt.Errorf("status %+v, want free and not blocked", st.Resources)
		}
		return nil
	})
	if v := leadershipGauge(t, reg, "fenceproxy_resource_blocked", "billing"); v != 0 {
		t.Errorf("fenceproxy_resource_blocked{resource=billing} = %v for a free lock, want 0", v)
	}
	if v := leadershipGauge(t, reg, "fenceproxy_lock_free", "billing"); v != 1 {
		t.Errorf("fenceproxy_lock_free{resource=billing} = %v, want 1", v)
	}
}

// leadershipGauge is the value of reg's gauge name for resource (-1: none).
func leadershipGauge(t *testing.T, reg *prometheus.Registry, name, resource string) float64 {
	t.Helper()
	if v, ok := metricValue(t, reg, name, map[string]string{"resource": resource}); ok {
		return v
	}
	return -1
}
