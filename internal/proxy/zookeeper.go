package proxy

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/go-zookeeper/zk"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/lease"
)

const (
	// zkReadTimeout bounds each read of a lock folder: a ZooKeeper that does not answer
	// within it is unreachable, and sessions are refused (ZF007) rather than kept waiting.
	zkReadTimeout = 5 * time.Second
	// zkSessionTimeout is the guard's own client session's; it holds no ephemeral node.
	zkSessionTimeout = 10 * time.Second
	// zkReconnectAfter failed reads in a row, the guard opens a new client session: a
	// server restored to an older state refuses a client that has seen later zxids, for
	// good.
	zkReconnectAfter = 3
)

// ZooKeeperGuard ties the proxy to ZooKeeper locks (lease.ZooKeeperStore, `fenceproxy lock
// --store zookeeper`, or any client of the lock recipe): it admits a session's token only
// when it is the czxid of the current holder's lock node (the lowest sequence number in
// the lock folder), read after a sync at session start (Admitter), and it fences
// proactively: a watch of each lock folder raises a new holder's token in the database at
// once (before the new holder connects). It fails closed (ZF007) when ZooKeeper cannot be
// read, and when its zxids went backwards (a restore from an old snapshot, a wiped data
// folder): a lock folder whose last child change (pzxid) is older than one seen before,
// or a holder whose token is below the one the database admitted.
//
// Like the other guards, ZooKeeper's word is needed to admit a token, never to keep the
// guarantee: the database's bind and raise order commits whatever the guard knows.
type ZooKeeperGuard struct {
	servers []string
	reg     *fence.Registry
	log     *zap.Logger
	dirs    map[string]string // resource -> lock folder
	pool    *pgxpool.Pool     // control database for proactive raises (nil: none)
	key     fence.Key
	metrics zkMetrics

	mu      sync.Mutex
	conn    *zk.Conn
	failed  int                     // reads failed in a row
	highest map[string]int64        // resource -> the highest pzxid of its folder read
	leaders map[string]zkHolder     // resource -> the newest lock holder read
	regress map[string]*fence.Error // resource -> why it fails closed
}

// zkHolder is a lock's holder: its node's czxid (the token; 0: none) and the session that
// owns the node (ephemeralOwner).
type zkHolder struct {
	token, owner int64
}

func (h zkHolder) holder() string { return fmt.Sprintf("zookeeper session %x", h.owner) }

type zkMetrics struct {
	regressions *prometheus.CounterVec
	raises      *prometheus.CounterVec
	known       *prometheus.GaugeVec
}

// ZooKeeperGuardOptions configure NewZooKeeperGuard.
type ZooKeeperGuardOptions struct {
	Logger     *zap.Logger
	Registry   *fence.Registry       // the server's
	Registerer prometheus.Registerer // for the guard's metrics (nil: none)
}

