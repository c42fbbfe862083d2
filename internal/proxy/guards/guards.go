// Package guards builds the proxy's guards from its configuration: each lock service's
// client is made here, so that internal/proxy imports none.
package guards

import (
	"context"

	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/lease/consul"
	"github.com/fenceproxy/fenceproxy/internal/lease/etcd"
	"github.com/fenceproxy/fenceproxy/internal/lease/zookeeper"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
)

// Lock builds a proxy.LockGuard for each lock service of cfg that answers as a
// lease.Authority (--etcd-resource, --zk-resource).
func Lock(ctx context.Context, cfg proxy.Config, opts proxy.LockGuardOptions) ([]*proxy.LockGuard, error) {
	log := opts.Logger
	if log == nil {
		log = zap.NewNop()
	}
	var services []lease.Authority
	e, err := etcd.NewAuthority(etcd.AuthorityConfig{Endpoints: cfg.EtcdEndpoints, Resources: cfg.EtcdResources, Logger: log})
	if err != nil {
		return nil, err
	}
	if e != nil {
		services = append(services, e)
	}
	z, err := zookeeper.NewAuthority(zookeeper.AuthorityConfig{Servers: cfg.ZKServers, Resources: cfg.ZKResources, Logger: log})
	if err != nil {
		closeAll(services)
		return nil, err
	}
	if z != nil {
		services = append(services, z)
	}
	var guards []*proxy.LockGuard
	for _, svc := range services {
		g, err := proxy.NewLockGuard(ctx, cfg, svc, opts)
		if err != nil {
			closeAll(services)
			for _, g := range guards {
				g.Close()
			}
			return nil, err
		}
		guards = append(guards, g)
	}
	return guards, nil
}

func closeAll(services []lease.Authority) {
	for _, s := range services {
		_ = s.Close()
	}
}

// Consul builds the Consul Guard of cfg's resources that name a Consul key (nil, nil when
// none does).
func Consul(ctx context.Context, cfg proxy.Config, opts consul.GuardOptions) (*consul.Guard, error) {
	c, resources, err := cfg.Validated()
	if err != nil {
		return nil, err
	}
	keys := map[string]string{}
	for _, r := range resources {
		if r.Key != "" {
			keys[r.Name] = r.Key
		}
	}
	return consul.NewGuard(ctx, consul.GuardConfig{
		Keys:           keys,
		Client:         consul.Config{Addr: c.ConsulAddr, Token: c.ConsulToken, CAFile: c.ConsulCAFile, Scheme: c.ConsulScheme},
		Mode:           lease.TokenMode(c.ConsulTokenMode),
		TrustDatabase:  c.ConsulDownMode == proxy.ConsulDownTrustDatabase,
		RequireSession: c.ConsulRequireSession,
		AnswerTimeout:  c.ConsulAnswerTimeout,
		Control:        c.ControlDatabase,
		Key:            c.Key,
	}, opts)
}
