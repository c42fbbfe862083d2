package proxy

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/hashicorp/consul/api"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/lease"
)

// Consul-down policies.
const (
	ConsulDownRefuse        = "refuse"
	ConsulDownTrustDatabase = "trust-database"
)

// Guard ties the proxy to Consul: it admits a session's token only when it
// is the current LockIndex of a held lock (Admitter), and it fences
// proactively: when Consul hands the lock to a new holder, it raises the new
// LockIndex in the database at once (before the new leader even connects)
// and tells the old holder's sessions they are stale; when the lock is free,
// or its LockIndex went backwards, it blocks the resource's sessions.
//
// Consul's word is needed to admit a token, never to keep the guarantee: the
// database's bind and raise order commits whatever the Guard knows.
type Guard struct {
	watcher  *lease.Watcher
	reg      *fence.Registry
	log      *zap.Logger
	keys     map[string]string // resource -> key
	byKey    map[string]string // key -> resource
	downMode string
	pool     *pgxpool.Pool // control database for proactive raises (nil: none)
	key      fence.Key     // the proxy key, for the raise's proof
	metrics  *guardMetrics
	mode     lease.TokenMode // which number of a key is the token

	raiseMu sync.Mutex // one raise at a time per Guard keeps the log readable
}

type guardMetrics struct {
	regressions *prometheus.CounterVec
	raises      *prometheus.CounterVec
	known       *prometheus.GaugeVec
}

// GuardOptions configure NewGuard.
type GuardOptions struct {
	Logger   *zap.Logger
	Registry *fence.Registry
	// Registerer for the Guard's metrics (nil: none).
	Registerer prometheus.Registerer
}

// NewGuard builds a Guard for the resources of cfg that name a Consul key.
// It returns nil, nil when none does.
func NewGuard(ctx context.Context, cfg Config, opts GuardOptions) (*Guard, error) {
	s, err := cfg.validate()
	if err != nil {
		return nil, err
	}
	g := &Guard{reg: opts.Registry, log: opts.Logger, keys: map[string]string{}, byKey: map[string]string{}, downMode: s.ConsulDownMode, key: s.Key}
	if g.log == nil {
		g.log = zap.NewNop()
	}
	if g.reg == nil {
		return nil, errors.New("proxy: NewGuard needs the server's registry")
	}
	var keys []string
	for _, r := range s.resources {
		if r.Key == "" {
			continue
		}
		g.keys[r.Name] = r.Key
		g.byKey[r.Key] = r.Name
		keys = append(keys, r.Key)
	}
	if len(keys) == 0 {
		return nil, nil
	}
	client, err := lease.NewClient(lease.ConsulConfig{Addr: s.ConsulAddr, Token: s.ConsulToken, CAFile: s.ConsulCAFile, Scheme: s.ConsulScheme})
	if err != nil {
		return nil, err
	}
	return g.finish(ctx, client, keys, s.ControlDatabase, lease.TokenMode(s.ConsulTokenMode), opts.Registerer)
}

func (g *Guard) finish(ctx context.Context, client *api.Client, keys []string, control string, mode lease.TokenMode, reg prometheus.Registerer) (*Guard, error) {
	g.metrics = &guardMetrics{
		regressions: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "fenceproxy_lockindex_regressions_total",
			Help: "Consul LockIndex regressions detected; the resource fails closed until an operator resets it."}, []string{"resource"}),
		raises: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "fenceproxy_proactive_raises_total",
			Help: "Tokens raised in the database when Consul showed a new holder, by outcome."}, []string{"resource", "outcome"}),
		known: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "fenceproxy_consul_state_known",
			Help: "1 when the lock's state is known from Consul, 0 while Consul is unreachable or not resynchronised."}, []string{"resource"}),
	}
	if reg != nil {
		reg.MustRegister(g.metrics.regressions, g.metrics.raises, g.metrics.known)
	}
	w, err := lease.NewWatcher(client, lease.WatcherConfig{Keys: keys, OnChange: g.onChange, Logger: g.log, Mode: mode})
	if err != nil {
		return nil, err
	}
	g.watcher = w
	g.mode = mode
	if control != "" {
		pool, err := pgxpool.New(ctx, control)
		if err != nil {
			return nil, fmt.Errorf("control database: %w", err)
		}
		g.pool = pool
	} else {
		g.log.Warn("no --control-database: a new holder's token is raised in the database only when it connects")
	}
	return g, nil
}

// Run watches Consul until ctx ends.
func (g *Guard) Run(ctx context.Context) error {
	defer func() {
		if g.pool != nil {
			g.pool.Close()
		}
	}()
	return g.watcher.Run(ctx)
}

// Validates reports whether the Guard checks resource's tokens against Consul.
func (g *Guard) Validates(resource string) bool {
	_, ok := g.keys[resource]
	return ok
}

