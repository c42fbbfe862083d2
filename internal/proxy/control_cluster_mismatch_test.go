package proxy_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
)

// TestControlDatabaseOnAnotherClusterFailsClosed: a --control-database on another cluster
// than --upstream (a review's setup, with the same proxy key) let the standby wait read that
// cluster's standbys and admit a token its own standby never had; after a failover a stale
// write committed. The proxy compares the system identifiers and refuses every fenced session
// (ZF007), and /readyz says so.
func TestControlDatabaseOnAnotherClusterFailsClosed(t *testing.T) {
	upstream, _ := fencedDB(t)
	other, _ := fencedDB(t)
	px := fencedProxy(t, upstream, func(c *proxy.Config) {
		c.ControlDatabase = other.AdminURL()
		c.UpstreamCheckInterval = 100 * time.Millisecond
	})
	eventually(t, 15*time.Second, "a fenced session refused, naming the other cluster", func() error {
		err := connectErr(px.FenceURL("app", "postgres", "billing", 1))
		if sqlstate(err) != fence.CodeUnavailable || !strings.Contains(err.Error(), "the control database (--control-database) is another cluster") {
			return fmt.Errorf("got %v", err)
		}
		return nil
	})
	if why := strings.Join(px.Server.NotReady(ctxT(t)), "\n"); !strings.Contains(why, "is another cluster") {
		t.Fatalf("/readyz does not say the control database is another cluster: %q", why)
	}
}
