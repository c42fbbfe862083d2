package proxy_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	"github.com/jackc/pgx/v5/pgxpool"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/lease/consul"
	"github.com/fenceproxy/fenceproxy/internal/lease/etcd"
	"github.com/fenceproxy/fenceproxy/internal/lease/pglease"
	"github.com/fenceproxy/fenceproxy/internal/lease/zookeeper"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxy/guards"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// The admission paths of a fenced session, each with the real server that decides
// (TestTransparencyMatrix, TestIdleAfterConnect): PostgreSQL, Consul, etcd and ZooKeeper
// are started once per test binary (sharedServers) and stopped by TestMain.

// servers are the servers the admission paths share.
type servers struct {
	pg     *testenv.Postgres
	admin  *pgxpool.Pool // straight to PostgreSQL, as the superuser
	consul *testenv.Consul
	cc     *api.Client
	etcd   *testenv.Etcd
	ec     *clientv3.Client
	zk     *testenv.ZooKeeper
	close  []func() error
}

var shared struct {
	once sync.Once
	s    *servers
	err  error
}

// sharedServers starts the servers at the first call of the test binary.
func sharedServers(t *testing.T) *servers {
	t.Helper()
	testenv.NeedServers(t)
	shared.once.Do(func() { shared.s, shared.err = launchServers() })
	if shared.err != nil {
		t.Fatalf("shared servers: %v", shared.err)
	}
	return shared.s
}

func TestMain(m *testing.M) {
	code := m.Run()
	if shared.s != nil {
		shared.s.stop()
	}
	os.Exit(code)
}

func (s *servers) stop() {
	for i := len(s.close) - 1; i >= 0; i-- {
		_ = s.close[i]()
	}
}

// launchServers starts PostgreSQL (the fence schema, the role "app"), Consul, etcd and
// ZooKeeper at once.
func launchServers() (*servers, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	s := &servers{}
	var mu sync.Mutex
	var errs []error
	var wg sync.WaitGroup
	launch := func(what string, f func() (func() error, error)) {
		wg.Go(func() {
			closer, err := f()
			mu.Lock()
			defer mu.Unlock()
			if closer != nil {
				s.close = append(s.close, closer)
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", what, err))
			}
		})
	}
	launch("postgres", func() (func() error, error) {
		pg, err := testenv.LaunchPostgres(ctx)
		if err != nil {
			return nil, err
		}
		s.pg = pg
		if err := testenv.MigrateContext(ctx, pg.AdminURL()); err != nil {
			return pg.Close, err
		}
		if err := pg.CreateRoleContext(ctx, "app", "app"); err != nil {
			return pg.Close, err
		}
		if s.admin, err = pgxpool.New(ctx, pg.AdminURL()); err != nil {
			return pg.Close, err
		}
		return func() error { s.admin.Close(); return pg.Close() }, nil
	})
	launch("consul", func() (func() error, error) {
		c, err := testenv.LaunchConsul(ctx)
		if err != nil {
			return nil, err
		}
		s.consul = c
		s.cc, err = c.NewClient()
		return c.Close, err
	})
	launch("etcd", func() (func() error, error) {
		e, err := testenv.LaunchEtcd(ctx)
		if err != nil {
			return nil, err
		}
		s.etcd = e
		s.ec, err = clientv3.New(clientv3.Config{Endpoints: []string{e.Endpoint}, DialTimeout: 5 * time.Second})
		if err != nil {
			return e.Close, err
		}
		return func() error { s.ec.Close(); return e.Close() }, nil
	})
	launch("zookeeper", func() (func() error, error) {
		z, err := testenv.LaunchZooKeeper(ctx)
		if err != nil {
			return nil, err
		}
		s.zk = z
		return z.Close, nil
	})
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		s.stop()
		return nil, err
	}
	return s, nil
}

// guard is a lock service's Guard (consul.Guard, or a LockGuard for etcd or ZooKeeper).
type guard interface {
	proxy.Admitter
	Run(ctx context.Context) error
}

// admissionPath is one way a session is admitted.
type admissionPath struct {
	name string
	// configure fills in a proxy's config for resources (none for the unfenced path).
	configure func(s *servers, cfg *proxy.Config, resources []string)
	// guard makes the path's Admitter (nil: none).
	guard func(ctx context.Context, cfg proxy.Config, reg *fence.Registry) (guard, error)
	// store is where a holder of the path wins its token (nil: a bare resource's token,
	// or none for the unfenced path).
	store func(s *servers, holder string) lease.Store
	// unfenced: sessions present no token.
	unfenced bool
	// session: the session names its holder (fence.session), as etcd and ZooKeeper need.
	session bool
}

// guarded says whether the path's guard raises a new holder's token itself: a holder
// connects once that is done.
func (a admissionPath) guarded() bool { return a.guard != nil }

func fencedResources(s *servers, cfg *proxy.Config, resources []string) {
	cfg.Resources = resources
	// The control database lets the proxy tell a backend ended by a raise (ZF001) at
	// once, however slow the machine; the key proves a guard's proactive raise.
	cfg.ControlDatabase = s.pg.AdminURL()
	cfg.Key = testenv.Key
}

// keyed is resources as name=<prefix><name>.
func keyed(prefix string, resources []string) []string {
	var out []string
	for _, r := range resources {
		out = append(out, r+"="+prefix+r)
	}
	return out
}