// NewZooKeeperGuard builds a ZooKeeperGuard for cfg's ZKResources (NAME or NAME=PATH, each
// NAME also a --resource without a Consul key). It returns nil, nil when there are none.
func NewZooKeeperGuard(ctx context.Context, cfg Config, opts ZooKeeperGuardOptions) (*ZooKeeperGuard, error) {
	if len(cfg.ZKResources) == 0 {
		return nil, nil
	}
	s, err := cfg.validate()
	if err != nil {
		return nil, err
	}
	if opts.Registry == nil {
		return nil, errors.New("proxy: NewZooKeeperGuard needs the server's registry")
	}
	if len(cfg.ZKServers) == 0 {
		return nil, errors.New("zk-resource needs zk-servers")
	}
	g := &ZooKeeperGuard{
		servers: cfg.ZKServers, reg: opts.Registry, log: opts.Logger, dirs: map[string]string{}, key: s.Key,
		highest: map[string]int64{}, leaders: map[string]zkHolder{}, regress: map[string]*fence.Error{},
	}
	if g.log == nil {
		g.log = zap.NewNop()
	}
	for _, spec := range cfg.ZKResources {
		name, dir, _ := strings.Cut(spec, "=")
		dir = lease.ZooKeeperLockDir(dir, name)
		if !strings.HasPrefix(dir, "/") {
			return nil, fmt.Errorf("zk-resource %q: want NAME or NAME=PATH with an absolute lock folder (that of fenceproxy lock --store zookeeper, e.g. billing=/locks/billing)", spec)
		}
		if err := plainResource(s, "zk-resource", spec, name); err != nil {
			return nil, err
		}
		g.dirs[name] = dir
	}
	store := prometheus.Labels{"store": lease.StoreZooKeeper}
	g.metrics = zkMetrics{
		regressions: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "fenceproxy_zookeeper_regressions_total", ConstLabels: store,
			Help: "ZooKeeper zxid regressions detected (a restore or a wiped data folder); the resource fails closed until the proxy restarts."}, []string{"resource"}),
		raises: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "fenceproxy_zookeeper_raises_total", ConstLabels: store,
			Help: "Tokens raised in the database when ZooKeeper showed a new lock holder, by outcome."}, []string{"resource", "outcome"}),
		known: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "fenceproxy_zookeeper_state_known", ConstLabels: store,
			Help: "1 when the lock's holder is known from ZooKeeper, 0 while ZooKeeper cannot be read."}, []string{"resource"}),
	}
	if opts.Registerer != nil {
		if err := errors.Join(opts.Registerer.Register(g.metrics.regressions), opts.Registerer.Register(g.metrics.raises),
			opts.Registerer.Register(g.metrics.known)); err != nil {
			return nil, fmt.Errorf("ZooKeeper guard metrics: %w", err)
		}
	}
	if g.conn, err = g.connect(); err != nil {
		return nil, err
	}
	if s.ControlDatabase != "" {
		if g.pool, err = newGuardPool(ctx, s.ControlDatabase, ""); err != nil {
			g.conn.Close()
			return nil, err
		}
	} else {
		g.log.Warn("no --control-database: a new ZooKeeper lock holder's token is raised in the database only when it connects",
			zap.String("store", lease.StoreZooKeeper))
	}
	return g, nil
}

func (g *ZooKeeperGuard) connect() (*zk.Conn, error) {
	return lease.ZooKeeperConnect(g.servers, zkSessionTimeout, g.log, nil)
}

// client returns the current client session.
func (g *ZooKeeperGuard) client() *zk.Conn {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.conn
}

// readFailed counts a failed read, and replaces the client session after zkReconnectAfter
// in a row.
func (g *ZooKeeperGuard) readFailed(conn *zk.Conn) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if conn != g.conn {
		return // replaced already
	}
	if g.failed++; g.failed < zkReconnectAfter {
		return
	}
	fresh, err := g.connect()
	if err != nil {
		g.log.Warn("new ZooKeeper client", zap.String("store", lease.StoreZooKeeper), zap.Error(err))
		return
	}
	g.log.Info("ZooKeeper unreadable; new client session", zap.String("store", lease.StoreZooKeeper), zap.Int("failed_reads", g.failed))
	g.conn.Close()
	g.conn, g.failed = fresh, 0
}

// holder reads res's lock folder after a sync (so that the read reflects every write
// acknowledged before it): the czxid of the lowest lock node (0: nobody holds the lock)
// and, with watch, a channel that fires when the folder's children change (or, while the
// folder is missing, when it is created). A folder whose pzxid is below one read before is
// a regression, and fails the resource closed.
func (g *ZooKeeperGuard) holder(ctx context.Context, res string, watch bool) (zkHolder, <-chan zk.Event, error) {
	dir := g.dirs[res]
	conn := g.client()
	rctx, cancel := context.WithTimeout(ctx, zkReadTimeout)
	defer cancel()
	// Written by the call; read only when it returned (not after a timeout).
	var h zkHolder
	var wch <-chan zk.Event
	err := lease.ZooKeeperCall(rctx, func() error {
		if _, err := conn.Sync(dir); err != nil && !errors.Is(err, zk.ErrNoNode) {
			return fmt.Errorf("sync %s: %w", dir, err)
		}
		for range 3 { // the lowest node may go between the listing and its read
			var children []string
			var st *zk.Stat
			var err error
			if watch {
				children, st, wch, err = conn.ChildrenW(dir)
			} else {
				children, st, err = conn.Children(dir)
			}
			if errors.Is(err, zk.ErrNoNode) { // no folder: nobody ever took the lock
				h = zkHolder{}
				if !watch {
					return nil
				}
				var exists bool
				if exists, _, wch, err = conn.ExistsW(dir); err == nil && exists {
					continue // created in between
				}
				return err
			}
			if err != nil {
				return fmt.Errorf("list %s: %w", dir, err)
			}
			g.checkPzxid(res, st.Pzxid)
			locks := lease.ZooKeeperLockOrder(children)
			if len(locks) == 0 {
				h = zkHolder{}
				return nil
			}
			ok, hst, err := conn.Exists(dir + "/" + locks[0])
			if err != nil {
				return fmt.Errorf("read %s/%s: %w", dir, locks[0], err)
			}
			if ok {
				h = zkHolder{token: hst.Czxid, owner: hst.EphemeralOwner}
				return nil
			}
		}
		return fmt.Errorf("the lowest node of %s keeps changing", dir)
	})
	if err != nil {
		g.readFailed(conn)
		g.metrics.known.WithLabelValues(res).Set(0)
		return zkHolder{}, nil, err
	}
	g.mu.Lock()
	if g.conn == conn {
		g.failed = 0
	}
	// One token, one holder: a czxid names one node, and so one session. The same czxid
	// owned by another session means ZooKeeper issued the number twice (it lost its data
	// and its zxids came up again to a token already admitted).
	switch prev := g.leaders[res]; {
	case h.token > 0 && prev.token == h.token && prev.owner != h.owner:
		g.failClosed(res, fmt.Sprintf("ZooKeeper issued zxid %d twice: to the lock node of session %x, then of session %x", h.token, prev.owner, h.owner))
	case h.token > prev.token:
		g.leaders[res] = h
	}
	g.mu.Unlock()
	g.metrics.known.WithLabelValues(res).Set(1)
	return h, wch, nil
}

