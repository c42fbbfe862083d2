package proxy

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/lease"
)

// etcdReadTimeout bounds each read of an election: an etcd that does not answer within it
// is unreachable, and sessions are refused (ZF007) rather than kept waiting.
const etcdReadTimeout = 5 * time.Second

// EtcdGuard ties the proxy to etcd elections (lease.EtcdStore, `fenceproxy lock --store
// etcd`): it admits a session's token only when it is the CreateRevision of the current
// leader key, read linearizably at session start (Admitter), and it fences proactively: a
// watch of each election raises a new leader's token in the database at once (before the
// new leader connects). It fails closed (ZF007) when etcd cannot be read, and when etcd's
// revisions went backwards (a snapshot restore): a store revision lower than one seen
// before, or a leader whose token is below the one the database admitted.
//
// One token, one holder: a revision names one leader key, and so one session lease. The
// same revision with another lease means etcd issued the number twice (it lost its data,
// and its revisions came up again to a token already admitted): the resource fails closed.
// The guard remembers the leader of each election it read, and with --control-database
// records every admitted (token, lease) in the database (fence.consul_admit, migration 7's
// C1-C3: the same record the Consul Guard keeps), where every proxy and a restarted one
// see it; without a control database only its own memory guards against it.
//
// Like the Consul Guard, etcd's word is needed to admit a token, never to keep the
// guarantee: the database's bind and raise order commits whatever the guard knows.
type EtcdGuard struct {
	client   *clientv3.Client
	reg      *fence.Registry
	log      *zap.Logger
	prefixes map[string]string // resource -> election prefix, with its trailing "/"
	pool     *pgxpool.Pool     // control database for proactive raises (nil: none)
	key      fence.Key

	mu      sync.Mutex
	highest int64                   // the highest store revision read
	leaders map[string]etcdLeader   // resource -> the newest leader read
	regress map[string]*fence.Error // resource -> why it fails closed
}

// etcdLeader is an election's leader: its key's CreateRevision (the token; 0: no leader)
// and the session lease that owns the key (hex, as `fenceproxy lock` shows it).
type etcdLeader struct {
	rev    int64
	holder string
}

// EtcdGuardOptions configure NewEtcdGuard.
type EtcdGuardOptions struct {
	Logger   *zap.Logger
	Registry *fence.Registry // the server's
}

// NewEtcdGuard builds an EtcdGuard for cfg's EtcdResources (NAME=PREFIX, each NAME also a
// --resource without a Consul key). It returns nil, nil when there are none.
func NewEtcdGuard(ctx context.Context, cfg Config, opts EtcdGuardOptions) (*EtcdGuard, error) {
	if len(cfg.EtcdResources) == 0 {
		return nil, nil
	}
	s, err := cfg.validate()
	if err != nil {
		return nil, err
	}
	if opts.Registry == nil {
		return nil, errors.New("proxy: NewEtcdGuard needs the server's registry")
	}
	if len(cfg.EtcdEndpoints) == 0 {
		return nil, errors.New("etcd-resource needs etcd-endpoints")
	}
	g := &EtcdGuard{reg: opts.Registry, log: opts.Logger, prefixes: map[string]string{}, key: s.Key,
		leaders: map[string]etcdLeader{}, regress: map[string]*fence.Error{}}
	if g.log == nil {
		g.log = zap.NewNop()
	}
	for _, spec := range cfg.EtcdResources {
		name, prefix, ok := strings.Cut(spec, "=")
		if !ok || prefix == "" {
			return nil, fmt.Errorf("etcd-resource %q: want NAME=PREFIX (the election prefix of fenceproxy lock --store etcd, e.g. billing=locks/billing)", spec)
		}
		if err := plainResource(s, "etcd-resource", spec, name); err != nil {
			return nil, err
		}
		g.prefixes[name] = strings.TrimSuffix(prefix, "/") + "/"
	}
	g.client, err = lease.NewEtcdClient(lease.EtcdConfig{Endpoints: cfg.EtcdEndpoints, Logger: g.log.Named("etcd-client").WithOptions(zap.IncreaseLevel(zap.WarnLevel))})
	if err != nil {
		return nil, err
	}
	if s.ControlDatabase != "" {
		if g.pool, err = newGuardPool(ctx, s.ControlDatabase, ""); err != nil {
			_ = g.client.Close()
			return nil, err
		}
	} else {
		g.log.Warn("no --control-database: a new etcd leader's token is raised in the database only when it connects")
	}
	return g, nil
}

