package proxy

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/lease"
)

// LockGuard ties the proxy to a lock service that answers as a lease.Authority (etcd
// elections, ZooKeeper locks): it admits a session's token only when it is the token of the
// lock's current holder, read linearizably at session start (Admitter), and it fences
// proactively: it follows each lock and raises a new holder's token in the database at once
// (before the new holder connects). It fails closed (ZF007, a Regression) when the service's
// numbers went backwards: the service says so (a restore), the same token shows another
// holder (the service issued it twice), or a holder's token is below one the database
// admitted.
//
// One token, one holder: the guard remembers the holder of each resource it read, and with
// --control-database records every admitted (token, holder) in the database
// (fence.consul_admit, migration 7's C1-C3: the same record the Consul Guard keeps), before
// it admits or raises the token, where every proxy and a restarted one see it; without a
// control database only its own memory guards against it. The session's bind records the
// pair in the protected database too (fence.ConsulBindQuery).
//
// The service's word is needed to admit a token, never to keep the guarantee: the
// database's bind and raise order commits whatever the guard knows.
type LockGuard struct {
	svc       lease.Authority
	reg       *fence.Registry
	log       *zap.Logger
	resources map[string]bool
	pool      *pgxpool.Pool // control database for proactive raises (nil: none)
	key       fence.Key
	metrics   lockMetrics

	mu      sync.Mutex
	leaders map[string]lease.Holder // resource -> the newest holder read
	regress map[string]*fence.Error // resource -> why it fails closed
}

type lockMetrics struct {
	regressions *prometheus.CounterVec
	raises      *prometheus.CounterVec
	known       *prometheus.GaugeVec
}

// LockGuardOptions configure NewLockGuard.
type LockGuardOptions struct {
	Logger     *zap.Logger
	Registry   *fence.Registry       // the server's
	Registerer prometheus.Registerer // for the guard's metrics (nil: none)
}

// resourceFlags name the flag that makes a resource a service's, in errors.
var resourceFlags = map[string]string{lease.StoreEtcd: "etcd-resource", lease.StoreZooKeeper: "zk-resource"}

// NewLockGuard builds a LockGuard for svc's resources, each a --resource of cfg. The guard
// closes svc when its Run ends.
func NewLockGuard(ctx context.Context, cfg Config, svc lease.Authority, opts LockGuardOptions) (*LockGuard, error) {
	s, err := cfg.validate()
	if err != nil {
		return nil, err
	}
	if opts.Registry == nil {
		return nil, errors.New("proxy: NewLockGuard needs the server's registry")
	}
	store := svc.Store()
	g := &LockGuard{svc: svc, reg: opts.Registry, log: opts.Logger, resources: map[string]bool{}, key: s.Key,
		leaders: map[string]lease.Holder{}, regress: map[string]*fence.Error{}}
	if g.log == nil {
		g.log = zap.NewNop()
	}
	g.log = g.log.With(zap.String("store", store))
	for _, name := range svc.Resources() {
		if !slices.Contains(s.names, name) { // one authority a resource: validate checked
			return nil, fmt.Errorf("%s %q: %s is not a --resource", resourceFlags[store], name, name)
		}
		g.resources[name] = true
	}
	service := svc.Words("").Service
	labels := prometheus.Labels{"store": store}
	g.metrics = lockMetrics{
		regressions: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "fenceproxy_" + store + "_regressions_total", ConstLabels: labels,
			Help: service + " token regressions detected (a restore, or lost data); the resource fails closed until it is reset and the proxy restarts."}, []string{"resource"}),
		raises: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "fenceproxy_" + store + "_raises_total", ConstLabels: labels,
			Help: "Tokens raised in the database when " + service + " showed a new lock holder, by outcome."}, []string{"resource", "outcome"}),
		known: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "fenceproxy_" + store + "_state_known", ConstLabels: labels,
			Help: "1 when the lock's holder is known from " + service + ", 0 while " + service + " cannot be read."}, []string{"resource"}),
	}
	if opts.Registerer != nil {
		if err := errors.Join(opts.Registerer.Register(g.metrics.regressions), opts.Registerer.Register(g.metrics.raises),
			opts.Registerer.Register(g.metrics.known)); err != nil {
			return nil, fmt.Errorf("%s guard metrics: %w", service, err)
		}
	}
	if s.ControlDatabase != "" {
		if g.pool, err = fence.NewGuardPool(ctx, s.ControlDatabase, ""); err != nil {
			return nil, err
		}
	} else {
		g.log.Warn("no --control-database: a new " + service + " lock holder's token is raised in the database only when it connects")
	}
	return g, nil
}

