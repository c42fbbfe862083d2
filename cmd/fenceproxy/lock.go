package main

import (
	"context"
	"errors"
	"fmt"
	"os/signal"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/lease/consul"
	"github.com/fenceproxy/fenceproxy/internal/lease/etcd"
	"github.com/fenceproxy/fenceproxy/internal/lease/pglease"
	"github.com/fenceproxy/fenceproxy/internal/lease/zookeeper"
	"github.com/fenceproxy/fenceproxy/internal/standby"
)

// LockCmd runs a command as the leader of a resource: `consul lock` with fencing, on a
// Consul lock, the PostgreSQL lease or an etcd election. See lease.RunLocked for what happens when the
// lease is lost or the command exits.
type LockCmd struct {
	Resource string `help:"Fenced resource to lead (as configured in the proxy), e.g. billing." required:"" env:"FENCEPROXY_RESOURCE"`
	Store    string `help:"Where the lease is won: consul (a Consul lock, the default), postgres (the lease row in fence.leases of --database; needs nothing but PostgreSQL), etcd (an election on --etcd-endpoints) or zookeeper (the lock recipe on --zk-servers)." enum:"consul,postgres,etcd,zookeeper" default:"consul" env:"FENCEPROXY_STORE"`

	Key          string `help:"Consul lock key; default locks/<resource> (--store consul)." env:"FENCEPROXY_KEY"`
	ConsulAddr   string `help:"Consul HTTP address (host:port or URL); default CONSUL_HTTP_ADDR, else 127.0.0.1:8500 (--store consul)." name:"consul-addr" env:"FENCEPROXY_CONSUL_ADDR"`
	ConsulToken  string `help:"Consul ACL token (needs session write and key write on the lock key); default CONSUL_HTTP_TOKEN." name:"consul-token" env:"FENCEPROXY_CONSUL_TOKEN"`
	ConsulCAFile string `help:"CA file to verify Consul's TLS certificate (implies https)." name:"consul-ca-file" type:"path" env:"FENCEPROXY_CONSUL_CA_FILE"`
	ConsulScheme string `help:"http or https; default from --consul-addr." name:"consul-scheme" enum:",http,https" default:"" env:"FENCEPROXY_CONSUL_SCHEME"`
	TokenMode    string `help:"The token the command gets (FENCE_TOKEN), as the proxy's --consul-token-mode: lockindex (the key's LockIndex) or create-lock (CreateIndex*2^24+LockIndex)." name:"consul-token-mode" enum:"lockindex,create-lock" default:"lockindex" env:"FENCEPROXY_CONSUL_TOKEN_MODE"`

	Database            string        `help:"The protected database, reached directly (not through the proxy), whose fence.leases holds the lease (--store postgres; schema version 5, fenceproxy migrate)." name:"database" env:"FENCEPROXY_DATABASE"`
	FailoverStandbys    []string      `help:"Standbys a failover may promote (--store postgres), comma-separated: NAME (application_name; --database's role needs pg_read_all_stats), slot:NAME or slot:* (physical replication slots). A new generation goes to the command only once they have flushed it; one that does not confirm within --standby-flush-timeout is released and the campaign goes on, naming the standby in the log." name:"failover-standbys" sep:"," env:"FENCEPROXY_FAILOVER_STANDBYS"`
	StandbyFlushTimeout time.Duration `help:"How long an acquisition waits for --failover-standbys (--store postgres)." name:"standby-flush-timeout" default:"5s" env:"FENCEPROXY_STANDBY_FLUSH_TIMEOUT"`
	Holder              string        `help:"Holder name in the lease row (--store postgres), the leader key's value (--store etcd) or the lock node's data (--store zookeeper); default host:pid:random." env:"FENCEPROXY_HOLDER"`

	EtcdEndpoints []string `help:"etcd client URLs, comma-separated (--store etcd)." name:"etcd-endpoints" env:"FENCEPROXY_ETCD_ENDPOINTS"`
	Prefix        string   `help:"etcd election prefix, default locks/<resource> (--store etcd); ZooKeeper lock folder, default /locks/<resource> (--store zookeeper)." env:"FENCEPROXY_PREFIX"`
	EtcdUser      string   `help:"etcd user name, when etcd's authentication is on (--store etcd)." name:"etcd-user" env:"FENCEPROXY_ETCD_USER"`
	EtcdPassword  string   `help:"etcd password (--store etcd)." name:"etcd-password" env:"FENCEPROXY_ETCD_PASSWORD"`
	EtcdCAFile    string   `help:"CA file to verify etcd's TLS certificate (--store etcd)." name:"etcd-ca-file" type:"path" env:"FENCEPROXY_ETCD_CA_FILE"`
	EtcdCertFile  string   `help:"Client certificate for etcd (--store etcd)." name:"etcd-cert-file" type:"path" env:"FENCEPROXY_ETCD_CERT_FILE"`
	EtcdKeyFile   string   `help:"Client certificate's key for etcd (--store etcd)." name:"etcd-key-file" type:"path" env:"FENCEPROXY_ETCD_KEY_FILE"`

	ZKServers []string `help:"ZooKeeper servers, host:port, comma-separated (--store zookeeper)." name:"zk-servers" env:"FENCEPROXY_ZK_SERVERS"`

	DatabaseURL string `help:"Base postgres:// URL (pointing at the proxy) that the command gets as DATABASE_URL, with the fence parameters added to its options (default: $DATABASE_URL). Empty: no DATABASE_URL, only FENCE_STORE, FENCE_RESOURCE, FENCE_TOKEN, FENCE_SESSION, FENCE_KEY." name:"database-url" env:"FENCEPROXY_DATABASE_URL,DATABASE_URL"`

	TTL       time.Duration `help:"Lease TTL. Consul (10s to 24h) invalidates a silent holder after TTL to 2xTTL; the PostgreSQL lease (1s to 24h) expires TTL after its last renewal, by the database's clock; etcd (whole seconds, 1s to 24h) expires the session's lease TTL after its last keepalive; ZooKeeper (1s to 24h, within the server's minSessionTimeout..maxSessionTimeout, by default 4s to 40s) expires the session TTL after it last heard from the client." name:"ttl" default:"10s" env:"FENCEPROXY_TTL"`
	LockDelay time.Duration `help:"Consul lock-delay after the holder's session is invalidated. 0 is safe with fencing: a stale leader's writes are refused by the database." name:"lock-delay" default:"0s" env:"FENCEPROXY_LOCK_DELAY"`
	Grace     time.Duration `help:"After losing the lock: time between SIGTERM and SIGKILL to the command's process group." default:"10s" env:"FENCEPROXY_GRACE"`
	OnLost    string        `help:"After losing the lock and stopping the command: retry (campaign again) or exit." name:"on-lost" enum:"retry,exit" default:"retry" env:"FENCEPROXY_ON_LOST"`

	// A fault injection hook of the chaos campaign, hidden from --help: see lease.OffsetFileClock.
	ClockOffsetFile string        `help:"Fault injection: shift the clock that the Consul session's keep-alive reads by the duration in this file, read at every reading (--store consul)." name:"clock-offset-file" hidden:""`
	WatchdogFile    string        `help:"Tie leadership to progress: the command must touch this file (its path is in FENCE_WATCHDOG_FILE) at least every --watchdog-timeout, or it is stopped, the lease given up, and fenceproxy exits with status 124." name:"watchdog-file" type:"path" env:"FENCEPROXY_WATCHDOG_FILE"`
	WatchdogTimeout time.Duration `help:"The longest time the command may go without touching --watchdog-file." name:"watchdog-timeout" env:"FENCEPROXY_WATCHDOG_TIMEOUT"`

	Command []string `arg:"" passthrough:"" help:"Command to run, and its arguments (after --)."`
}