// leader reads resource's election linearizably: the leader (rev 0: none) and the store's
// revision at the read. A store revision below one read before is a regression, and so is
// the same leader revision with another lease: both fail the resource closed.
func (g *EtcdGuard) leader(ctx context.Context, res string) (l etcdLeader, store int64, err error) {
	rctx, cancel := context.WithTimeout(ctx, etcdReadTimeout)
	defer cancel()
	resp, err := g.client.Get(rctx, g.prefixes[res], clientv3.WithFirstCreate()...)
	if err != nil {
		return etcdLeader{}, 0, err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	store = resp.Header.Revision
	if store < g.highest {
		g.failClosed(res, fmt.Sprintf("etcd's store revision went from %d to %d (a snapshot restore?)", g.highest, store))
	} else {
		g.highest = store
	}
	if len(resp.Kvs) == 0 {
		return etcdLeader{}, store, nil
	}
	l = etcdLeader{rev: resp.Kvs[0].CreateRevision, holder: fmt.Sprintf("%x", resp.Kvs[0].Lease)}
	switch prev := g.leaders[res]; {
	case prev.rev == l.rev && prev.holder != l.holder:
		g.failClosed(res, fmt.Sprintf("etcd issued revision %d twice: to the leader key of session lease %s, then of %s (etcd lost its data and its revisions came up again?)",
			l.rev, prev.holder, l.holder))
	case l.rev > prev.rev:
		g.leaders[res] = l
	}
	return l, store, nil
}

// record is the database's part of admitting l, the leader etcd just showed for res
// (fence.consul_admit records (token, lease), and answers with a regression some proxy
// recorded, or with a higher token recorded since; see Guard.judge for the reasoning).
// Without a control database there is no record, only this process's memory.
func (g *EtcdGuard) record(ctx context.Context, res string, l etcdLeader) error {
	if g.pool == nil {
		return nil
	}
	holder := "etcd lease " + l.holder
	var rec fence.ConsulRecord
	err := onControl(ctx, g.pool, func(conn *pgx.Conn) error {
		var err error
		rec, err = g.key.ConsulAdmit(ctx, conn, res, l.rev, holder)
		return err
	})
	if err != nil {
		return recordFailed(res, err)
	}
	if rec.Admits(l.rev, holder) {
		return nil
	}
	return g.Judge(ctx, res, l.rev, holder, rec)
}

// Judge implements HolderAdmitter: what a record rec of the database that does not admit
// token, which etcd showed held by holder, means for res.
func (g *EtcdGuard) Judge(ctx context.Context, res string, token int64, holder string, rec fence.ConsulRecord) error {
	current := func() (int64, error) {
		l, _, err := g.leader(ctx, res)
		return l.rev, err
	}
	return judgeRecord(res, token, holder, rec, "etcd", current, func(why string) error { return g.closed(res, why) })
}

// closed fails res closed for reason and returns the error its sessions get.
func (g *EtcdGuard) closed(res, reason string) error {
	g.mu.Lock()
	g.failClosed(res, reason)
	g.mu.Unlock()
	return g.regression(res)
}

// persist records a regression this proxy found in the database (fence.consul_regress),
// where every proxy and a restarted one see it (fence.consul_admit answers with it).
func (g *EtcdGuard) persist(res string, token int64, reason string) {
	if g.pool == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), etcdReadTimeout)
	defer cancel()
	err := onControl(ctx, g.pool, func(conn *pgx.Conn) error {
		_, err := g.key.ConsulRegress(ctx, conn, res, token, reason)
		return err
	})
	if err != nil {
		g.log.Error("could not record the regression in the database; other proxies find it themselves", zap.String("resource", res), zap.Error(err))
	}
}

// failClosed blocks res for good (until the proxy restarts), with g.mu held.
func (g *EtcdGuard) failClosed(res, why string) {
	if g.regress[res] != nil {
		return
	}
	fe := fence.Unavailable(res, "etcd's revisions went backwards: "+why)
	fe.Hint = "Restore etcd with etcdutl snapshot restore --bump-revision, or reset the resource's fence (`fenceproxy fence reset --resource " +
		res + " --token <the new leader's revision> --database <the protected database's URL>`), then restart the proxies (docs/etcd.md: What a restore does)."
	g.regress[res] = fe
	g.log.Error("failing closed: etcd revision regression", zap.String("resource", res), zap.String("store", lease.StoreEtcd), zap.String("why", why))
	g.reg.Block(res, fe)
	go g.persist(res, max(g.leaders[res].rev, 1), why) // g.mu is held: not here
}

func (g *EtcdGuard) regression(res string) *fence.Error {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.regress[res]
}

// Admit implements Admitter: the token must be the current leader key's CreateRevision.
func (g *EtcdGuard) Admit(ctx context.Context, c fence.Credentials) error {
	_, err := g.AdmitHolder(ctx, c)
	return err
}