// read reads res's lock and takes in what the reading shows (saw).
func (g *LockGuard) read(ctx context.Context, res string) (lease.Holder, error) {
	r, err := g.svc.Read(ctx, res)
	g.saw(res, r, err)
	return r.Holder, err
}

// saw takes in a reading of res: a regression the service tells, or the same token with
// another holder (the service issued the number twice: it lost its data and its numbers
// came up again to a token already admitted), fails res closed.
func (g *LockGuard) saw(res string, r lease.Reading, err error) {
	if err != nil {
		g.metrics.known.WithLabelValues(res).Set(0)
		return
	}
	g.metrics.known.WithLabelValues(res).Set(1)
	g.mu.Lock()
	defer g.mu.Unlock()
	if r.Regression != "" {
		g.failClosed(res, r.Regression)
	}
	switch prev := g.leaders[res]; {
	case r.Token > 0 && prev.Token == r.Token && prev.Session != r.Session:
		g.failClosed(res, fmt.Sprintf("%s issued token %d twice: to %s, then to %s (it lost its data and its numbers came up again?)",
			g.svc.Words(res).Service, r.Token, prev.Name, r.Name))
	case r.Token > prev.Token:
		g.leaders[res] = r.Holder
	}
}

// failClosed blocks res for good (until the proxy restarts), with g.mu held, and records
// the regression in the database (fence.consul_regress), where every proxy and a restarted
// one see it (fence.consul_admit answers with it) until fence reset.
func (g *LockGuard) failClosed(res, why string) {
	if g.regress[res] != nil {
		return
	}
	w := g.svc.Words(res)
	// A Regression (IsRegression), so that the session reports it even to a token below the
	// highest admitted one, worded for the service.
	fe := fence.Regression(res, why)
	fe.Message = fence.Unavailable(res, w.Regressed+": "+why).Message
	fe.Hint = w.RegressionHint
	g.regress[res] = fe
	g.metrics.regressions.WithLabelValues(res).Inc()
	g.log.Error("failing closed: "+w.Service+" token regression", zap.String("resource", res), zap.String("why", why))
	g.reg.Block(res, fe)
	go g.persist(res, max(g.leaders[res].Token, 1), why) // g.mu is held: not here
}

// persist records a regression this proxy found in the database (fence.consul_regress).
func (g *LockGuard) persist(res string, token int64, reason string) {
	if g.pool == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := g.key.RegressOnControl(ctx, g.pool, res, token, reason); err != nil {
		g.log.Error("could not record the regression in the database; other proxies find it themselves", zap.String("resource", res), zap.Error(err))
	}
}

// closed fails res closed for reason and returns the error its sessions get.
func (g *LockGuard) closed(res, reason string) error {
	g.mu.Lock()
	g.failClosed(res, reason)
	g.mu.Unlock()
	return g.regression(res)
}

func (g *LockGuard) regression(res string) *fence.Error {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.regress[res]
}

// record is the database's part of admitting h, the holder the service just showed for
// res (fence.consul_admit records (token, holder), and answers with a regression some proxy
// recorded, or with a higher token recorded since: Judge says what that means). Without a
// control database there is no record, only this process's memory.
func (g *LockGuard) record(ctx context.Context, res string, h lease.Holder) error {
	if g.pool == nil {
		return nil
	}
	rec, err := g.key.AdmitOnControl(ctx, g.pool, res, h.Token, h.Name)
	if err != nil || rec.Admits(h.Token, h.Name) {
		return err
	}
	return g.Judge(ctx, res, h.Token, h.Name, rec)
}

