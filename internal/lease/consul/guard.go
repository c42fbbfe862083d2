package consul

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/consul/api"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/lease"
)

// GuardApplicationName is the application_name of the Guard's connections to the control
// database.
const GuardApplicationName = "fenceproxy guard"

// Guard ties the proxy to Consul: it admits a session's token only when it
// is the current LockIndex of a held lock (Admitter), and it fences
// proactively: when Consul hands the lock to a new holder, it raises the new
// LockIndex in the database at once (before the new leader even connects)
// and tells the old holder's sessions they are stale; when the lock is free,
// or its LockIndex went backwards, it blocks the resource's sessions.
//
// Consul's word is needed to admit a token, never to keep the guarantee: the
// database's bind and raise order commits whatever the Guard knows.
//
// How two holders could share a token, or a stale holder be admitted, and what stops each:
//
//   - A token below the stored one: fence.bind refuses it (P3), whatever the Guard says.
//   - A token above the current one (forged, or from a lease Consul never granted): Admit
//     refuses it (ZF002) after a consistent read, before anything is raised.
//   - The current token, presented by a holder that lost the lock since: the consistent read
//     in Admit shows the lock free (ZF006) or a newer token (ZF001); with fence.session, also
//     another holder (ZF009). A read older than the hand-over cannot admit it later than the
//     new holder's raise: the raise ends every backend bound to the lower token (P2).
//   - Consul issuing one number twice (its sequence goes back: a plain PUT on the held key, a
//     snapshot restore, a Consul that lost its data; in lockindex mode also a re-created key)
//     and climbing back to a token already admitted: the old holder (without fence.session)
//     and the new one would both pass a check against Consul alone, and the database admits
//     a token equal to the stored one. Three things stop it. The watch sees the sequence go
//     below the highest token it saw (a sticky regression, ZF007). The regression is recorded
//     in the database (fence.consul_regress), which every proxy and a restarted one read
//     (loadRegressions, and fence.consul_admit's answer). And the database records the holder
//     session of each admitted token (fence.consul_admit), so the same number with another
//     holder is a regression even when no proxy watched the sequence go back (C2).
//   - A regression misread from stale state (raises of quick hand-overs crossing): judge
//     decides with a consistent read made after the database answered, so the current
//     leader is never refused for a token the database stored from a later hand-over.
//   - Consul handing the current number to a second session without ever showing a lower one
//     (one transaction that writes the held key, unlocks it and locks it for another
//     session): the watch takes the same token under another session for a regression, and
//     every bind records (token, holder) in its own database before it binds
//     (fence.ConsulBindQuery, C5 in migration 8), where the second holder is refused and the
//     first one's backends are ended in the transaction that records the regression.
//
// Without a control database the proactive raise and the shared record of regressions a watch
// saw are gone; the holder record of the protected database (C2, C5) stays.
type Guard struct {
	watcher *Watcher
	reg     *fence.Registry
	log     *zap.Logger
	keys    map[string]string // resource -> key
	byKey   map[string]string // key -> resource
	// trustDatabase admits tokens on the database's word while Consul is unreachable
	// (--consul-down trust-database).
	trustDatabase bool
	// requireSession refuses sessions without fence.session (--consul-require-session).
	requireSession bool
	pool           *pgxpool.Pool // control database for proactive raises (nil: none)
	control        string        // its URL, for the LISTEN of fence resets
	key            fence.Key     // the proxy key, for the raise's proof
	metrics        *guardMetrics
	mode           lease.TokenMode // which number of a key is the token
	addr           string          // Consul's address, for the messages
	answerTimeout  time.Duration   // how long a session start waits for Consul (--consul-answer-timeout)

	// unconfirmed holds the resources Consul has not answered for since the control
	// connection found a new server or timeline (a failover): --consul-down trust-database
	// admits none of them on the database's word, whose tokens may be those of a standby
	// that missed the last raises (UpstreamSwitched).
	switchMu    sync.Mutex
	unconfirmed map[string]bool

	raiseMu sync.Mutex // one raise at a time per Guard: they go in the order of the hand-overs

	// reported is the regression each resource was last reported with, so that one
	// regression is counted, logged and recorded in the database once (the watcher reports
	// it again with every later change of the key).
	reportMu sync.Mutex
	reported map[string]*RegressionError

	// names holds the Name of the Consul sessions that held a lock (fenceproxy lock names
	// its sessions "fenceproxy lock <resource>"), read once per session for the status page
	// and fenceproxy_leader_info; a session's Name never changes.
	client   *api.Client
	namesMu  sync.Mutex
	names    map[string]string // session ID -> Name
	fetching map[string]bool
}