// checkPzxid fails res closed when its folder's pzxid went back.
func (g *ZooKeeperGuard) checkPzxid(res string, pzxid int64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if pzxid < g.highest[res] {
		g.failClosed(res, fmt.Sprintf("the last change to the lock folder %s went from zxid %d to %d (a restore from an old snapshot, or a wiped data folder?)",
			g.dirs[res], g.highest[res], pzxid))
		return
	}
	g.highest[res] = pzxid
}

// failClosed blocks res for good (until the proxy restarts), with g.mu held.
func (g *ZooKeeperGuard) failClosed(res, why string) {
	if g.regress[res] != nil {
		return
	}
	// A Regression (IsRegression), so that the session reports it even to a token below the
	// highest admitted one, worded for ZooKeeper.
	fe := fence.Regression(res, why)
	fe.Message = fence.Unavailable(res, "ZooKeeper's zxids went backwards: "+why).Message
	fe.Hint = "Tokens (czxids) from this ZooKeeper are no longer above those the database admitted: reset the resource's fence (`fenceproxy fence reset --resource " +
		res + " --token <the new holder's czxid> --database <the protected database's URL>`) once the old holders are stopped, then restart the proxies (docs/zookeeper.md: What a restore does)."
	g.regress[res] = fe
	g.metrics.regressions.WithLabelValues(res).Inc()
	g.log.Error("failing closed: ZooKeeper zxid regression", zap.String("resource", res), zap.String("store", lease.StoreZooKeeper), zap.String("why", why))
	g.reg.Block(res, fe)
}

func (g *ZooKeeperGuard) regression(res string) *fence.Error {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.regress[res]
}

// Authority names what the guard validates resource's tokens against ("": none), for hints.
func (g *ZooKeeperGuard) Authority(resource string) string {
	if d, ok := g.dirs[resource]; ok {
		return fmt.Sprintf("ZooKeeper lock folder %q", d)
	}
	return ""
}

// Validates reports whether the guard checks resource's tokens (see session.admit): the
// guard, not the registry's highest token, then decides, so that a regression is told as
// such (ZF007) also to a token below the highest admitted one.
func (g *ZooKeeperGuard) Validates(resource string) bool {
	_, ok := g.dirs[resource]
	return ok
}

// Admit implements Admitter: the token must be the czxid of the current holder's lock node.
func (g *ZooKeeperGuard) Admit(ctx context.Context, c fence.Credentials) error {
	_, err := g.AdmitHolder(ctx, c)
	return err
}

