package proxy_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestProxyImportsNoLockServiceClient: internal/proxy asks every lock service through its
// Guard interface (lease.Authority for etcd and ZooKeeper), and each service's client lives
// in its own package under internal/lease, built outside the proxy (internal/proxy/guards):
// `go list -deps ./internal/proxy` names no Consul, etcd or ZooKeeper client (issue 25).
func TestProxyImportsNoLockServiceClient(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, out)
	}
	clients := []string{"github.com/hashicorp/consul/api", "go.etcd.io/etcd/client", "github.com/go-zookeeper/zk"}
	deps := strings.Fields(string(out))
	if len(deps) < 10 {
		t.Fatalf("go list -deps named %d packages, want the proxy's dependencies: %s", len(deps), out)
	}
	for _, dep := range deps {
		for _, c := range clients {
			if strings.HasPrefix(dep, c) {
				t.Errorf("internal/proxy depends on %s, a lock service's client: build its guard in internal/proxy/guards", dep)
			}
		}
	}
}