// maxNames bounds Guard.names: past it the map starts over (holders come and go).
const maxNames = 256

// HolderName implements the proxy's Guard: the Name of Consul session id, or "" while it is not known; the first call
// for a session reads it from Consul in the background.
func (g *Guard) HolderName(id string) string {
	if id == "" || g.client == nil {
		return ""
	}
	g.namesMu.Lock()
	defer g.namesMu.Unlock()
	if n, ok := g.names[id]; ok {
		return n
	}
	if !g.fetching[id] {
		g.fetching[id] = true
		go g.fetchName(id)
	}
	return ""
}

func (g *Guard) fetchName(id string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	se, _, err := g.client.Session().Info(id, (&api.QueryOptions{}).WithContext(ctx))
	g.namesMu.Lock()
	defer g.namesMu.Unlock()
	delete(g.fetching, id)
	if err != nil {
		g.log.Debug("could not read a Consul session's name", zap.String("session", id), zap.Error(err))
		return // asked again at the next status
	}
	if len(g.names) >= maxNames {
		clear(g.names)
	}
	g.names[id] = "" // a session destroyed since: no name to show
	if se != nil {
		g.names[id] = se.Name
	}
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

// GuardConfig is what the Guard validates, against which Consul, and how (the proxy's
// --consul-* flags, validated and defaulted: internal/proxy/guards builds it).
type GuardConfig struct {
	// Keys are the resources validated against Consul, and their lock keys.
	Keys map[string]string
	// Client says how to reach Consul.
	Client Config
	// Mode is which number of a key is the token (--consul-token-mode).
	Mode lease.TokenMode
	// TrustDatabase admits tokens on the database's word while Consul is unreachable
	// (--consul-down trust-database).
	TrustDatabase bool
	// RequireSession refuses sessions without fence.session (--consul-require-session).
	RequireSession bool
	// AnswerTimeout is how long a session start waits for Consul (--consul-answer-timeout).
	AnswerTimeout time.Duration
	// Control is the control database's URL ("": none).
	Control string
	// Key is the proxy key, for the raise's proof.
	Key fence.Key
}

// NewGuard builds a Guard for cfg.Keys. It returns nil, nil when there are none.
func NewGuard(ctx context.Context, cfg GuardConfig, opts GuardOptions) (*Guard, error) {
	g := &Guard{reg: opts.Registry, log: opts.Logger, keys: map[string]string{}, byKey: map[string]string{}, unconfirmed: map[string]bool{}, trustDatabase: cfg.TrustDatabase, requireSession: cfg.RequireSession, key: cfg.Key,
		reported: map[string]*RegressionError{}, addr: cfg.Client.Addr, answerTimeout: cfg.AnswerTimeout}
	if g.log == nil {
		g.log = zap.NewNop()
	}
	if g.reg == nil {
		return nil, errors.New("consul: NewGuard needs the server's registry")
	}
	var keys []string
	for res, key := range cfg.Keys {
		g.keys[res] = key
		g.byKey[key] = res
		keys = append(keys, key)
	}
	if len(keys) == 0 {
		return nil, nil
	}
	slices.Sort(keys)
	client, err := NewClient(cfg.Client)
	if err != nil {
		return nil, err
	}
	return g.finish(ctx, client, keys, cfg.Control, cfg.Mode, opts.Registerer)
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
	w, err := NewWatcher(client, WatcherConfig{Keys: keys, OnChange: g.onChange, Logger: g.log, Mode: mode})
	if err != nil {
		return nil, err
	}
	g.watcher = w
	g.mode = mode
	g.client, g.names, g.fetching = client, map[string]string{}, map[string]bool{}
	if control != "" {
		// So that operators can tell the Guard's backends from the sessions' (pg_stat_activity,
		// and the history's application_name of its raises).
		pool, err := fence.NewGuardPool(ctx, control, GuardApplicationName)
		if err != nil {
			return nil, err
		}
		g.pool = pool
		g.control = control
	} else {
		g.log.Warn("no --control-database: a new holder's token is raised in the database only when it connects")
	}
	return g, nil
}

// Run watches Consul until ctx ends. Regressions recorded in the database (by any proxy,
// before any restart) fail their resources closed before the watch starts.
func (g *Guard) Run(ctx context.Context) error {
	defer func() {
		if g.pool != nil {
			g.pool.Close()
		}
	}()
	if g.pool != nil {
		resets := make(chan struct{})
		go func() { defer close(resets); g.followResets(ctx, g.control) }()
		defer func() { <-resets }()
		if err := g.loadRegressions(ctx); err != nil {
			g.log.Error("could not read the regressions recorded in the database (does it have the fence schema this fenceproxy needs? run fenceproxy migrate); they are learned at the next admission", zap.Int("schema_version", fence.SchemaVersion),
				zap.Error(err))
		}
	}
	return g.watcher.Run(ctx)
}

// loadRegressions marks the regressions recorded in fence.consul_tokens in the watcher.
func (g *Guard) loadRegressions(ctx context.Context) error {
	rows, err := g.pool.Query(ctx, "SELECT resource, regression FROM fence.consul_tokens WHERE regression IS NOT NULL")
	if err != nil {
		return err
	}
	found, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct{ Resource, Regression string }])
	if err != nil {
		return err
	}
	for _, r := range found {
		if key, ok := g.keys[r.Resource]; ok {
			g.watcher.Regress(key, r.Regression) //nolint:errcheck // the key is watched
		}
	}
	return nil
}