// AdmitHolder implements HolderAdmitter: Admit, naming the leader key's session lease, so
// that the session's bind records (token, lease) in its own database (one token, one
// holder, with or without --control-database).
func (g *EtcdGuard) AdmitHolder(ctx context.Context, c fence.Credentials) (string, error) {
	if _, ok := g.prefixes[c.Resource]; !ok {
		return "", nil
	}
	l, _, err := g.leader(ctx, c.Resource)
	if fe := g.regression(c.Resource); fe != nil {
		return "", fe
	}
	if err := admitHolder(c, l.rev, err, holderWords{
		store:        "etcd",
		noHolder:     fmt.Sprintf("the etcd election %s of resource %q has no leader (token %d); the session expired or resigned, or the election is held under another prefix", g.prefixes[c.Resource], c.Resource, c.Token),
		noHolderHint: fmt.Sprintf("Campaign again on the prefix this proxy validates (fenceproxy lock --store etcd --prefix %s) and use the new leader key's CreateRevision.", strings.TrimSuffix(g.prefixes[c.Resource], "/")),
		current:      "the CreateRevision %d of etcd's current leader key",
		currentHint:  "Use the leader key's CreateRevision (concurrency.Election.Rev()) that this process won the election with.",
		holder:       l.holder,
		holderKind:   "etcd lease",
	}); err != nil {
		return "", err
	}
	return "etcd lease " + l.holder, g.record(ctx, c.Resource, l)
}

// holderWords word a guard's refusals for its store.
type holderWords struct {
	store        string // the store's name in messages
	noHolder     string // why the lock is not held (ZF006's message, after its prefix)
	noHolderHint string
	current      string // the holder's token, a format with one %d
	currentHint  string // what the holder's token is (ZF002's hint)
	holder       string // the current holder's ID, which fence.session must name
	holderKind   string // what that ID is, in messages ("etcd lease", "ZooKeeper session")
}

// admitHolder is a guard's answer to c given the store's current holder's token (0: the
// lock is not held) or why it could not be read.
//
// One token, one holder, also when nothing recorded the first one: the session must name
// the holder (fence.session), and only the current holder is admitted. A store that lost
// its data (a wipe, a restore) can issue a number again to another holder while no proxy
// watches; the stale holder of the first issue presents the same token, and without its
// holder's ID the proxy cannot tell the two apart (a review had both commit, 6 runs of 6).
func admitHolder(c fence.Credentials, current int64, err error, w holderWords) error {
	switch {
	case err != nil:
		return fence.Unavailable(c.Resource, w.store+"'s lock state is unknown ("+err.Error()+"); no token is admitted without "+w.store+"'s word")
	case current == 0:
		fe := fence.NotHeld(c.Resource, c.Token)
		fe.Message = "fencing lock not held: " + w.noHolder
		fe.Hint = w.noHolderHint
		return fe
	case c.Token < current:
		return fence.Stale(c.Resource, c.Token, current)
	case c.Token > current:
		fe := fence.NotIssued(c.Resource, c.Token, current)
		fe.Message = fmt.Sprintf("fencing token not issued: resource %q token %d is higher than "+w.current, c.Resource, c.Token, current)
		fe.Hint = w.currentHint
		return fe
	case c.Session == "":
		return &fence.Error{Code: fence.CodeMissing, Resource: c.Resource, Token: c.Token,
			Message: fmt.Sprintf("fencing session missing: resource %q is validated by %s, and a session must name its lock's holder: set fence.session to the %s ID (hex) this process holds the lock with", c.Resource, w.store, w.holderKind),
			Hint:    "fenceproxy lock puts it in DATABASE_URL and FENCE_SESSION; see docs/applications.md."}
	case !strings.EqualFold(c.Session, w.holder):
		fe := fence.HolderMismatch(c.Resource, c.Session, w.holder)
		fe.Message = fmt.Sprintf("fencing session mismatch: resource %q token %d is held by %s %s, not %s", c.Resource, c.Token, w.holderKind, w.holder, c.Session)
		fe.Hint = fmt.Sprintf("This process is no longer the leader, or fence.session is not its %s ID in hex (FENCE_SESSION of fenceproxy lock; a newcomer passed it in decimal).", w.holderKind)
		return fe
	}
	return nil
}

// Run watches every election until ctx ends, raising each new leader's token.
func (g *EtcdGuard) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	for res := range g.prefixes {
		wg.Go(func() { g.follow(ctx, res) })
	}
	wg.Wait()
	if g.pool != nil {
		g.pool.Close()
	}
	return g.client.Close()
}

// follow reads res's election, reacts, and waits for the next change under its prefix.
func (g *EtcdGuard) follow(ctx context.Context, res string) {
	log := g.log.With(zap.String("resource", res), zap.String("store", lease.StoreEtcd))
	for ctx.Err() == nil {
		l, store, err := g.leader(ctx, res)
		if err != nil {
			log.Warn("read etcd election", zap.Error(err))
			sleep(ctx, time.Second)
			continue
		}
		if l.rev > 0 && g.regression(res) == nil {
			g.observe(ctx, res, l, log)
		}
		wctx, wcancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		wch := g.client.Watch(wctx, g.prefixes[res], clientv3.WithPrefix(), clientv3.WithRev(store+1))
		select {
		case <-ctx.Done():
		case <-wch: // any change, or the watch ended: read again
		}
		wcancel()
	}
}

