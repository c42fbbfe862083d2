package proxy

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// Admitter validates a session's credentials against an authority outside
// the database (a lock service's Guard) before the proxy binds the session. A nil Admitter
// admits every well-formed token; the database's bind still orders them.
// Tokens of the PostgreSQL lease need no Admitter: fence.bind itself checks
// them against the lease row (migration 5), in the bind's own statement.
type Admitter interface {
	Admit(ctx context.Context, c fence.Credentials) error
}

// upstreamSwitcher is an Admitter told when the control connection finds a new server or
// timeline behind --upstream (before the registry forgets the lost timeline's tokens).
type upstreamSwitcher interface {
	UpstreamSwitched()
}

// HolderAdmitter is an Admitter that names the holder of the lock whose token it admitted
// (every Guard: the Consul session, etcd's lease, ZooKeeper's session). The session's bind then records (token, holder) in its own
// database before it binds (fence.ConsulBindQuery), and asks Judge what a record that does
// not admit them means: one token is admitted to one holder only, in every database, with or
// without a control database.
type HolderAdmitter interface {
	Admitter
	// AdmitHolder is Admit, returning the holder ("" when it names none: bind as usual).
	AdmitHolder(ctx context.Context, c fence.Credentials) (holder string, err error)
	// Judge says why the database's record rec refuses token of resource, shown held by
	// holder (a stale token: ZF001; a number issued twice or gone back: ZF007).
	Judge(ctx context.Context, resource string, token int64, holder string, rec fence.ConsulRecord) error
}

// Options are the optional collaborators of a Server. The zero value is valid.
type Options struct {
	// Logger receives the proxy's logs (nil: no logs).
	Logger *zap.Logger
	// Metrics records the proxy's metrics (nil: none).
	Metrics *Metrics
	// Registry is the per-resource highest known token (nil: a new one).
	// Share it with the LISTEN watcher and the Consul watcher.
	Registry *fence.Registry
	// Admitter validates tokens at session start (nil: no external validation).
	Admitter Admitter
	// Registerer receives the leadership metrics, read from the registry when scraped
	// (nil: none).
	Registerer prometheus.Registerer
	// Version is what the admin console's SHOW VERSION says ("": unknown).
	Version string
	// Reload is what the admin console's RELOAD runs: what SIGHUP does (fenceproxy serve reads
	// its configuration again and calls Server.Reload). It returns what was applied and what
	// needs a restart. Nil: RELOAD is refused (a program embedding the proxy has no
	// configuration to read again).
	Reload func() (applied, skipped []string, err error)
	// LookupHost resolves the names of --upstream's hosts, at every session start (nil: the
	// system's resolver). Tests and programs that embed the proxy set it.
	LookupHost func(ctx context.Context, host string) ([]string, error)
}

// Server is a running proxy.
type Server struct {
	// cfg is the configuration at startup; live (conf) its part a reload may change, which
	// is read from there and not from cfg.
	cfg     *settings
	live    atomic.Pointer[live]
	log     *zap.Logger
	metrics *Metrics
	reg     *fence.Registry
	admit   Admitter
	// control is the pool of --control-database (nil: none), on which a
	// session whose backend the server ended asks whether a raise ended it
	// (explainServerEnd); controlDB is its database's name. Serve also
	// LISTENs there (fence.Listen), and closes ready once it has synced.
	control   *pgxpool.Pool
	controlDB string
	ready     chan struct{}
	readyOnce sync.Once
	// listenSynced is true while the control database's listener is synced (readyz).
	listenSynced atomic.Bool
	// keyRefusals are the databases that refused the proxy key (keyRefused logs each once).
	keyRefusals sync.Map
	lead        *leadership
	version     string
	reload      func() (applied, skipped []string, err error)
	pause       pauseState

	clients    atomic.Int64
	sessionIDs atomic.Uint64 // for log correlation
	mu         sync.Mutex
	sessions   map[*session]struct{}
	consoles   map[*session]struct{} // admin console connections, closed at shutdown
	draining   atomic.Bool
	wg         sync.WaitGroup

	// roles is what the proxy knows of each host of --upstream (upstream.go), in order.
	roles []hostRole
	// monitored is true once monitorHosts has read the hosts' roles (it runs with a control
	// database).
	monitored atomic.Bool
	// firstRound is closed once monitorHosts has read every host once (nil: no monitor).
	firstRound     chan struct{}
	firstRoundOnce sync.Once
	// movedCh is closed (and replaced) when the monitor reads a new primary (primaryMoved).
	movedMu     sync.Mutex
	movedCh     chan struct{}
	lastPrimary atomic.Pointer[primaryMark] // the primary the monitor read last (nil: none yet)
	// controlSystem is the control database's system identifier, as its listener read it.
	controlSystem atomic.Pointer[string]
	// controlBase is the control database's parsed settings (nil: none), for aimAtPrimary.
	controlBase *pgconn.Config
	// resolve resolves host names at each dial (nil: the system's resolver).
	resolve func(ctx context.Context, host string) ([]string, error)
}