// Check reads every watched key once, with consistent reads, so that a misconfigured Consul
// fails the proxy's start with the cause instead of refusing every session later: an ACL
// refusal or a wrong scheme (Permanent) fails at once; other errors (a dead port, no
// leader) are retried until ctx ends, then returned.
func (g *Guard) Check(ctx context.Context) error {
	for key := range g.byKey {
		for {
			_, err := g.watcher.Read(ctx, key)
			if err == nil {
				break
			}
			if Permanent(err) {
				return fmt.Errorf("consul: %w (check --consul-token and its ACL policy: key read on %q, and --consul-addr/--consul-scheme)", err, key)
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("consul did not answer (check --consul-addr): %w", err)
			case <-time.After(500 * time.Millisecond):
			}
		}
	}
	return nil
}

// Validates reports whether the Guard checks resource's tokens against Consul.
func (g *Guard) Validates(resource string) bool {
	_, ok := g.keys[resource]
	return ok
}

// Admit implements Admitter (AdmitHolder without the holder).
func (g *Guard) Admit(ctx context.Context, c fence.Credentials) error {
	_, err := g.AdmitHolder(ctx, c)
	return err
}

// AdmitHolder implements HolderAdmitter: the token must be the current token (of the mode)
// of a held lock (and the holder session, when given), and the database's record
// of Consul tokens must agree (admitRecorded). It returns the Consul session that
// holds the lock, which the session's bind records in its own database
// (fence.ConsulBindQuery).
// Authority names what the guard validates resource's tokens against ("": none), for hints.
func (g *Guard) Authority(resource string) string {
	if k, ok := g.keys[resource]; ok {
		return fmt.Sprintf("Consul key %q", k)
	}
	return ""
}

