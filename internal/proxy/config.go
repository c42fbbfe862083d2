package proxy

import (
	"crypto/tls"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/standby"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// Unfenced policies: what a session that presents no fence parameter may do.
const (
	UnfencedReject   = "reject"
	UnfencedReadOnly = "readonly"
	UnfencedAllow    = "allow"
)

// Consul-down policies (--consul-down).
const (
	ConsulDownRefuse        = "refuse"
	ConsulDownTrustDatabase = "trust-database"
)

// DefaultListen is the client-facing address when none is configured. Its port, 7432, is one
// that no common PostgreSQL tool takes by default, so that fenceproxy can run next to them on
// one host: PgBouncer, PgDog, pgcat and Odyssey listen on 6432, Supavisor on 6543, and
// Debian's second PostgreSQL cluster on 5433. Keep the Listen field's default tag the same.
const DefaultListen = "127.0.0.1:7432"

// DefaultAdminDatabase is the database name of the admin console when none is configured, as
// PgBouncer's is pgbouncer. Keep the AdminDatabase field's default tag the same.
const DefaultAdminDatabase = "fenceproxy"

// DefaultConsulAnswerTimeout is how long a session start waits for Consul by default: a hung
// Consul then refuses the session in 2 s with its cause, not after the 15 s login timeout
// with "login timeout".
const DefaultConsulAnswerTimeout = 2 * time.Second

// Config is the proxy's whole configuration. The zero value of every field
// means its default. Flags, environment variables (FENCEPROXY_<FLAG>) and the
// JSON config file all fill this same struct (see cmd/fenceproxy).
type Config struct {
	// Listen is the client-facing address, HOST:PORT. Default 127.0.0.1:7432 (DefaultListen).
	Listen string `help:"Address to accept clients on, HOST:PORT." default:"127.0.0.1:7432"`
	// Upstream is the PostgreSQL server: postgres://HOST:PORT, or
	// postgres:///?host=/socket/dir&port=5432 for a Unix socket, or several hosts in libpq's
	// multi-host syntax (postgres://h1:5432,h2:5432/?target_session_attrs=read-write, or
	// host=h1,h2 port=5432 target_session_attrs=read-write). User and database come from
	// each client's startup message, never from here.
	Upstream string `help:"PostgreSQL server, postgres://HOST:PORT or postgres:///?host=/socket/dir&port=PORT; several hosts in libpq's syntax, postgres://H1:PORT,H2:PORT/?target_session_attrs=read-write or host=H1,H2 port=PORT target_session_attrs=... (fenced sessions go to the primary whatever the attribute; user and database come from each client)." required:""`
	// UpstreamCheckInterval is how often the proxy reads each upstream host's role
	// (pg_is_in_recovery) on the control database's role (0: 1 s).
	UpstreamCheckInterval time.Duration `help:"How often the proxy reads each --upstream host's role (primary or standby) on the --control-database role: for /readyz, for the choice of host at a session start, and to end sessions on a primary that turned standby." name:"upstream-check-interval" default:"1s"`
	// UpstreamSSLMode is disable (default), require or verify-full.
	UpstreamSSLMode string `help:"TLS to the server: disable, require, verify-full." name:"upstream-sslmode" default:"disable" enum:"disable,require,verify-full"`
	// UpstreamSSLRootCert is the CA file for verify-full (nil: system roots).
	UpstreamSSLRootCert string `help:"CA certificate file to verify the server with (verify-full)." name:"upstream-sslrootcert" type:"path"`

	// TLSCert and TLSKey enable TLS for clients (SSLRequest answered 'S').
	TLSCert string `help:"Certificate file for client TLS; without it SSLRequest is answered 'N'." type:"path"`
	TLSKey  string `help:"Key file for client TLS." type:"path"`

	// MaxMessageSize is the largest protocol message accepted in either
	// direction (0: 1 GiB, PostgreSQL's own field limit).
	MaxMessageSize int `help:"Largest protocol message accepted, in bytes (0: 1 GiB)." default:"0"`
	// LoginTimeout bounds startup and authentication (0: 15 s).
	LoginTimeout time.Duration `help:"Time allowed for startup and authentication; it includes waiting for the server's first answer." default:"15s"`
	// ConnectTimeout bounds dialing the server (0: 5 s).
	ConnectTimeout time.Duration `help:"Time allowed to connect to the server: the TCP (or Unix socket) connect and, when configured, the TLS negotiation; not the server's answer to the startup, which only --login-timeout bounds (a server that accepts and never answers holds a client for the whole --login-timeout)." default:"5s"`
	// MaxClients is the most client connections at once (0: 1000).
	MaxClients int `help:"Most client connections at once." default:"1000"`
	// Relay is how started sessions are relayed: loop (default), by the event loop, a thread
	// shared by every session whose connections are plain sockets (loop_linux.go), where
	// the system has one and GOMAXPROCS is 2 or more; goroutines, by two goroutines a
	// session.
	Relay string `help:"How started sessions are relayed: loop (one event-loop thread for every session without TLS, where GOMAXPROCS is 2 or more) or goroutines (two a session)." default:"loop" enum:"loop,goroutines"`
	// ShutdownGrace is how long sessions may finish after SIGTERM (0: 30 s).
	ShutdownGrace time.Duration `help:"How long sessions may finish after SIGTERM before they are closed." default:"30s"`

	// Resources are the fenced resources, NAME or NAME=CONSUL_KEY. In an
	// environment variable, separate them with commas. A NAME without a Consul key that is
	// no --lease-resource, --etcd-resource or --zk-resource is a bare-token resource: the
	// database orders the tokens clients bring, and any client of the proxy may raise it.
	Resources []string `help:"Fenced resource, NAME or NAME=CONSUL_KEY (repeatable). A NAME that no lock service validates (not a --lease-resource, --etcd-resource or --zk-resource, no CONSUL_KEY) is a bare-token resource: any client of the proxy may raise its token." name:"resource" sep:","`
	// LeaseResources are the resources led through the PostgreSQL lease (fenceproxy lock
	// --store postgres): their sessions are bound with fence.lease_bind, which admits no
	// token before the lease exists. Each is also a resource (listing it in Resources too is
	// allowed).
	LeaseResources []string `help:"Resource led through the PostgreSQL lease (fenceproxy lock --store postgres), NAME (repeatable; implies --resource NAME): no token is admitted until its lease exists." name:"lease-resource" sep:","`
	// Unfenced is the policy for sessions without fence parameters:
	// reject (default), readonly or allow.
	Unfenced string `help:"Sessions without a token: reject, readonly (best effort: default_transaction_read_only, which a client can turn off; use a role without write privileges to enforce it) or allow." default:"reject" enum:"reject,readonly,allow"`
	// ControlDatabase is a connection URL, to a database of the upstream
	// server, that the proxy uses itself: it LISTENs there for raises made
	// through other proxy instances, asks there whether a raise ended a
	// session's backend (fence.settled, for sessions of that database), and
	// raises the tokens Consul hands out. Empty: none of these.
	ControlDatabase string `help:"URL of a database on the upstream server that the proxy itself uses: to LISTEN for raises, to ask whether a raise ended a session (fence.settled), and to raise Consul's tokens proactively."`
	// FailoverStandbys are the standbys a failover may promote (standby.Parse): a fenced
	// session starts only once they have flushed its bind's commit, so that no raise is
	// admitted that a failover could lose. Empty: no wait (safe only without asynchronous
	// standbys, or with synchronous ones and synchronous_commit on in the raise).
	FailoverStandbys []string `help:"Standbys a failover may promote, comma-separated: NAME (application_name in pg_stat_replication; the control database's role needs pg_read_all_stats), slot:NAME (a physical replication slot) or slot:* (every physical slot). A fenced session starts only once they have flushed its bind's commit (needs --control-database). Empty: no wait (see docs/failover.md)." name:"failover-standbys" sep:","`
	// StandbyFlushTimeout bounds that wait (0: 5 s); a standby that has not confirmed by
	// then fails the session start with ZF007, naming it.
	StandbyFlushTimeout time.Duration `help:"How long a fenced session's start waits for --failover-standbys to flush its bind before it fails with ZF007 naming the standby." name:"standby-flush-timeout" default:"5s"`
	// KeyFile holds the proxy key (hex), the secret that proves to the
	// database that a bind or raise comes from fenceproxy; `fenceproxy
	// migrate --key-file` creates it and stores it in the database. Required
	// when Resources is not empty.
	KeyFile string `help:"File with the proxy key (hex) that fenceproxy migrate --key-file stored in the database; required with --resource." type:"path"`
	// Key, when set, is used instead of KeyFile (programs that embed the proxy).
	Key fence.Key `kong:"-" json:"-"`
	// StaleWait is how long a fenced session whose backend the server ended
	// waits for the registry to learn of a raise when the proxy cannot ask the
	// database (relay.go, staleWait; 0: that default). Tests set it.
	StaleWait time.Duration `kong:"-" json:"-"`
	// StaleLinger is how long the client connection of a session ended with a fencing
	// error stays open for its next message (relay.go, staleLinger; 0: that default).
	// Tests set it.
	StaleLinger time.Duration `kong:"-" json:"-"`

	// MetricsListen is the admin listener: /metrics, /healthz, /readyz, /status and the
	// status page (empty: off). A port alone (":9187") listens on loopback.
	MetricsListen string `help:"Admin listener (alias --admin-listen), HOST:PORT or :PORT (loopback): /metrics, /healthz, /readyz, /status, /history and the status page at / (empty: off)." aliases:"admin-listen"`
	// AdminAllowedHosts are the names, besides loopback addresses and localhost, that a
	// request's Host may be on an admin listener on loopback (AdminHosts).
	AdminAllowedHosts []string `help:"Host names (comma-separated) besides loopback addresses and localhost that requests to a loopback admin listener may name in their Host header (others get 421: DNS rebinding)." name:"admin-allowed-hosts" sep:","`
	// AdminUsers may use the admin console (AdminDatabase on the client port), as PgBouncer's
	// admin_users: each logs in with its PostgreSQL password, which the proxy has the server
	// check (against AdminAuthDatabase). Empty: the console refuses everyone.
	AdminUsers []string `help:"Users (comma-separated) who may use the admin console on the client port (psql -d fenceproxy -c 'SHOW FENCES'), as PgBouncer's admin_users; the server checks their password (see --admin-auth-database). Empty: the console refuses everyone." name:"admin-users" sep:","`
	// AdminDatabase is the database name that reaches the admin console instead of the server
	// (0: DefaultAdminDatabase): a server database of that name is not reachable through the
	// proxy, so rename the console when one exists.
	AdminDatabase string `help:"Database name of the admin console on the client port: a client that names it talks to fenceproxy, not to the server, so a server database of that name is reachable through the proxy only once the console is renamed." name:"admin-database" default:"fenceproxy"`
	// AdminAuthDatabase is the server database an --admin-users login is authenticated
	// against (the proxy relays the password exchange there, then closes that connection).
	AdminAuthDatabase string `help:"Server database the admin console authenticates --admin-users against (the password exchange is relayed there, as for every session, then that connection is closed): pg_hba.conf must let the users connect to it." name:"admin-auth-database" default:"postgres"`
	// DebugPprof also serves Go's profiler on MetricsListen (/debug/pprof/).
	DebugPprof bool `help:"Also serve Go's profiler at /debug/pprof/ on --metrics-listen (for performance work)."`
	// FlapChanges and FlapWindow define flapping: more than FlapChanges leader changes of a
	// resource within FlapWindow (0: 3 and 10 minutes).
	FlapChanges int           `help:"A resource flaps when its leader changes more than this many times within --flap-window." default:"3"`
	FlapWindow  time.Duration `help:"Window of --flap-changes." default:"10m"`

	// Consul configures token validation (see internal/lease).
	ConsulAddr   string `help:"Consul HTTP address; empty: tokens are not validated against Consul." name:"consul-addr"`
	ConsulToken  string `help:"Consul ACL token." name:"consul-token"`
	ConsulCAFile string `help:"CA file for TLS to Consul." name:"consul-ca-file" type:"path"`
	ConsulScheme string `help:"http or https." name:"consul-scheme" default:"http"`
	// ConsulStartTimeout bounds the check of Consul at start (Guard.Check). 0: 15 s.
	ConsulStartTimeout time.Duration `help:"At start, how long to wait for Consul to answer before exiting with the cause (an ACL refusal or a wrong scheme exits at once)." name:"consul-start-timeout" default:"15s"`
	// ConsulAnswerTimeout bounds the consistent read of Consul a session start waits for
	// (0: DefaultConsulAnswerTimeout); a Consul that does not answer within it refuses the
	// session (ZF007), well before the login timeout.
	ConsulAnswerTimeout time.Duration `help:"At a session start, how long to wait for Consul's answer before refusing the session (ZF007, naming Consul); keep it well under --login-timeout." name:"consul-answer-timeout" default:"2s"`
	ConsulDownMode      string        `help:"When Consul is unreachable: refuse (no new sessions; default) or trust-database (admit tokens not lower than the stored one; needs --control-database)." name:"consul-down" default:"refuse" enum:"refuse,trust-database"`
	// ConsulTokenMode says which number of a lock key is the token: lockindex (the
	// LockIndex, the default) or create-lock (CreateIndex×2^24+LockIndex, which stays
	// monotonic when the key is deleted and re-created; see lease.EncodeToken).
	ConsulTokenMode string `help:"Which number of the Consul lock key is the token: lockindex (its LockIndex; the key must never be deleted) or create-lock (CreateIndex*2^24+LockIndex: keeps growing when the key is deleted and re-created, as consul lock and api.Lock's Destroy do)." name:"consul-token-mode" default:"lockindex" enum:"lockindex,create-lock"`
	// ConsulRequireSession refuses Consul-validated sessions without fence.session (ZF003).
	ConsulRequireSession bool `help:"Refuse (ZF003) sessions of Consul-validated resources without fence.session: without the holder's session the proxy cannot tell two holders of one token apart when Consul issued it twice (lost its data) while no proxy watched." name:"consul-require-session"`
	// etcd configures token validation against etcd elections (a LockGuard over
	// internal/lease/etcd).
	EtcdEndpoints []string `help:"etcd client URLs (comma-separated), for --etcd-resource." name:"etcd-endpoints" sep:","`
	EtcdResources []string `help:"Resource validated against an etcd election, NAME=PREFIX (repeatable; NAME must also be given as --resource)." name:"etcd-resource" sep:","`
	// ZooKeeper configures token validation against ZooKeeper locks (a LockGuard over
	// internal/lease/zookeeper).
	ZKServers   []string `help:"ZooKeeper servers, host:port (comma-separated), for --zk-resource." name:"zk-servers" sep:","`
	ZKResources []string `help:"Resource validated against a ZooKeeper lock, NAME or NAME=PATH, PATH its lock folder (default /locks/NAME; repeatable; NAME must also be given as --resource)." name:"zk-resource" sep:","`
}

// Resource is a configured resource.
type Resource struct {
	Name string
	Key  string // Consul lock key, empty when not validated against Consul
	// Authority is who issues the resource's tokens: one of the lease.Store* names (consul,
	// postgres, etcd, zookeeper) or AuthorityBare.
	Authority string
}

// AuthorityBare is the authority of a resource no lock service validates: the database orders
// the tokens clients bring, and any client of the proxy may raise the resource's token.
const AuthorityBare = "bare"

// settings is the validated, defaulted form of Config.
type settings struct {
	Config
	resources []Resource
	names     []string
	upstream  upstreamSet
	clientTLS *tls.Config
	standbys  standby.Set
}

func (c Config) validate() (*settings, error) {
	s := &settings{Config: c}
	// 0 means the default; below it is a mistake, not a wish for the default.
	for _, n := range []struct {
		name     string
		negative bool
		value    any
	}{
		{"max-clients", c.MaxClients < 0, c.MaxClients},
		{"max-message-size", c.MaxMessageSize < 0, c.MaxMessageSize},
		{"login-timeout", c.LoginTimeout < 0, c.LoginTimeout},
		{"connect-timeout", c.ConnectTimeout < 0, c.ConnectTimeout},
		{"shutdown-grace", c.ShutdownGrace < 0, c.ShutdownGrace},
		{"flap-changes", c.FlapChanges < 0, c.FlapChanges},
		{"flap-window", c.FlapWindow < 0, c.FlapWindow},
		{"consul-start-timeout", c.ConsulStartTimeout < 0, c.ConsulStartTimeout},
		{"consul-answer-timeout", c.ConsulAnswerTimeout < 0, c.ConsulAnswerTimeout},
		{"standby-flush-timeout", c.StandbyFlushTimeout < 0, c.StandbyFlushTimeout},
		{"upstream-check-interval", c.UpstreamCheckInterval < 0, c.UpstreamCheckInterval},
	} {
		if n.negative {
			return nil, fmt.Errorf("%s %v: must not be negative", n.name, n.value)
		}
	}
	if s.Listen == "" {
		s.Listen = DefaultListen
	}
	if s.StaleWait <= 0 {
		s.StaleWait = staleWait
	}
	if s.StaleLinger <= 0 {
		s.StaleLinger = staleLinger
	}
	if s.MaxMessageSize <= 0 {
		s.MaxMessageSize = wire.DefaultMaxMessageSize
	}
	if s.LoginTimeout <= 0 {
		s.LoginTimeout = 15 * time.Second
	}
	if s.ConnectTimeout <= 0 {
		s.ConnectTimeout = 5 * time.Second
	}
	if s.ConsulAnswerTimeout <= 0 {
		s.ConsulAnswerTimeout = DefaultConsulAnswerTimeout
	}
	if s.MaxClients <= 0 {
		s.MaxClients = 1000
	}
	if s.ShutdownGrace <= 0 {
		s.ShutdownGrace = 30 * time.Second
	}
	if s.FlapChanges <= 0 {
		s.FlapChanges = 3
	}
	if s.FlapWindow <= 0 {
		s.FlapWindow = 10 * time.Minute
	}
	if s.AdminDatabase == "" {
		s.AdminDatabase = DefaultAdminDatabase
	}
	if s.AdminAuthDatabase == "" {
		s.AdminAuthDatabase = "postgres"
	}
	if s.AdminDatabase == s.AdminAuthDatabase {
		return nil, fmt.Errorf("admin-database %q is also --admin-auth-database: the console would hide the database its users authenticate against; rename one", s.AdminDatabase)
	}
	switch s.Relay {
	case "":
		s.Relay = "loop"
	case "loop", "goroutines":
	default:
		return nil, fmt.Errorf("relay: %q is not loop or goroutines", s.Relay)
	}
	switch s.ConsulDownMode {
	case "":
		s.ConsulDownMode = ConsulDownRefuse
	case ConsulDownRefuse, ConsulDownTrustDatabase:
	default:
		return nil, fmt.Errorf("consul-down: %q is not refuse or trust-database", s.ConsulDownMode)
	}
	if s.ConsulDownMode == ConsulDownTrustDatabase && s.ControlDatabase == "" {
		// Without the listener nothing tells the proxy of a failover, after which the
		// database's word may be a lost timeline's: a review's stale token was admitted on
		// the database's word after an asynchronous failover while Consul was down (F3).
		return nil, errors.New("consul-down trust-database needs --control-database: the proxy admits on the database's word only while it knows the database did not fail over, which the control database's listener tells it (docs/consul.md)")
	}
	if _, err := lease.ParseTokenMode(s.ConsulTokenMode); err != nil {
		return nil, fmt.Errorf("consul-token-mode: %w", err)
	}
	switch s.Unfenced {
	case "":
		s.Unfenced = UnfencedReject
	case UnfencedReject, UnfencedReadOnly, UnfencedAllow:
	default:
		return nil, fmt.Errorf("unfenced: %q is not reject, readonly or allow", s.Unfenced)
	}
	if err := s.declareResources(); err != nil {
		return nil, err
	}
	if len(s.Key) == 0 && s.KeyFile != "" {
		k, err := fence.LoadKey(s.KeyFile)
		if err != nil {
			return nil, err
		}
		s.Key = k
	}
	if len(s.resources) > 0 && len(s.Key) == 0 {
		return nil, errors.New("key-file is required with resource: fenced sessions are bound with the proxy key (fenceproxy migrate --key-file creates the file and stores the key in the database)")
	}
	var err error
	if s.standbys, err = standby.Parse(s.FailoverStandbys); err != nil {
		return nil, err
	}
	if !s.standbys.Empty() && s.ControlDatabase == "" {
		return nil, errors.New("failover-standbys needs control-database: the proxy reads the standbys' flush positions there (a role with pg_read_all_stats, or name slots: slot:NAME, slot:*)")
	}
	if s.StandbyFlushTimeout <= 0 {
		s.StandbyFlushTimeout = standby.DefaultTimeout
	}
	if s.upstream, err = parseUpstream(s.Upstream, s.UpstreamSSLMode, s.UpstreamSSLRootCert); err != nil {
		return nil, err
	}
	if len(s.upstream.hosts) > 1 && len(s.resources) > 0 && s.ControlDatabase == "" {
		return nil, fmt.Errorf("upstream lists %d hosts: that needs control-database (a URL of a database on them, with a role that may connect to every host): the proxy reads there which host is the writable primary before a fenced session starts, since it cannot replay a client's authentication on another host", len(s.upstream.hosts))
	}
	if s.UpstreamCheckInterval <= 0 {
		s.UpstreamCheckInterval = time.Second
	}
	if (s.TLSCert == "") != (s.TLSKey == "") {
		return nil, errors.New("tls-cert and tls-key go together")
	}
	if s.TLSCert != "" {
		cert, err := tls.LoadX509KeyPair(s.TLSCert, s.TLSKey)
		if err != nil {
			return nil, fmt.Errorf("client TLS: %w", err)
		}
		s.clientTLS = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	}
	return s, nil
}

// declareResources fills s.resources from --resource and --lease-resource, each with its
// authority: Consul for NAME=KEY, the PostgreSQL lease, etcd or ZooKeeper when the resource is
// one of theirs, bare otherwise. A resource has one authority.
func (s *settings) declareResources() error {
	named := func(specs []string) map[string]bool {
		m := map[string]bool{}
		for _, spec := range specs {
			name, _, _ := strings.Cut(spec, "=")
			m[name] = true
		}
		return m
	}
	leased, etcd, zk := named(s.LeaseResources), named(s.EtcdResources), named(s.ZKResources)
	add := func(name, key string) error {
		if !fence.ValidResource(name) {
			return fmt.Errorf("resource %q: the name must match ^[a-z][a-z0-9_.-]{0,62}$", name)
		}
		for _, x := range s.resources {
			if x.Name == name {
				return fmt.Errorf("resource %q configured twice", name)
			}
		}
		r := Resource{Name: name, Key: key, Authority: AuthorityBare}
		var by []string
		if key != "" {
			r.Authority, by = lease.StoreConsul, append(by, "a Consul key ("+key+")")
		}
		if leased[name] {
			r.Authority, by = lease.StorePostgres, append(by, "--lease-resource")
		}
		if etcd[name] {
			r.Authority, by = lease.StoreEtcd, append(by, "--etcd-resource")
		}
		if zk[name] {
			r.Authority, by = lease.StoreZooKeeper, append(by, "--zk-resource")
		}
		if len(by) > 1 {
			return fmt.Errorf("resource %q is declared with %s: a resource's tokens come from one lock service; keep one", name, strings.Join(by, " and "))
		}
		s.resources = append(s.resources, r)
		s.names = append(s.names, name)
		return nil
	}
	for _, r := range s.Resources {
		name, key, _ := strings.Cut(r, "=")
		if err := add(name, key); err != nil {
			return err
		}
	}
	for _, name := range s.LeaseResources {
		if slices.Contains(s.names, name) {
			continue // also given as --resource NAME
		}
		if err := add(name, ""); err != nil {
			return fmt.Errorf("lease-resource: %w", err)
		}
	}
	return nil
}

// Validated is c validated and defaulted (the defaults of its zero fields filled in, the key
// file read), with its resources: what a guard built outside the proxy reads
// (internal/proxy/guards).
func (c Config) Validated() (Config, []Resource, error) {
	s, err := c.validate()
	if err != nil {
		return Config{}, nil, err
	}
	return s.Config, s.resources, nil
}

// authority is resource's declared authority ("" when the proxy does not serve it).
func (l *live) authority(resource string) string {
	for _, r := range l.resources {
		if r.Name == resource {
			return r.Authority
		}
	}
	return ""
}