// Admit implements Admitter: the token must be the current LockIndex of a
// held lock (and the holder session, when given).
func (g *Guard) Admit(ctx context.Context, c fence.Credentials) error {
	key, ok := g.keys[c.Resource]
	if !ok {
		return nil // a resource without a Consul key is ordered by the database alone
	}
	st, err := g.watcher.Validate(ctx, key, c.Token, c.Session)
	if err == nil {
		return nil
	}
	var re *lease.RegressionError
	switch {
	case errors.As(err, &re):
		return regressionError(c.Resource, re)
	case errors.Is(err, lease.ErrStale):
		cur, _ := st.Current()
		return fence.Stale(c.Resource, c.Token, cur)
	case errors.Is(err, lease.ErrNotIssued):
		cur, _ := st.Current()
		return fence.NotIssued(c.Resource, c.Token, cur)
	case errors.Is(err, lease.ErrNotHeld):
		return fence.NotHeld(c.Resource, c.Token)
	case errors.Is(err, lease.ErrSessionMismatch):
		return fence.HolderMismatch(c.Resource, c.Session, st.Session)
	case errors.Is(err, lease.ErrUnavailable):
		if g.downMode == ConsulDownTrustDatabase {
			// The operator chose availability: the database's raise still
			// refuses tokens lower than the stored one, but a token Consul
			// never issued may be admitted (see the README).
			g.log.Warn("consul unreachable: admitting token on the database's word (consul-down=trust-database)",
				zap.String("resource", c.Resource), zap.Int64("token", c.Token))
			return nil
		}
		return fence.Unavailable(c.Resource, "Consul's lock state is unknown ("+err.Error()+"); no token is admitted without Consul's word")
	}
	return fence.Unavailable(c.Resource, err.Error())
}

func regressionError(resource string, re *lease.RegressionError) *fence.Error {
	return fence.Regression(resource, fmt.Sprintf("the token of Consul lock %q went backwards: %s", re.Key, re.Reason))
}

// onChange reacts to a lock's new state (called by the watcher, in order per key).
func (g *Guard) onChange(st lease.State) {
	res := g.byKey[st.Key]
	if st.Known {
		g.metrics.known.WithLabelValues(res).Set(1)
	} else {
		g.metrics.known.WithLabelValues(res).Set(0)
		// Unknown: sessions already admitted go on; the database's raise still
		// ends them when a newer holder is admitted. New tokens are refused by Admit.
		return
	}
	if st.Regression != nil {
		g.metrics.regressions.WithLabelValues(res).Inc()
		g.log.Error("failing closed: Consul LockIndex regression", zap.String("resource", res), zap.Error(st.Regression))
		g.reg.Block(res, regressionError(res, st.Regression))
		return
	}
	tok, err := st.Token()
	switch {
	case errors.Is(err, lease.ErrNotHeld):
		// Nobody holds the lock: the last holder's sessions get no new
		// transactions until a holder exists again.
		cur, _ := st.Current()
		g.reg.Block(res, fence.NotHeld(res, cur))
		return
	case err != nil:
		// Indexes outside the token's encoding (lease.ErrTokenRange).
		g.reg.Block(res, fence.Unavailable(res, err.Error()))
		return
	}
	g.reg.Block(res, nil)
	if tok > g.reg.Highest("", res) {
		// Sessions of older tokens are ended from now on, in every database;
		// the database raise makes it binding for every proxy.
		g.reg.Observe("", res, tok)
		go g.raise(res, tok)
	}
}

// raise stores tok in the database (proactive fencing).
func (g *Guard) raise(res string, tok int64) {
	if g.pool == nil {
		return
	}
	g.raiseMu.Lock()
	defer g.raiseMu.Unlock()
	var stored int64
	err := g.pool.AcquireFunc(context.Background(), func(c *pgxpool.Conn) error {
		var err error
		stored, err = g.key.Raise(context.Background(), c.Conn(), res, tok)
		return err
	})
	switch {
	case err != nil:
		g.metrics.raises.WithLabelValues(res, "error").Inc()
		g.log.Error("proactive raise failed; the new holder's token is raised when it connects", zap.String("resource", res), zap.Int64("token", tok), zap.Error(err))
	case stored > tok:
		// The database admitted more than Consul ever issued: Consul's
		// numbers went backwards across a restart of this proxy.
		g.metrics.raises.WithLabelValues(res, "regression").Inc()
		g.metrics.regressions.WithLabelValues(res).Inc()
		re := &lease.RegressionError{Key: g.keys[res], Reason: fmt.Sprintf("the database admitted token %d but Consul's current token is %d", stored, tok), Highest: uint64(stored), Seen: lease.State{Mode: g.mode}}
		g.log.Error("failing closed: stored token above Consul's LockIndex", zap.String("resource", res), zap.Int64("stored", stored), zap.Int64("lock_index", tok))
		g.reg.Block(res, regressionError(res, re))
	default:
		g.metrics.raises.WithLabelValues(res, "raised").Inc()
		g.log.Info("raised token for the new holder", zap.String("resource", res), zap.Int64("token", tok))
	}
}
