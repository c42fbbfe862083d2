package proxy

import (
	"fmt"
	"slices"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/standby"
)

// live is the part of the configuration a reload may change (Server.Reload). Sessions read
// it once, at their start; a session already running keeps what it started with.
type live struct {
	resources     []Resource
	names         []string
	maxClients    int
	loginTimeout  time.Duration
	unfenced      string
	shutdownGrace time.Duration
	flapChanges   int
	flapWindow    time.Duration
	// the admin console: who may use it, its database name, where its users authenticate
	adminUsers        []string
	adminDatabase     string
	adminAuthDatabase string
	// the standbys a fenced session's start waits for (--failover-standbys): after a
	// failover the operator drops the promoted one without a restart
	failoverStandbys    []string
	standbys            standby.Set
	standbyFlushTimeout time.Duration
}

func newLive(s *settings) *live {
	return &live{resources: s.resources, names: s.names, maxClients: s.MaxClients, loginTimeout: s.LoginTimeout,
		unfenced: s.Unfenced, shutdownGrace: s.ShutdownGrace, flapChanges: s.FlapChanges, flapWindow: s.FlapWindow,
		adminUsers: s.AdminUsers, adminDatabase: s.AdminDatabase, adminAuthDatabase: s.AdminAuthDatabase,
		failoverStandbys: s.FailoverStandbys, standbys: s.standbys, standbyFlushTimeout: s.StandbyFlushTimeout}
}

// conf returns the configuration new sessions start with.
func (s *Server) conf() *live { return s.live.Load() }

// Reload applies what can change without a restart from cfg, the configuration read again
// from the same sources as at startup: the resources (except those validated against
// Consul, whose watches start with the proxy: adding, removing or changing a Consul key
// needs a restart and keeps the resource as it was until then), max-clients, login-timeout, unfenced,
// shutdown-grace, the flapping thresholds, the admin console's settings, failover-standbys
// and standby-flush-timeout (failover-standbys newly set on a proxy started without a
// control database needs a restart). Open sessions go on as they are, and a
// session of a resource the reload removes keeps its binding (the database still fences
// it). It returns what it changed and what it could not apply (needing a restart); an
// invalid cfg changes nothing.
func (s *Server) Reload(cfg Config) (applied, skipped []string, err error) {
	if cfg.Key == nil {
		cfg.Key = s.cfg.Key
	}
	n, err := cfg.validate()
	if err != nil {
		return nil, nil, fmt.Errorf("reload: %w", err)
	}
	old := s.cfg
	restart := func(name string, changed bool) {
		if changed {
			skipped = append(skipped, name+" (needs a restart)")
		}
	}
	restart("listen", n.Listen != old.Listen)
	restart("upstream", n.Upstream != old.Upstream || n.UpstreamSSLMode != old.UpstreamSSLMode || n.UpstreamSSLRootCert != old.UpstreamSSLRootCert)
	restart("tls-cert/tls-key", n.TLSCert != old.TLSCert || n.TLSKey != old.TLSKey)
	restart("max-message-size", n.MaxMessageSize != old.MaxMessageSize)
	restart("connect-timeout", n.ConnectTimeout != old.ConnectTimeout)
	restart("upstream-check-interval", n.UpstreamCheckInterval != old.UpstreamCheckInterval)
	restart("control-database", n.ControlDatabase != old.ControlDatabase)
	restart("key-file", n.KeyFile != old.KeyFile || !slices.Equal(n.Key, old.Key))
	restart("metrics-listen", n.MetricsListen != old.MetricsListen || n.DebugPprof != old.DebugPprof ||
		!slices.Equal(n.AdminAllowedHosts, old.AdminAllowedHosts))
	restart("consul", n.ConsulAddr != old.ConsulAddr || n.ConsulToken != old.ConsulToken || n.ConsulCAFile != old.ConsulCAFile ||
		n.ConsulScheme != old.ConsulScheme || n.ConsulDownMode != old.ConsulDownMode)
	restart("zookeeper", !slices.Equal(n.ZKServers, old.ZKServers) || !slices.Equal(n.ZKResources, old.ZKResources))

	// Resources with a Consul key stay as they started; the others follow cfg.
	cur := s.conf()
	var res []Resource
	for _, r := range old.resources {
		if r.Key != "" {
			res = append(res, r)
		}
	}
	for _, r := range n.resources {
		if r.Key == "" {
			if i := slices.IndexFunc(res, func(x Resource) bool { return x.Name == r.Name }); i >= 0 {
				skipped = append(skipped, fmt.Sprintf("resource %s without its Consul key %s (needs a restart)", r.Name, res[i].Key))
				continue
			}
			res = append(res, r)
			continue
		}
		if slices.Contains(old.resources, r) {
			continue
		}
		// A change that needs a restart keeps the resource as it was: a plain resource that
		// gains a Consul key stays plain (not removed) until the restart.
		if i := slices.IndexFunc(cur.resources, func(x Resource) bool { return x.Name == r.Name && x.Key == "" }); i >= 0 {
			res = append(res, cur.resources[i])
			skipped = append(skipped, fmt.Sprintf("resource %s=%s (a resource validated against Consul needs a restart; %s stays as it is until then)", r.Name, r.Key, r.Name))
			continue
		}
		skipped = append(skipped, fmt.Sprintf("resource %s=%s (a resource validated against Consul needs a restart)", r.Name, r.Key))
	}
	for _, r := range old.resources {
		if r.Key != "" && !slices.Contains(n.resources, r) {
			skipped = append(skipped, fmt.Sprintf("removal of resource %s=%s (needs a restart)", r.Name, r.Key))
		}
	}
	next := newLive(n)
	next.resources = res
	next.names = make([]string, len(res))
	for i, r := range res {
		next.names[i] = r.Name
	}
	if !slices.Equal(next.names, cur.names) {
		applied = append(applied, fmt.Sprintf("resources %v (were %v)", next.names, cur.names))
	}
	change := func(name string, was, is any) {
		if was != is {
			applied = append(applied, fmt.Sprintf("%s %v (was %v)", name, is, was))
		}
	}
	change("max-clients", cur.maxClients, next.maxClients)
	change("login-timeout", cur.loginTimeout, next.loginTimeout)
	change("unfenced", cur.unfenced, next.unfenced)
	change("shutdown-grace", cur.shutdownGrace, next.shutdownGrace)
	change("flap-changes", cur.flapChanges, next.flapChanges)
	change("flap-window", cur.flapWindow, next.flapWindow)
	if !slices.Equal(cur.adminUsers, next.adminUsers) {
		applied = append(applied, fmt.Sprintf("admin-users %v (were %v)", next.adminUsers, cur.adminUsers))
	}
	change("admin-database", cur.adminDatabase, next.adminDatabase)
	change("admin-auth-database", cur.adminAuthDatabase, next.adminAuthDatabase)
	if !slices.Equal(cur.failoverStandbys, next.failoverStandbys) {
		if old.ControlDatabase == "" && !next.standbys.Empty() {
			skipped = append(skipped, "failover-standbys (needs a restart: the proxy started without a control database)")
			next.failoverStandbys, next.standbys = cur.failoverStandbys, cur.standbys
		} else {
			applied = append(applied, fmt.Sprintf("failover-standbys %v (were %v)", next.failoverStandbys, cur.failoverStandbys))
		}
	}
	change("standby-flush-timeout", cur.standbyFlushTimeout, next.standbyFlushTimeout)
	s.live.Store(next)
	return applied, skipped, nil
}
