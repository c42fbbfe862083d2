package proxy_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestLockServiceMoveIsRefusedNotARegression: a resource that was led through Consul (the
// database admitted Consul's token 1000) and is now validated by etcd, whose revisions are
// lower, is refused saying it was led through Consul and how to move it, not as a regression
// of etcd's revisions that only a restart clears; after fence reset the etcd leader is
// admitted by the same proxy (a newcomer moved resources between lock services and got
// "LockIndex regression ... a snapshot restore", then a closed resource until a restart).
func TestLockServiceMoveIsRefusedNotARegression(t *testing.T) {
	pg, admin := fencedDB(t)
	pg.Exec(t, `INSERT INTO fence.consul_tokens (resource, token, holder) VALUES ('billing', 1000, '5f0e3c2a-0000-4000-8000-000000000001');
		SELECT fence.reset('billing', 1000); INSERT INTO fence.consul_tokens (resource, token, holder) VALUES ('billing', 1000, '5f0e3c2a-0000-4000-8000-000000000001')`)
	etcd := testenv.StartEtcd(t)
	cfg := proxy.Config{
		Upstream:        fmt.Sprintf("postgres://%s:%d", pg.Host, pg.Port),
		Resources:       []string{"billing"},
		EtcdEndpoints:   []string{etcd.Endpoint},
		EtcdResources:   []string{"billing=locks/billing"},
		ControlDatabase: pg.AdminURL(),
		Key:             testenv.Key,
	}
	px, _ := startEtcdGuarded(t, pg, cfg)
	l := etcdCampaign(t, etcd.Client(t), "a")
	url := px.FenceURL("app", "postgres", "billing", l.Token(), "fence.session="+l.Holder())
	eventually(t, 15*time.Second, "etcd's leader refused, naming Consul", func() error {
		err := connectErr(url)
		var pe *pgconn.PgError
		if sqlstate(err) != fence.CodeUnavailable || !strings.Contains(err.Error(), "which was admitted through Consul") ||
			!errors.As(err, &pe) || !strings.Contains(pe.Hint, "fenceproxy fence reset --resource billing --token "+fmt.Sprint(l.Token())) {
			return fmt.Errorf("got %v", err)
		}
		return nil
	})
	admin.Exec(ctxT(t), "SELECT fence.reset('billing', $1)", l.Token())
	eventually(t, 15*time.Second, "etcd's leader admitted after the reset, without a restart", func() error { return connectErr(url) })
}