func consulPath(mode lease.TokenMode) admissionPath {
	return admissionPath{
		name: "consul-" + string(mode),
		configure: func(s *servers, cfg *proxy.Config, resources []string) {
			fencedResources(s, cfg, keyed("locks/", resources))
			cfg.ConsulAddr = s.consul.Addr
			cfg.ConsulTokenMode = string(mode)
		},
		guard: func(ctx context.Context, cfg proxy.Config, reg *fence.Registry) (guard, error) {
			return guards.Consul(ctx, cfg, consul.GuardOptions{Registry: reg, Logger: zapNop()})
		},
		store: func(s *servers, _ string) lease.Store {
			return &consul.Store{Client: s.cc, TokenMode: mode, TTL: time.Minute}
		},
	}
}

var admissionPaths = []admissionPath{
	{name: "bare", configure: fencedResources},
	{
		name:      "pg-lease",
		configure: fencedResources,
		store: func(s *servers, holder string) lease.Store {
			return &pglease.Store{URL: s.pg.AdminURL(), TTL: time.Minute, Holder: holder}
		},
	},
	consulPath(lease.TokenLockIndex),
	consulPath(lease.TokenCreateLock),
	{
		name: "etcd",
		configure: func(s *servers, cfg *proxy.Config, resources []string) {
			fencedResources(s, cfg, resources)
			cfg.EtcdEndpoints = []string{s.etcd.Endpoint}
			cfg.EtcdResources = keyed("locks/", resources)
		},
		guard: func(ctx context.Context, cfg proxy.Config, reg *fence.Registry) (guard, error) {
			return lockGuard(ctx, cfg, proxy.LockGuardOptions{Registry: reg, Logger: zapNop()})
		},
		store: func(s *servers, holder string) lease.Store {
			return &etcd.Store{Client: s.ec, TTL: 10 * time.Second, Holder: holder}
		},
		session: true,
	},
	{
		name: "zookeeper",
		configure: func(s *servers, cfg *proxy.Config, resources []string) {
			fencedResources(s, cfg, resources)
			cfg.ZKServers = []string{s.zk.Addr}
			cfg.ZKResources = resources // /locks/<resource>
		},
		guard: func(ctx context.Context, cfg proxy.Config, reg *fence.Registry) (guard, error) {
			return lockGuard(ctx, cfg, proxy.LockGuardOptions{Registry: reg, Logger: zapNop()})
		},
		store: func(s *servers, holder string) lease.Store {
			return &zookeeper.Store{Servers: []string{s.zk.Addr}, TTL: 10 * time.Second, Holder: holder}
		},
		session: true,
	},
	{
		name:      "unfenced",
		configure: func(_ *servers, cfg *proxy.Config, _ []string) { cfg.Unfenced = proxy.UnfencedAllow },
		unfenced:  true,
	},
}

// startPathProxy starts a proxy of path for resources (and its guard), with mod applied to
// its config, and waits until it is ready (a guard's watch synchronised).
func startPathProxy(t *testing.T, s *servers, path admissionPath, resources []string, mod func(*proxy.Config)) *testenv.Proxy {
	t.Helper()
	cfg := proxy.Config{Upstream: fmt.Sprintf("postgres://%s:%d", s.pg.Host, s.pg.Port)}
	path.configure(s, &cfg, resources)
	if mod != nil {
		mod(&cfg)
	}
	var opts testenv.ProxyOptions
	if path.guard != nil {
		reg := fence.NewRegistry()
		ctx, cancel := context.WithCancel(context.Background())
		g, err := path.guard(ctx, cfg, reg)
		if err != nil {
			cancel()
			t.Fatalf("%s guard: %v", path.name, err)
		}
		done := make(chan struct{})
		go func() { g.Run(ctx); close(done) }() //nolint:errcheck
		t.Cleanup(func() { cancel(); <-done })
		opts = testenv.ProxyOptions{Admitter: g, Registry: reg}
	}
	p := testenv.StartProxy(t, s.pg, cfg, opts)
	eventually(t, 15*time.Second, path.name+" proxy ready", func() error {
		if why := p.Server.NotReady(ctxT(t)); len(why) > 0 {
			return fmt.Errorf("not ready: %v", why)
		}
		return nil
	})
	return p
}

// holding is who holds a resource's token on a path, as the session presents it.
type holding struct {
	token   int64
	session string // fence.session ("" for none)
	lease   lease.Lease
}

// holder wins resource's token on path as holder, and waits, on a guarded path, until the
// guard has raised it (the holder's sessions are admitted from then on).
func holder(ctx context.Context, s *servers, path admissionPath, resource, name string, bare int64) (holding, error) {
	if path.store == nil {
		return holding{token: bare}, nil
	}
	l, err := path.store(s, name).Campaign(ctx, resource)
	if err != nil {
		return holding{}, fmt.Errorf("%s campaign for %s: %w", path.name, resource, err)
	}
	h := holding{token: l.Token(), lease: l}
	if path.session {
		h.session = l.Holder()
	}
	if !path.guarded() {
		return h, nil
	}
	for {
		var stored int64
		err := s.admin.QueryRow(ctx, "SELECT coalesce((SELECT token FROM fence.tokens WHERE resource = $1), 0)", resource).Scan(&stored)
		if err == nil && stored == h.token {
			return h, nil
		}
		select {
		case <-ctx.Done():
			return h, fmt.Errorf("%s: token %d of %s not raised (stored %d, %v): %w", path.name, h.token, resource, stored, err, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// release gives h's lease up (a bare token has none).
func (h holding) release() {
	if h.lease != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = h.lease.Release(ctx)
	}
}

// options is the startup option that carries h's token for resource.
func (h holding) options(resource string) string {
	o := fmt.Sprintf("-c fence.resource=%s -c fence.token=%d", resource, h.token)
	if h.session != "" {
		o += " -c fence.session=" + h.session
	}
	return o
}