// New validates cfg and returns a Server.
func New(cfg Config, opts Options) (*Server, error) {
	s, err := cfg.validate()
	if err != nil {
		return nil, err
	}
	srv := &Server{
		cfg:      s,
		log:      opts.Logger,
		metrics:  opts.Metrics,
		reg:      opts.Registry,
		admit:    opts.Admitter,
		sessions: map[*session]struct{}{},
		consoles: map[*session]struct{}{},
		ready:    make(chan struct{}),
		version:  opts.Version,
		reload:   opts.Reload,
		roles:    make([]hostRole, len(s.upstream.hosts)),
		movedCh:  make(chan struct{}),
		resolve:  opts.LookupHost,
	}
	srv.pause.init()
	srv.live.Store(newLive(s))
	if srv.log == nil {
		srv.log = zap.NewNop()
	}
	if srv.reg == nil {
		srv.reg = fence.NewRegistry()
	}
	srv.lead = newLeadership(srv)
	if opts.Registerer != nil {
		if err := opts.Registerer.Register(srv.lead); err != nil {
			return nil, fmt.Errorf("proxy: leadership metrics: %w", err)
		}
	}
	if s.ControlDatabase != "" && len(s.Key) > 0 {
		pc, err := pgxpool.ParseConfig(s.ControlDatabase)
		if err != nil {
			return nil, fmt.Errorf("proxy: control database: %w", err)
		}
		// Connections are made when a session ends, not now: a control
		// database that is down costs nothing until then.
		pc.MaxConns = 4
		pc.MaxConnIdleTime = time.Minute
		srv.controlBase = pc.ConnConfig.Config.Copy()
		pc.BeforeConnect = func(_ context.Context, cc *pgx.ConnConfig) error {
			srv.aimAtPrimary(&cc.Config)
			return nil
		}
		srv.controlDB = fence.DatabaseName(pc.ConnConfig)
		if srv.control, err = pgxpool.NewWithConfig(context.Background(), pc); err != nil {
			return nil, fmt.Errorf("proxy: control database: %w", err)
		}
		srv.firstRound = make(chan struct{})
	}
	return srv, nil
}

// Registry returns the server's token registry.
func (s *Server) Registry() *fence.Registry { return s.reg }

// Ready is closed once Serve has read the stored tokens of the control
// database and listens for its raises (at once without one).
func (s *Server) Ready() <-chan struct{} { return s.ready }

func (s *Server) markReady() { s.readyOnce.Do(func() { close(s.ready) }) }

// Addr is the configured listen address.
func (s *Server) Addr() string { return s.cfg.Listen }

// Serve accepts clients on ln until ctx is done. Then it stops accepting,
// closes sessions as soon as they are idle between transactions, gives the
// others ShutdownGrace to finish, closes what is left and returns nil.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	sessCtx, cancelSessions := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelSessions()
	if s.control != nil {
		listenCtx, stopListening := context.WithCancel(context.WithoutCancel(ctx))
		listening := make(chan struct{})
		go func() {
			defer close(listening)
			fence.FollowUpstream(listenCtx, s.cfg.ControlDatabase, s.reg, s.log, fence.Hooks{ //nolint:errcheck // returns when listenCtx ends
				Synced: func(synced bool) {
					s.listenSynced.Store(synced)
					if synced {
						s.markReady()
					}
				},
				// A failover: the registry was rebased on the new server's stored tokens.
				Changed: s.metrics.upstreamChange,
				// Before the rebase: an Admitter that admits on the database's word must stop first.
				Switching: func() {
					for _, g := range guards(s.admit) {
						if sw, ok := g.(upstreamSwitcher); ok {
							sw.UpstreamSwitched()
						}
					}
				},
				Prepare:  func(cc *pgx.ConnConfig) { s.aimAtPrimary(&cc.Config) },
				Identity: func(u fence.Upstream) { s.controlSystem.Store(&u.SystemID) },
				Moved:    s.moved,
			})
		}()
		go s.warnShadowed(listenCtx)
		monitoring := make(chan struct{})
		go func() {
			defer close(monitoring)
			s.monitorHosts(listenCtx)
		}()
		defer func() { stopListening(); <-listening; <-monitoring }()
	} else {
		s.markReady()
	}
	var acceptErr error
	for {
		conn, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				break
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				time.Sleep(10 * time.Millisecond)
				continue
			}
			acceptErr = err
			break
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.handle(sessCtx, conn)
		}()
	}
	s.drain(cancelSessions)
	if s.control != nil {
		s.control.Close()
	}
	return acceptErr
}