func (g *Guard) AdmitHolder(ctx context.Context, c fence.Credentials) (string, error) {
	key, ok := g.keys[c.Resource]
	if !ok {
		return "", nil // a resource without a Consul key is ordered by the database alone
	}
	if g.requireSession && c.Session == "" {
		return "", &fence.Error{Code: fence.CodeMissing, Resource: c.Resource, Token: c.Token,
			Message: fmt.Sprintf("fencing session missing: resource %q is validated by Consul and this proxy requires fence.session (--consul-require-session): set it to the Consul session ID that holds the lock", c.Resource),
			Hint:    "fenceproxy lock puts it in DATABASE_URL and FENCE_SESSION; see docs/applications.md."}
	}
	vctx, cancel := context.WithTimeout(ctx, g.answerTimeout)
	st, err := g.watcher.Validate(vctx, key, c.Token, c.Session)
	cancel()
	if !errors.Is(err, lease.ErrUnavailable) {
		g.confirmed(c.Resource)
	}
	if err == nil {
		return st.Session, g.admitRecorded(ctx, c.Resource, key, c.Token, st.Session)
	}
	var re *RegressionError
	switch {
	case errors.As(err, &re):
		// Validate's own read can see a regression before the watch does: make it
		// sticky (and recorded) at once. Blocked here too, before the answer: the
		// sessions already bound must be refused before anyone learns of the regression.
		g.watcher.Regress(key, re.Reason) //nolint:errcheck // the key is watched
		fe := regressionError(c.Resource, re)
		g.reg.Block(c.Resource, fe)
		return "", fe
	case errors.Is(err, lease.ErrStale):
		cur, _ := st.Current()
		return "", fence.Stale(c.Resource, c.Token, cur)
	case errors.Is(err, lease.ErrNotIssued):
		cur, _ := st.Current()
		return "", fence.NotIssued(c.Resource, c.Token, cur)
	case errors.Is(err, lease.ErrNotHeld):
		fe := fence.NotHeld(c.Resource, c.Token)
		fe.Message += fmt.Sprintf(" (Consul key %s)", key)
		if !st.Exists {
			// A typo in the lock's --key looks like this too (a newcomer's): name the key.
			fe.Message = fmt.Sprintf("fencing lock not held: the Consul lock key %s of resource %q does not exist (token %d): nobody holds it, or the lock is taken under another key", key, c.Resource, c.Token)
			fe.Hint = fmt.Sprintf("Take the lock on the key this proxy validates: fenceproxy lock --key %s (or --resource %s=KEY here for another key).", key, c.Resource)
		}
		return "", fe
	case errors.Is(err, lease.ErrSessionMismatch):
		return "", fence.HolderMismatch(c.Resource, c.Session, st.Session)
	case errors.Is(err, lease.ErrUnavailable):
		if g.trustDatabase && g.isUnconfirmed(c.Resource) {
			fe := g.unreachable(c.Resource, errors.Is(vctx.Err(), context.DeadlineExceeded), err)
			fe.Message += "; --consul-down trust-database admits no token until Consul has answered once after the failover this proxy saw"
			fe.Hint = "The database's server changed (a failover): its stored tokens may miss raises the old primary had, so only Consul can tell a stale token from the current one. " +
				"Check that Consul is up and answers from this host (consul members; curl " + g.addr + "/v1/status/leader); sessions are admitted again once it answers (docs/consul.md: When Consul is unreachable)."
			return "", fe
		}
		if g.trustDatabase {
			// The operator chose availability: the database's raise still
			// refuses tokens lower than the stored one, but a token Consul
			// never issued may be admitted (see the README).
			g.log.Warn("consul unreachable: admitting token on the database's word (consul-down=trust-database)",
				zap.String("resource", c.Resource), zap.Int64("token", c.Token))
			return "", nil
		}
		return "", g.unreachable(c.Resource, errors.Is(vctx.Err(), context.DeadlineExceeded), err)
	}
	return "", fence.Unavailable(c.Resource, err.Error())
}

// UpstreamSwitched implements upstreamSwitcher: after a failover of the database, no resource
// is admitted on the database's word (--consul-down trust-database) until Consul answered for it.
func (g *Guard) UpstreamSwitched() {
	g.switchMu.Lock()
	defer g.switchMu.Unlock()
	for res := range g.keys {
		g.unconfirmed[res] = true
	}
}

func (g *Guard) confirmed(res string) {
	g.switchMu.Lock()
	defer g.switchMu.Unlock()
	delete(g.unconfirmed, res)
}

func (g *Guard) isUnconfirmed(res string) bool {
	g.switchMu.Lock()
	defer g.switchMu.Unlock()
	return g.unconfirmed[res]
}

// unreachable is the refusal of a session whose token Consul did not confirm (ErrUnavailable):
// it names Consul, says whether it did not answer in time, and what to do.
func (g *Guard) unreachable(resource string, timedOut bool, err error) *fence.Error {
	why := "Consul at " + g.addr + " is unreachable (" + err.Error() + ")"
	if timedOut {
		why = fmt.Sprintf("Consul at %s did not answer within %s (--consul-answer-timeout): it is unreachable or hung", g.addr, g.answerTimeout)
	}
	fe := fence.Unavailable(resource, why+"; no token is admitted without Consul's word")
	fe.Hint = "Check that Consul is up and answers from this host (consul members; curl " + g.addr + "/v1/status/leader). " +
		"To admit tokens on the database's word while Consul is down, run the proxy with --consul-down trust-database (docs/consul.md: When Consul is unreachable)."
	return fe
}