// AdmitHolder implements HolderAdmitter: Admit, naming the session that owns the lock node,
// so that the session's bind records (token, session) in its own database (one token, one
// holder, with or without --control-database; Judge says what a record that refuses means).
func (g *ZooKeeperGuard) AdmitHolder(ctx context.Context, c fence.Credentials) (string, error) {
	if _, ok := g.dirs[c.Resource]; !ok {
		return "", nil
	}
	h, _, err := g.holder(ctx, c.Resource, false)
	if fe := g.regression(c.Resource); fe != nil {
		return "", fe
	}
	if err := admitHolder(c, h.token, err, holderWords{
		store: "ZooKeeper",
		noHolder: fmt.Sprintf("the ZooKeeper lock folder %s of resource %q has no lock node (token %d); the holder's session expired or it released the lock",
			g.dirs[c.Resource], c.Resource, c.Token),
		noHolderHint: "Take the lock again and use the new lock node's czxid.",
		current:      "the czxid %d of ZooKeeper's current lock node",
		currentHint:  "Use the czxid of the lock node this process holds the lock with (its Stat after creating it).",
		holder:       fmt.Sprintf("%x", h.owner),
		holderKind:   "ZooKeeper session",
	}); err != nil {
		return "", err
	}
	return h.holder(), nil
}

// Judge implements HolderAdmitter: what a record rec of the database that does not admit
// token, which ZooKeeper showed held by holder, means for res: a regression recorded (or
// the same token recorded for another session) fails the resource closed; a higher token
// recorded is stale when ZooKeeper now shows a holder at or above it, and a regression
// otherwise.
func (g *ZooKeeperGuard) Judge(ctx context.Context, res string, token int64, holder string, rec fence.ConsulRecord) error {
	current := func() (int64, error) {
		h, _, err := g.holder(ctx, res, false)
		return h.token, err
	}
	return judgeRecord(res, token, holder, rec, "ZooKeeper", current, func(why string) error {
		g.mu.Lock()
		g.failClosed(res, why)
		g.mu.Unlock()
		return g.regression(res)
	})
}

// Run watches every lock folder until ctx ends, raising each new holder's token.
func (g *ZooKeeperGuard) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	for res := range g.dirs {
		wg.Go(func() { g.follow(ctx, res) })
	}
	wg.Wait()
	if g.pool != nil {
		g.pool.Close()
	}
	g.client().Close()
	return nil
}

// follow reads res's lock folder, reacts, and waits for the next change of its children.
func (g *ZooKeeperGuard) follow(ctx context.Context, res string) {
	log := g.log.With(zap.String("resource", res), zap.String("store", lease.StoreZooKeeper))
	for ctx.Err() == nil {
		h, wch, err := g.holder(ctx, res, true)
		token := h.token
		if err != nil {
			log.Warn("read ZooKeeper lock folder", zap.String("folder", g.dirs[res]), zap.Error(err))
			sleep(ctx, time.Second)
			continue
		}
		if token > 0 && g.regression(res) == nil {
			g.observe(ctx, res, token, log)
		}
		select {
		case <-ctx.Done():
		case <-wch: // a change, or the watch ended (connection lost): read again
		}
	}
}

// observe raises a holder's token that is new to this proxy. A holder's token below the
// highest known one is a regression when the database has admitted a higher one.
func (g *ZooKeeperGuard) observe(ctx context.Context, res string, token int64, log *zap.Logger) {
	highest := g.reg.Highest("", res)
	if token == highest {
		return
	}
	// Sessions of older tokens are ended from now on, in every database; the database
	// raise makes it binding for every proxy.
	g.reg.Observe("", res, token)
	if g.pool == nil {
		if token < highest {
			g.mu.Lock()
			g.failClosed(res, fmt.Sprintf("this proxy saw a lock holder with token %d, and now one whose node was created at zxid %d", highest, token))
			g.mu.Unlock()
		}
		return
	}
	stored, err := raiseStored(ctx, g.pool, g.key, res, token)
	switch {
	case err != nil:
		g.metrics.raises.WithLabelValues(res, "error").Inc()
		log.Error("proactive raise failed; the new holder's token is raised when it connects", zap.Int64("token", token), zap.Error(err))
	case stored > token:
		g.metrics.raises.WithLabelValues(res, "regression").Inc()
		g.mu.Lock()
		g.failClosed(res, fmt.Sprintf("the database admitted token %d but ZooKeeper's lock holder's node was created at zxid %d", stored, token))
		g.mu.Unlock()
	default:
		g.metrics.raises.WithLabelValues(res, "raised").Inc()
		log.Info("raised token for the new lock holder", zap.Int64("token", token))
	}
}