// Judge implements HolderAdmitter: what a record rec of the database that does not admit
// token, which the service showed held by holder, means for res. A recorded regression, or
// the same token recorded for another holder (consul_admit turns that into one), fails the
// resource closed. A higher recorded token is either a newer holder (the service's answer
// was behind: stale, ZF001) or the service's numbers went back below an admitted token
// (fail closed): a read started now tells them apart (the Consul Guard's judge reasons the
// same way).
func (g *LockGuard) Judge(ctx context.Context, res string, token int64, holder string, rec fence.ConsulRecord) error {
	service := g.svc.Words(res).Service
	switch {
	case rec.Regression != "":
		return g.closed(res, rec.Regression)
	case rec.Token <= token:
		// Not an answer consul_admit gives (one number with two holders is a regression).
		return fence.Unavailable(res, fmt.Sprintf("the database recorded token %d of %s for token %d of %s", rec.Token, rec.Holder, token, holder))
	}
	if fe := rec.MovedFrom(res, token, service); fe != nil {
		return fe // led through another lock service: refused, not a regression
	}
	cur, err := g.read(ctx, res)
	if err != nil {
		return unknownState(res, service, err)
	}
	if cur.Token >= rec.Token {
		return fence.Stale(res, token, rec.Token)
	}
	return g.closed(res, fmt.Sprintf("the database admitted token %d (%s) but %s's current holder has token %d", rec.Token, rec.Holder, service, cur.Token))
}

// Admit implements Admitter: the token must be the current holder's.
func (g *LockGuard) Admit(ctx context.Context, c fence.Credentials) error {
	_, err := g.AdmitHolder(ctx, c)
	return err
}

// AdmitHolder implements HolderAdmitter: Admit, naming the holder, so that the session's
// bind records (token, holder) in its own database (one token, one holder, with or without
// --control-database), once the control database's record agrees.
func (g *LockGuard) AdmitHolder(ctx context.Context, c fence.Credentials) (string, error) {
	if !g.resources[c.Resource] {
		return "", nil
	}
	h, err := g.read(ctx, c.Resource)
	if fe := g.regression(c.Resource); fe != nil {
		return "", fe
	}
	if err := admitHolder(c, h, err, g.svc.Words(c.Resource)); err != nil {
		return "", err
	}
	return h.Name, g.record(ctx, c.Resource, h)
}

// admitHolder is a guard's answer to c given the service's current holder h (Token 0: the
// lock is not held) or why it could not be read.
//
// One token, one holder, also when nothing recorded the first one: the session must name
// the holder (fence.session), and only the current holder is admitted. A store that lost
// its data (a wipe, a restore) can issue a number again to another holder while no proxy
// watches; the stale holder of the first issue presents the same token, and without its
// holder's ID the proxy cannot tell the two apart (a review had both commit, 6 runs of 6).
func admitHolder(c fence.Credentials, h lease.Holder, err error, w lease.Words) error {
	switch current := h.Token; {
	case err != nil:
		return unknownState(c.Resource, w.Service, err)
	case current == 0:
		fe := fence.NotHeld(c.Resource, c.Token)
		fe.Message = "fencing lock not held: " + fmt.Sprintf(w.NoHolder, c.Token)
		fe.Hint = w.NoHolderHint
		return fe
	case c.Token < current:
		return fence.Stale(c.Resource, c.Token, current)
	case c.Token > current:
		fe := fence.NotIssued(c.Resource, c.Token, current)
		fe.Message = fmt.Sprintf("fencing token not issued: resource %q token %d is higher than "+w.Current, c.Resource, c.Token, current)
		fe.Hint = w.CurrentHint
		return fe
	case c.Session == "":
		return &fence.Error{Code: fence.CodeMissing, Resource: c.Resource, Token: c.Token,
			Message: fmt.Sprintf("fencing session missing: resource %q is validated by %s, and a session must name its lock's holder: set fence.session to the %s ID (hex) this process holds the lock with", c.Resource, w.Service, w.HolderKind),
			Hint:    "fenceproxy lock puts it in DATABASE_URL and FENCE_SESSION; see docs/applications.md."}
	case !strings.EqualFold(c.Session, h.Session):
		fe := fence.HolderMismatch(c.Resource, c.Session, h.Session)
		fe.Message = fmt.Sprintf("fencing session mismatch: resource %q token %d is held by %s %s, not %s", c.Resource, c.Token, w.HolderKind, h.Session, c.Session)
		fe.Hint = fmt.Sprintf("This process is no longer the leader, or fence.session is not its %s ID in hex (FENCE_SESSION of fenceproxy lock; a newcomer passed it in decimal).", w.HolderKind)
		return fe
	}
	return nil
}

// unknownState is the refusal of a token of res while service cannot be read (err).
func unknownState(res, service string, err error) *fence.Error {
	return fence.Unavailable(res, service+"'s lock state is unknown ("+err.Error()+"); no token is admitted without "+service+"'s word")
}