// observe raises a leader's token that is new to this proxy, once the database's record
// agrees it is the leader's.
func (g *EtcdGuard) observe(ctx context.Context, res string, l etcdLeader, log *zap.Logger) {
	rev := l.rev
	if rev <= g.reg.Highest("", res) {
		return
	}
	if err := g.record(ctx, res, l); err != nil {
		log.Warn("new leader not raised", zap.Int64("token", rev), zap.Error(err))
		return
	}
	// Sessions of older tokens are ended from now on, in every database; the database
	// raise makes it binding for every proxy.
	g.reg.Observe("", res, rev)
	if g.pool == nil {
		return
	}
	stored, err := raiseStored(ctx, g.pool, g.key, res, rev)
	switch {
	case err != nil:
		log.Error("proactive raise failed; the new leader's token is raised when it connects", zap.Int64("token", rev), zap.Error(err))
	case stored > rev:
		g.mu.Lock()
		g.failClosed(res, fmt.Sprintf("the database admitted token %d but etcd's leader key was created at revision %d", stored, rev))
		g.mu.Unlock()
	default:
		log.Info("raised token for the new leader", zap.Int64("token", rev))
	}
}

// Admitters admits a session when each of its Admitters does (each validates its own
// resources and admits the others'), for a proxy that validates against Consul and etcd.
type Admitters []Admitter

// Admit implements Admitter.
func (as Admitters) Admit(ctx context.Context, c fence.Credentials) error {
	for _, a := range as {
		if err := a.Admit(ctx, c); err != nil {
			return err
		}
	}
	return nil
}

// AdmitHolder implements HolderAdmitter: the holder named by the Admitter that validates
// resource, if it names one.
func (as Admitters) AdmitHolder(ctx context.Context, c fence.Credentials) (string, error) {
	holder := ""
	for _, a := range as {
		if ha, ok := a.(HolderAdmitter); ok {
			h, err := ha.AdmitHolder(ctx, c)
			if err != nil {
				return "", err
			}
			holder = cmp.Or(holder, h)
		} else if err := a.Admit(ctx, c); err != nil {
			return "", err
		}
	}
	return holder, nil
}

// Judge implements HolderAdmitter: the judgement of the Admitter that validates resource.
func (as Admitters) Judge(ctx context.Context, resource string, token int64, holder string, rec fence.ConsulRecord) error {
	for _, a := range as {
		if ha, ok := a.(HolderAdmitter); ok && guardOf(a, resource) != nil {
			return ha.Judge(ctx, resource, token, holder, rec)
		}
	}
	return fence.Unavailable(resource, "no admitter validates the resource against Consul")
}

// Authority names what the guard validates resource's tokens against ("": none), for hints.
func (g *EtcdGuard) Authority(resource string) string {
	if p, ok := g.prefixes[resource]; ok {
		return fmt.Sprintf("etcd election prefix %q", p)
	}
	return ""
}

// Authority implements the guards' Authority: the first Admitter's that names one.
func (as Admitters) Authority(resource string) string {
	for _, a := range as {
		if n := authority(a, resource); n != "" {
			return n
		}
	}
	return ""
}

// authority is a's Authority for resource ("": a names none).
func authority(a Admitter, resource string) string {
	if n, ok := a.(interface{ Authority(string) string }); ok {
		return n.Authority(resource)
	}
	return ""
}

func validates(a Admitter, resource string) bool {
	v, ok := a.(interface{ Validates(string) bool })
	return ok && v.Validates(resource)
}

// Validates reports whether one of the Admitters checks resource's tokens against Consul
// (see session.admit).
func (as Admitters) Validates(resource string) bool {
	for _, a := range as {
		if validates(a, resource) {
			return true
		}
	}
	return false
}

// plainResource checks that name, from spec of a guard's flag, is a --resource (that no other
// lock service validates it, validate's declareResources checked).
func plainResource(s *settings, flag, spec, name string) error {
	if slices.Contains(s.names, name) {
		return nil
	}
	return fmt.Errorf("%s %q: %s is not a --resource", flag, spec, name)
}

// raiseStored raises res's token in the database through pool (a guard's proactive raise)
// and returns the token the database then holds.
func raiseStored(ctx context.Context, pool *pgxpool.Pool, key fence.Key, res string, token int64) (int64, error) {
	var stored int64
	err := onControl(ctx, pool, func(conn *pgx.Conn) error {
		var err error
		stored, err = key.Raise(ctx, conn, res, token)
		return err
	})
	return stored, err
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