// Judge decides for a session's bind what the record of its own database (fence.consul_admit,
// in fence.ConsulBindQuery) means for tok, which Consul showed as current, held by holder; and
// for a bind refused with ZF001 (rec.Token: the stored token), whether the session is stale or
// Consul went back. See judge.
func (g *Guard) Judge(ctx context.Context, res string, tok int64, holder string, rec fence.ConsulRecord) error {
	key, ok := g.keys[res]
	if !ok {
		return fence.Unavailable(res, "not a Consul-validated resource")
	}
	return g.judge(ctx, res, key, tok, holder, rec)
}

// admitRecorded is the database's part of admitting tok, which Consul just showed as the
// current token of res, held by holder: fence.consul_admit records (tok, holder), and answers
// with a regression some proxy recorded, or with a higher token recorded since. Without a
// control database there is no record, and only this process's memory of regressions.
func (g *Guard) admitRecorded(ctx context.Context, res, key string, tok int64, holder string) error {
	if g.pool == nil {
		return nil
	}
	rec, err := g.key.AdmitOnControl(ctx, g.pool, res, tok, holder)
	if err != nil {
		return err
	}
	return g.judge(ctx, res, key, tok, holder, rec)
}

// judge decides what a database record means for tok, which Consul showed as current for
// res, held by holder. The reasoning, case by case:
//
//   - A recorded regression: some proxy saw the token go backwards (or the database saw one
//     number with two holders): fail closed, until fence.reset.
//   - The record is tok with holder: admitted.
//   - A higher recorded token (the record never holds tok with another holder: the database
//     turns that into a regression): either a newer hand-over happened after the consistent
//     read that showed tok (another proxy admitted it, or this proxy's watch is behind), and
//     tok is stale (ZF001); or Consul's sequence went back below a token already admitted,
//     a regression (ZF007). A consistent read started now tells them apart: a current token
//     at or above the recorded one means the first. Deciding this from the state in hand
//     instead refused the current leader when raises of quick hand-overs crossed.
func (g *Guard) judge(ctx context.Context, res, key string, tok int64, holder string, rec fence.ConsulRecord) error {
	switch {
	case rec.Regression != "":
		g.watcher.Regress(key, rec.Regression) //nolint:errcheck // the key is watched
		return fence.Regression(res, rec.Regression)
	case rec.Admits(tok, holder):
		return nil
	case rec.Token <= tok:
		// Not an answer consul_admit gives (it records a higher token, and one number with
		// two holders is a regression): refuse rather than guess.
		return fence.Unavailable(res, fmt.Sprintf("the database recorded token %d of Consul session %q for token %d of session %q",
			rec.Token, rec.Holder, tok, holder))
	}
	if fe := rec.MovedFrom(res, tok, "Consul"); fe != nil {
		return fe
	}
	s, err := g.watcher.Read(ctx, key)
	if err != nil {
		return fence.Unavailable(res, "Consul's lock state is unknown ("+err.Error()+"); no token is admitted without Consul's word")
	}
	cur, err := s.Current()
	if err != nil {
		return fence.Unavailable(res, err.Error())
	}
	if !s.Exists || cur >= rec.Token {
		// A deleted key (`consul lock` deletes it after each release) says nothing of a
		// regression: only a key whose current token is below the recorded one does.
		return fence.Stale(res, tok, rec.Token)
	}
	reason := fmt.Sprintf("the database admitted token %d (Consul session %q) but Consul's current token is %d: "+
		"Consul's sequence went back (a plain write to the held key, or a snapshot restore)", rec.Token, rec.Holder, cur)
	g.watcher.Regress(key, reason) //nolint:errcheck // the key is watched
	return fence.Regression(res, reason)
}

func regressionError(resource string, re *RegressionError) *fence.Error {
	return fence.Regression(resource, fmt.Sprintf("the token of Consul lock %q went backwards: %s", re.Key, re.Reason))
}

