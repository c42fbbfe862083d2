package testenv

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
)

// Key is the proxy key of every test: Migrate stores it, StartProxy uses it
// unless the Config names another.
var Key = fence.Key("fenceproxy test key, 32 bytes..")

// Migrate installs the fence schema in the database at url (an owner's URL)
// and stores Key there.
func Migrate(tb testing.TB, url string) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := MigrateContext(ctx, url); err != nil {
		tb.Fatalf("testenv: %v", err)
	}
}

// MigrateContext is Migrate returning an error.
func MigrateContext(ctx context.Context, url string) error {
	if _, err := fence.Migrate(ctx, url); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	return fence.SetKey(ctx, url, Key)
}

// Proxy is an in-process fenceproxy in front of a test cluster.
type Proxy struct {
	Host     string
	Port     int
	Server   *proxy.Server
	Registry *fence.Registry
	Metrics  *proxy.Metrics

	cancel context.CancelFunc
	done   chan error
}

// ProxyOptions tune StartProxy.
type ProxyOptions struct {
	// Admitter validates tokens (nil: none).
	Admitter proxy.Admitter
	// Registry to share with other proxies' watchers (nil: a new one).
	Registry *fence.Registry
	// Logger (nil: the test's log, warnings and above).
	Logger *zap.Logger
	// Registerer receives the proxy's leadership metrics (nil: none).
	Registerer prometheus.Registerer
	// Reload is the admin console's RELOAD (proxy.Options.Reload; nil: refused).
	Reload func() (applied, skipped []string, err error)
	// LookupHost resolves the upstream's host names (nil: the system's resolver).
	LookupHost func(ctx context.Context, host string) ([]string, error)
}

// StartProxy starts a proxy listening on a free loopback port in front of
// pg, with cfg (Upstream and Listen are filled in when empty). It stops
// when the test ends.
func StartProxy(tb testing.TB, pg *Postgres, cfg proxy.Config, opts ...ProxyOptions) *Proxy {
	NeedServers(tb)
	tb.Helper()
	var o ProxyOptions
	if len(opts) > 0 {
		o = opts[0]
	}
	if cfg.Upstream == "" {
		cfg.Upstream = fmt.Sprintf("postgres://%s", net.JoinHostPort(pg.Host, strconv.Itoa(pg.Port)))
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("testenv: proxy listen: %v", err)
	}
	cfg.Listen = ln.Addr().String()
	if cfg.KeyFile == "" && cfg.Key == nil {
		cfg.Key = Key
	}
	if o.Logger == nil {
		o.Logger = zaptest.NewLogger(tb, zaptest.Level(zap.WarnLevel))
	}
	if o.Registry == nil {
		o.Registry = fence.NewRegistry()
	}
	m := proxy.NewMetrics(nil)
	srv, err := proxy.New(cfg, proxy.Options{Logger: o.Logger, Registry: o.Registry, Admitter: o.Admitter, Metrics: m, Registerer: o.Registerer, Reload: o.Reload, LookupHost: o.LookupHost})
	if err != nil {
		ln.Close()
		tb.Fatalf("testenv: proxy config: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Proxy{Host: "127.0.0.1", Port: ln.Addr().(*net.TCPAddr).Port, Server: srv, Registry: o.Registry, Metrics: m, cancel: cancel, done: make(chan error, 1)}
	go func() { p.done <- srv.Serve(ctx, ln) }()
	tb.Cleanup(func() { p.Stop(tb) })
	select {
	case <-srv.Ready():
	case <-time.After(30 * time.Second):
		tb.Fatalf("testenv: proxy not ready (its control database's listener) within 30 s")
	}
	return p
}

// Stop shuts the proxy down (idempotent) and waits for it.
func (p *Proxy) Stop(tb testing.TB) {
	tb.Helper()
	if p.cancel == nil {
		return
	}
	p.cancel()
	p.cancel = nil
	select {
	case err := <-p.done:
		if err != nil {
			tb.Errorf("testenv: proxy: %v", err)
		}
	case <-time.After(60 * time.Second):
		tb.Errorf("testenv: proxy did not stop within 60 s")
	}
}

// URL is a connection URL through the proxy (sslmode=disable unless params
// say otherwise; params are "key=value", e.g. "fence.token=3").
func (p *Proxy) URL(user, db string, params ...string) string {
	return p.url(url.User(user), db, params)
}

// URLWithPassword is URL with a password.
func (p *Proxy) URLWithPassword(user, password, db string, params ...string) string {
	return p.url(url.UserPassword(user, password), db, params)
}

func (p *Proxy) url(user *url.Userinfo, db string, params []string) string {
	return connURL(p.Host, p.Port, user, db, params)
}

// FenceURL is URL with the fence parameters for resource and token.
func (p *Proxy) FenceURL(user, db, resource string, token int64, params ...string) string {
	return p.URL(user, db, append(params, "fence.resource="+resource, "fence.token="+strconv.FormatInt(token, 10))...)
}

// Connect opens a pgx connection to url (within 20 s), after mods change
// its config, and closes it when the test ends.
func Connect(tb testing.TB, url string, mods ...func(*pgx.ConnConfig)) *pgx.Conn {
	tb.Helper()
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		tb.Fatalf("testenv: %s: %v", url, err)
	}
	for _, m := range mods {
		if m != nil {
			m(cfg)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		tb.Fatalf("testenv: connect %s: %v", url, err)
	}
	tb.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}