// warnShadowed warns when the server has a database of the admin console's name: clients of
// the proxy cannot reach it (they reach the console), which must not go unnoticed.
func (s *Server) warnShadowed(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	name := s.conf().adminDatabase
	var exists bool
	if err := s.control.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)", name).Scan(&exists); err != nil {
		s.log.Debug("could not check for a database of the admin console's name", zap.Error(err))
		return
	}
	if exists {
		s.log.Warn("the server has a database of the admin console's name: clients of the proxy reach the console, not that database; rename the console with --admin-database",
			zap.String("database", name))
	}
}

func (s *Server) drain(cancel context.CancelFunc) {
	s.draining.Store(true)
	s.mu.Lock()
	for sess := range s.sessions {
		sess.shutdownWhenIdle()
	}
	for c := range s.consoles {
		c.client.Close() // between commands or in one: the console holds nothing
	}
	n := len(s.sessions)
	s.mu.Unlock()
	s.pause.release() // sessions waiting for RESUME are refused now (login's draining check)
	grace := s.conf().shutdownGrace
	s.log.Info("shutting down", zap.Int("sessions", n), zap.Duration("grace", grace))
	done := make(chan struct{})
	go func() { s.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(grace):
		s.log.Warn("grace period over; closing remaining sessions")
		cancel()
		<-done
	}
}

func (s *Server) track(sess *session, add bool) {
	s.mu.Lock()
	if add {
		s.sessions[sess] = struct{}{}
	} else {
		delete(s.sessions, sess)
	}
	s.mu.Unlock()
	if add && s.draining.Load() {
		sess.shutdownWhenIdle()
	}
}

// upstreamTLS negotiates TLS on conn (SSLRequest, then the handshake).
func upstreamTLS(ctx context.Context, conn net.Conn, cfg *tls.Config) (net.Conn, error) {
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Now()) }) //nolint:errcheck
	defer stop()
	req := (&wire.Startup{Kind: wire.KindSSLRequest}).Encode(nil)
	if _, err := conn.Write(req); err != nil {
		conn.Close()
		return nil, err
	}
	var b [1]byte
	if _, err := io.ReadFull(conn, b[:]); err != nil {
		conn.Close()
		return nil, err
	}
	if b[0] != 'S' {
		conn.Close()
		return nil, fmt.Errorf("server refused TLS (answered %q) but upstream sslmode requires it", b[0])
	}
	tc := tls.Client(conn, cfg)
	if err := tc.HandshakeContext(ctx); err != nil {
		conn.Close()
		return nil, fmt.Errorf("TLS to server: %w", err)
	}
	conn.SetDeadline(time.Time{}) //nolint:errcheck
	return tc, nil
}

// forwardCancel relays a CancelRequest to the server and waits until the
// server has closed its side, so that the client learns nothing is pending.
func (s *Server) forwardCancel(ctx context.Context, req *wire.Startup) error {
	// The host of the session whose key it is; a session still starting is not tracked
	// yet: every host then (another host's backend has another secret key).
	hosts := []int{s.hostOf(req.ProcessID, req.SecretKey)}
	if hosts[0] < 0 {
		hosts = hosts[:0]
		for i := range s.cfg.upstream.hosts {
			hosts = append(hosts, i)
		}
	}
	var errs []error
	for _, i := range hosts {
		errs = append(errs, s.cancelOn(ctx, s.cfg.upstream.hosts[i], req))
	}
	return errors.Join(errs...)
}

func (s *Server) cancelOn(ctx context.Context, h upstreamHost, req *wire.Startup) error {
	up, err := s.dialHost(ctx, h)
	if err != nil {
		return err
	}
	defer up.Close()
	if _, err := up.Write(req.Encode(nil)); err != nil {
		return err
	}
	up.SetReadDeadline(time.Now().Add(s.cfg.ConnectTimeout)) //nolint:errcheck
	_, err = io.Copy(io.Discard, up)
	return err
}