// onChange reacts to a lock's new state (called by the watcher, in order per key).
func (g *Guard) onChange(st State) {
	res := g.byKey[st.Key]
	if st.Regression != nil {
		// Sticky until Reset, known or not: the database still holds tokens of the
		// sequence Consul left.
		g.reg.Block(res, regressionError(res, st.Regression))
		if g.firstReport(res, st.Regression) {
			g.metrics.regressions.WithLabelValues(res).Inc()
			g.log.Error("failing closed: Consul token regression", zap.String("resource", res), zap.Error(st.Regression))
			go g.record(res, st.Regression)
		}
	} else {
		g.firstReport(res, nil)
	}
	if st.Known {
		g.metrics.known.WithLabelValues(res).Set(1)
	} else {
		g.metrics.known.WithLabelValues(res).Set(0)
		// Unknown: sessions already admitted go on; the database's raise still
		// ends them when a newer holder is admitted. New tokens are refused by Admit.
		return
	}
	if st.Regression != nil {
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
		g.reg.SetHolder(res, tok, st.Session) // the status page and /status name Consul's session
		go g.raise(res, st.Key, tok, st.Session)
	}
}

// firstReport records re as res's current regression and reports whether it is new (nil:
// none any more, after a Reset).
func (g *Guard) firstReport(res string, re *RegressionError) bool {
	g.reportMu.Lock()
	defer g.reportMu.Unlock()
	if g.reported[res] == re {
		return false
	}
	g.reported[res] = re
	return re != nil
}

// record keeps a regression in the database (fence.consul_regress), where every proxy and a
// restarted one find it; only fence.reset clears it there.
func (g *Guard) record(res string, re *RegressionError) {
	if g.pool == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := g.key.RegressOnControl(ctx, g.pool, res, max(1, int64(re.Highest)), re.Reason)
	if err != nil {
		g.log.Error("could not record the regression in the database; this proxy fails closed, others learn it at their next admission",
			zap.String("resource", res), zap.Error(err))
	}
}

// raise records tok with its holder and stores it in the database (proactive fencing). Raises
// run one at a time, and a raise that a newer hand-over overtook is skipped: its holder is no
// longer the leader, and the newer raise covers it.
func (g *Guard) raise(res, key string, tok int64, holder string) {
	if g.pool == nil {
		return
	}
	g.raiseMu.Lock()
	defer g.raiseMu.Unlock()
	if tok < g.reg.Highest("", res) {
		g.metrics.raises.WithLabelValues(res, "superseded").Inc()
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rec, stored, err := g.key.RaiseRecorded(ctx, g.pool, res, tok, holder)
	if err == nil && stored > tok {
		rec = fence.ConsulRecord{Token: stored} // a higher token admitted: judge tells why
	}
	switch {
	case err != nil:
		g.metrics.raises.WithLabelValues(res, "error").Inc()
		g.log.Error("proactive raise failed; the new holder's token is raised when it connects", zap.String("resource", res), zap.Int64("token", tok), zap.Error(err))
	case !rec.Admits(tok, holder):
		if jerr := g.judge(ctx, res, key, tok, holder, rec); errors.Is(jerr, fence.ErrStale) {
			g.metrics.raises.WithLabelValues(res, "superseded").Inc()
		} else {
			g.metrics.raises.WithLabelValues(res, "refused").Inc()
			g.log.Warn("proactive raise refused", zap.String("resource", res), zap.Int64("token", tok), zap.Error(jerr))
		}
	default:
		g.metrics.raises.WithLabelValues(res, "raised").Inc()
		g.log.Info("raised token for the new holder", zap.String("resource", res), zap.Int64("token", tok))
	}
}

// Unsynced implements the proxy's Guard: the resources whose Consul lock state is not known
// now.
func (g *Guard) Unsynced() []string {
	var out []string
	for res, key := range g.keys {
		if st, ok := g.watcher.State(key); !ok || !st.Known {
			out = append(out, res)
		}
	}
	slices.Sort(out)
	return out
}

// HolderOf implements the proxy's Guard: the Consul session holding resource's lock when its
// LockIndex is token.
func (g *Guard) HolderOf(resource string, token int64) string {
	key, ok := g.keys[resource]
	if !ok {
		return ""
	}
	if st, ok := g.watcher.State(key); ok && st.Known && st.Held && int64(st.LockIndex) == token {
		return st.Session
	}
	return ""
}

// Store implements the proxy's Guard: lease.StoreConsul.
func (g *Guard) Store() string { return lease.StoreConsul }