// Run campaigns and supervises the command until it exits; it returns the command's exit
// status as an error with an ExitCode method when it is not 0.
func (c *LockCmd) Run(ctx context.Context, log *zap.Logger) error {
	// A hangup (the terminal closed) stops it like SIGTERM: the child stopped, the lock
	// released; by default it killed the supervisor silently and left the lock held.
	ctx, stopHUP := signal.NotifyContext(ctx, syscall.SIGHUP)
	defer stopHUP()
	command := c.Command
	if len(command) > 0 && command[0] == "--" {
		// kong's passthrough keeps the separator.
		command = command[1:]
	}
	var watchdog *lease.Watchdog
	switch {
	case c.WatchdogFile != "" && c.WatchdogTimeout <= 0:
		return errors.New("lock --watchdog-file needs --watchdog-timeout (> 0)")
	case c.WatchdogFile == "" && c.WatchdogTimeout != 0:
		return errors.New("lock --watchdog-timeout needs --watchdog-file")
	case c.WatchdogFile != "":
		watchdog = &lease.Watchdog{File: c.WatchdogFile, Timeout: c.WatchdogTimeout}
	}
	store, closeStore, err := c.store(log)
	if err != nil {
		return err
	}
	defer closeStore()
	err = lease.RunLocked(ctx, lease.RunConfig{
		Store:       store,
		Resource:    c.Resource,
		Command:     command,
		DatabaseURL: c.DatabaseURL,
		Grace:       c.Grace,
		OnLost:      c.OnLost,
		Watchdog:    watchdog,
		Logger:      log,
	})
	if err != nil && ctx.Err() != nil && errors.Is(err, ctx.Err()) {
		// SIGTERM, SIGINT or SIGHUP before the lock was won: what a service manager's stop does,
		// a normal exit (the child, when it ran, reports its own status).
		log.Info("stopped by SIGTERM or SIGINT before the lock was acquired", zap.String("resource", c.Resource))
		return nil
	}
	return err
}