// Run follows every resource's lock until ctx ends, raising each new holder's token.
func (g *LockGuard) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	for res := range g.resources {
		wg.Go(func() {
			g.svc.Follow(ctx, res, func(r lease.Reading, err error) {
				g.saw(res, r, err)
				if err != nil {
					g.log.Warn("read "+g.svc.Words(res).Service+" lock", zap.String("resource", res), zap.Error(err))
					return
				}
				if r.Token > 0 && g.regression(res) == nil {
					g.observe(ctx, res, r.Holder)
				}
			})
		})
	}
	wg.Wait()
	if g.pool != nil {
		g.pool.Close()
	}
	return g.svc.Close()
}

// observe raises a holder's token that is new to this proxy, recorded with its holder first
// (fence.Key.RaiseRecorded). A holder's token below the highest known one is a regression
// when the database (or, without one, this proxy) admitted a higher one.
func (g *LockGuard) observe(ctx context.Context, res string, h lease.Holder) {
	log := g.log.With(zap.String("resource", res), zap.Int64("token", h.Token))
	highest := g.reg.Highest("", res)
	switch {
	case h.Token == highest:
		return
	case g.pool == nil && h.Token < highest:
		g.closed(res, fmt.Sprintf("this proxy saw a lock holder with token %d, and now one with token %d", highest, h.Token)) //nolint:errcheck // the sessions are told
		return
	}
	// Sessions of older tokens are ended from now on, in every database; the database raise
	// makes it binding for every proxy (without a control database, the holder's own bind).
	g.reg.Observe("", res, h.Token)
	if g.pool == nil {
		return
	}
	rec, stored, err := g.key.RaiseRecorded(ctx, g.pool, res, h.Token, h.Name)
	if err == nil && stored > h.Token {
		rec = fence.ConsulRecord{Token: stored} // a higher token admitted: Judge tells why
	}
	switch {
	case err != nil:
		g.metrics.raises.WithLabelValues(res, "error").Inc()
		log.Error("proactive raise failed; the new holder's token is raised when it connects", zap.Error(err))
	case !rec.Admits(h.Token, h.Name):
		switch jerr := g.Judge(ctx, res, h.Token, h.Name, rec); {
		case errors.Is(jerr, fence.ErrStale):
			g.metrics.raises.WithLabelValues(res, "superseded").Inc()
		case fence.IsRegression(jerr):
			g.metrics.raises.WithLabelValues(res, "regression").Inc()
		default:
			g.metrics.raises.WithLabelValues(res, "refused").Inc()
			log.Warn("proactive raise refused", zap.Error(jerr))
		}
	default:
		g.metrics.raises.WithLabelValues(res, "raised").Inc()
		log.Info("raised token for the new lock holder")
	}
}

// Authority names what the guard validates resource's tokens against ("": none), for hints.
func (g *LockGuard) Authority(resource string) string {
	if g.resources[resource] {
		return g.svc.Describe(resource)
	}
	return ""
}

// Validates reports whether the guard checks resource's tokens (see session.admit): the
// guard, not the registry's highest token, then decides, so that a regression is told as
// such (ZF007) also to a token below the highest admitted one.
func (g *LockGuard) Validates(resource string) bool { return g.resources[resource] }

// Store implements Guard: the service's name.
func (g *LockGuard) Store() string { return g.svc.Store() }

// HolderOf implements Guard: the holder of res's lock as the guard last read it, if its token is token.
func (g *LockGuard) HolderOf(res string, token int64) string {
	g.mu.Lock()
	defer g.mu.Unlock()
	if h := g.leaders[res]; h.Token == token && token > 0 {
		return h.Name
	}
	return ""
}

// HolderName implements Guard: etcd's leases and ZooKeeper's sessions have no name of their
// own.
func (g *LockGuard) HolderName(string) string { return "" }

// Unsynced implements Guard: none (/readyz does not wait for etcd or ZooKeeper; their
// sessions are refused with ZF007 while the service cannot be read).
func (g *LockGuard) Unsynced() []string { return nil }

// Close frees what a guard that never ran holds (its control pool); Run frees it otherwise.
func (g *LockGuard) Close() {
	if g.pool != nil {
		g.pool.Close()
	}
}