// store returns the lease store of c.Store and what closes it.
func (c *LockCmd) store(log *zap.Logger) (lease.Store, func(), error) {
	nothing := func() {}
	if len(c.FailoverStandbys) > 0 && c.Store != lease.StorePostgres {
		return nil, nil, errors.New("lock --failover-standbys goes with --store postgres: the other stores keep their generations outside the protected database")
	}
	switch c.Store {
	case lease.StorePostgres:
		if c.Database == "" {
			return nil, nil, errors.New("lock --store postgres needs --database: the protected database's URL, reached directly")
		}
		standbys, err := standby.Parse(c.FailoverStandbys)
		if err != nil {
			return nil, nil, fmt.Errorf("lock --failover-standbys: %w", err)
		}
		return &pglease.Store{URL: c.Database, TTL: c.TTL, Holder: c.Holder, Logger: log,
			Standbys: standbys, FlushTimeout: c.StandbyFlushTimeout}, nothing, nil
	case lease.StoreEtcd:
		if len(c.EtcdEndpoints) == 0 {
			return nil, nil, errors.New("lock --store etcd needs --etcd-endpoints: etcd's client URLs")
		}
		client, err := etcd.NewClient(etcd.Config{
			Endpoints: c.EtcdEndpoints, Username: c.EtcdUser, Password: c.EtcdPassword,
			CAFile: c.EtcdCAFile, CertFile: c.EtcdCertFile, KeyFile: c.EtcdKeyFile,
			Logger: log.Named("etcd-client").WithOptions(zap.IncreaseLevel(zap.WarnLevel)),
		})
		if err != nil {
			return nil, nil, err
		}
		store := &etcd.Store{Client: client, Prefix: c.Prefix, TTL: c.TTL, Holder: c.Holder, Logger: log}
		return store, func() { _ = client.Close() }, nil
	case lease.StoreZooKeeper:
		if len(c.ZKServers) == 0 {
			return nil, nil, errors.New("lock --store zookeeper needs --zk-servers: the ZooKeeper servers' host:port")
		}
		return &zookeeper.Store{Servers: c.ZKServers, Prefix: c.Prefix, TTL: c.TTL, Holder: c.Holder, Logger: log}, nothing, nil
	}
	client, err := consul.NewClient(consul.Config{
		Addr: c.ConsulAddr, Token: c.ConsulToken, CAFile: c.ConsulCAFile, Scheme: c.ConsulScheme,
	})
	if err != nil {
		return nil, nil, err
	}
	store := &consul.Store{Client: client, Key: c.Key, TTL: c.TTL, LockDelay: c.LockDelay, TokenMode: lease.TokenMode(c.TokenMode), Logger: log}
	if c.ClockOffsetFile != "" {
		store.Clock = lease.OffsetFileClock(c.ClockOffsetFile)
	}
	return store, nothing, nil
}
