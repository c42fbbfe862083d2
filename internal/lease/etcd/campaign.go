// Package etcd is etcd as a lock service: campaigning through etcd's election recipe (Store,
// the token the leader key's CreateRevision) and the Authority the proxy asks (the election's
// leader, read linearizably, and a watch of its prefix).
package etcd

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/lease"
)

// Config says how to reach etcd's v3 API.
type Config struct {
	// Endpoints are client URLs (http://host:2379, https://host:2379) or host:port.
	Endpoints []string
	// Username and Password, when etcd's authentication is on. The role needs read and
	// write on the election prefix (and lease grant and revoke, which every user has).
	Username, Password string
	// CAFile verifies etcd's TLS certificate; CertFile and KeyFile are the client
	// certificate, when etcd asks for one. Any of them turns TLS on.
	CAFile, CertFile, KeyFile string
	// Logger receives the client's own warnings (nil: none).
	Logger *zap.Logger
}

// NewClient returns an etcd v3 client for c. It does not wait for a connection: the
// first request does, until its ctx ends.
func NewClient(c Config) (*clientv3.Client, error) {
	if len(c.Endpoints) == 0 {
		return nil, errors.New("lease: etcd: no endpoints")
	}
	cfg := clientv3.Config{Endpoints: c.Endpoints, Username: c.Username, Password: c.Password, Logger: c.Logger}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	if c.CAFile != "" || c.CertFile != "" || c.KeyFile != "" {
		tlsInfo := transport.TLSInfo{TrustedCAFile: c.CAFile, CertFile: c.CertFile, KeyFile: c.KeyFile}
		tlsCfg, err := tlsInfo.ClientConfig()
		if err != nil {
			return nil, fmt.Errorf("lease: etcd TLS: %w", err)
		}
		cfg.TLS = tlsCfg
	}
	cli, err := clientv3.New(cfg)
	if err != nil {
		return nil, fmt.Errorf("lease: etcd client for %s: %w", strings.Join(c.Endpoints, ","), err)
	}
	return cli, nil
}

// Store grants leases through etcd's election recipe (client/v3/concurrency): a
// session (an etcd lease with a TTL, kept alive by the client) and a key under the
// election's prefix created with that lease; the oldest key leads. The fencing token is
// the leader key's CreateRevision (Election.Rev): the store-wide revision of the
// transaction that created it, so every later key, under this prefix or any other, has a
// higher one, also after the earlier key was deleted. Only a snapshot restore moves
// revisions back (etcdutl snapshot restore has --bump-revision to avoid it).
//
// Timing. etcd expires a session's lease TTL after the leader last renewed it; the client
// renews every TTL/3 and counts it lost TTL after it RECEIVED the last renewal's answer,
// slightly later than the server's expiry. The lease's Done also fires as soon as the
// server deletes the leader key (expiry, revocation, a delete by anyone), which a watch
// reports within a round trip when etcd is reachable. A holder frozen past its TTL learns
// it within a keepalive round (half a second) of waking; fencing, not this, keeps its
// writes out.
type Store struct {
	// Client is the etcd client (NewClient). Required; the store does not close it.
	Client *clientv3.Client
	// Prefix is the election's key prefix; default "locks/<resource>". Contenders for one
	// resource must use the same prefix; keys under it are "<prefix>/<lease ID in hex>".
	Prefix string
	// TTL is the session lease's time to live, whole seconds from 1 s to 24 h; default
	// lease.DefaultTTL. etcd raises a TTL below its minimum (1.5 x its election timeout).
	TTL time.Duration
	// Holder is the value of the leader key, shown by `etcdctl get --prefix`; default
	// host:pid:random, drawn anew for each Campaign.
	Holder string
	// Logger (nil: no logs).
	Logger *zap.Logger
}

// Name is lease.StoreEtcd.
func (s *Store) Name() string { return lease.StoreEtcd }

func (s *Store) prefix(resource string) string {
	if s.Prefix != "" {
		return strings.TrimSuffix(s.Prefix, "/")
	}
	return "locks/" + resource
}

// Campaign blocks until this store's session leads resource's election, or ctx ends. An
// etcd that cannot be reached is waited for (each attempt to create a session gives up
// after max(TTL, 5 s), is logged and retried with backoff); a refusal that retrying cannot
// change (authentication failed, permission denied, a TTL out of range) is returned
// wrapping lease.ErrRefused.
func (s *Store) Campaign(ctx context.Context, resource string) (lease.Lease, error) {
	if s.Client == nil {
		return nil, fmt.Errorf("lease: %w: etcd store without a client", lease.ErrRefused)
	}
	ttl := s.TTL
	if ttl == 0 {
		ttl = lease.DefaultTTL
	}
	if ttl < time.Second || ttl > 24*time.Hour || ttl%time.Second != 0 {
		return nil, fmt.Errorf("lease: %w: etcd lease TTL %v: want whole seconds from 1s to 24h", lease.ErrRefused, ttl)
	}
	holder := s.Holder
	if holder == "" {
		var err error
		if holder, err = lease.DefaultHolder(); err != nil {
			return nil, err
		}
	}
	log := s.Logger
	if log == nil {
		log = zap.NewNop()
	}
	prefix := s.prefix(resource)
	log = log.With(zap.String("store", lease.StoreEtcd), zap.String("key", prefix))
	log.Info("campaigning", zap.String("holder", holder))
	retry := lease.NewBackoff(100*time.Millisecond, 2*time.Second)
	for {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("lease: campaign for etcd election %s: %w", prefix, err)
		}
		l, err := s.campaignOnce(ctx, prefix, holder, ttl, log)
		switch {
		case err == nil:
			return l, nil
		case ctx.Err() != nil:
			continue
		case permanent(err):
			return nil, fmt.Errorf("lease: %w: etcd election %s: %w", lease.ErrRefused, prefix, err)
		}
		log.Warn("campaign on etcd", zap.Error(err))
		retry.Wait(ctx)
	}
}

// campaignOnce creates a session, campaigns with it and checks the result. Whatever fails,
// the session is closed (its lease revoked, which deletes its key) before returning.
func (s *Store) campaignOnce(ctx context.Context, prefix, holder string, ttl time.Duration, log *zap.Logger) (*held, error) {
	cli := s.Client
	// The grant gets its own deadline: with etcd unreachable, a request waits for a
	// connection until its ctx ends, and the caller should hear about it.
	gctx, cancel := context.WithTimeout(ctx, max(ttl, 5*time.Second))
	grant, err := cli.Grant(gctx, int64(ttl/time.Second))
	cancel()
	if err != nil {
		return nil, fmt.Errorf("grant a session lease: %w", err)
	}
	if time.Duration(grant.TTL)*time.Second != ttl {
		log.Warn("etcd changed the session TTL", zap.Duration("asked", ttl), zap.Int64("granted_seconds", grant.TTL))
	}
	// The session must outlive ctx: when the supervisor is told to stop, the lease is
	// kept until its child has stopped, and Release ends it.
	sctx, endSession := context.WithCancel(context.WithoutCancel(ctx))
	session, err := concurrency.NewSession(cli, concurrency.WithLease(grant.ID),
		concurrency.WithTTL(int(grant.TTL)), concurrency.WithContext(sctx))
	if err != nil {
		endSession()
		revokeQuietly(cli, grant.ID)
		return nil, fmt.Errorf("keep the session lease alive: %w", err)
	}
	abandon := func() {
		session.Orphan()
		revokeQuietly(cli, grant.ID)
		endSession()
	}
	election := concurrency.NewElection(session, prefix)
	if leader, err := election.Leader(ctx); err == nil && len(leader.Kvs) > 0 {
		log.Info("election led by another holder; waiting", zap.String("holder", string(leader.Kvs[0].Value)),
			zap.Int64("token", leader.Kvs[0].CreateRevision))
	}
	// A session that expires while waiting deletes our key, but Campaign only waits for
	// the older keys to go: it must stop when the session does.
	cctx, stopCampaign := context.WithCancel(ctx)
	defer stopCampaign()
	go func() {
		select {
		case <-session.Done():
			stopCampaign()
		case <-cctx.Done():
		}
	}()
	if err := election.Campaign(cctx, holder); err != nil {
		abandon()
		select {
		case <-session.Done():
			return nil, fmt.Errorf("session lease %x expired while campaigning: %w", grant.ID, err)
		default:
		}
		return nil, fmt.Errorf("campaign: %w", err)
	}
	// Campaign returns when the older keys are gone; check with a linearizable read that
	// ours is still there and now the oldest: the session may have been lost on the way.
	resp, err := cli.Get(ctx, prefix+"/", clientv3.WithFirstCreate()...)
	if err != nil {
		abandon()
		return nil, fmt.Errorf("read the election after campaigning: %w", err)
	}
	if len(resp.Kvs) == 0 || string(resp.Kvs[0].Key) != election.Key() || resp.Kvs[0].CreateRevision != election.Rev() {
		abandon()
		return nil, fmt.Errorf("session lease %x: its key %s is not the leader after campaigning (expired or deleted)",
			grant.ID, election.Key())
	}
	l := &held{
		client: cli, session: session, election: election, endSession: endSession,
		key: election.Key(), token: election.Rev(), holder: fmt.Sprintf("%x", grant.ID),
		ttl: time.Duration(grant.TTL) * time.Second, log: log,
		Outcome: lease.NewOutcome(), stopped: make(chan struct{}),
	}
	l.log = log.With(zap.String("session", l.holder))
	mctx, stop := context.WithCancel(context.WithoutCancel(ctx))
	l.stop = stop
	go l.monitor(mctx, resp.Header.Revision)
	return l, nil
}

// permanent reports an error that retrying cannot change: authentication or
// permission refused, a TTL etcd will not grant.
func permanent(err error) bool {
	for _, target := range []error{
		rpctypes.ErrAuthFailed, rpctypes.ErrPermissionDenied, rpctypes.ErrUserEmpty,
		rpctypes.ErrLeaseTTLTooLarge, rpctypes.ErrAuthNotEnabled,
	} {
		if errors.Is(err, target) {
			return true
		}
	}
	return false
}

func revokeQuietly(cli *clientv3.Client, id clientv3.LeaseID) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, _ = cli.Revoke(ctx, id) // else it expires on its own
}

// held is a won election.
type held struct {
	client     *clientv3.Client
	session    *concurrency.Session
	election   *concurrency.Election
	endSession context.CancelFunc
	key        string
	token      int64
	holder     string
	ttl        time.Duration
	log        *zap.Logger

	lease.Outcome
	stop    context.CancelFunc // stops the monitor
	stopped chan struct{}      // closed when the monitor returned
}

func (l *held) Store() string  { return lease.StoreEtcd }
func (l *held) Key() string    { return l.key }
func (l *held) Holder() string { return l.holder }
func (l *held) Token() int64   { return l.token }

func (l *held) lost(format string, args ...any) {
	err := fmt.Errorf("%w: etcd key %s (CreateRevision %d): %s", lease.ErrLockLost, l.key, l.token, fmt.Sprintf(format, args...))
	l.log.Warn("lock lost", zap.Int64("token", l.token), zap.Error(err))
	l.Finish(err)
}

// monitor ends the lease when the session ends (its keepalives stopped: etcd unreachable
// or this process frozen for a TTL) or when the leader key is deleted (the lease expired
// or was revoked on the server, or someone deleted the key), whichever it sees first.
// from is a revision at which the key was known to be ours.
func (l *held) monitor(ctx context.Context, from int64) {
	defer close(l.stopped)
	retry := lease.NewBackoff(100*time.Millisecond, time.Second)
	for {
		// WithRequireLeader: a member cut off from its cluster's leader cancels the watch
		// instead of leaving it silent. Watch itself blocks until it reaches etcd, so it
		// is cancelled when the session ends.
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		unhook := context.AfterFunc(l.session.Ctx(), cancel)
		wch := l.client.Watch(wctx, l.key, clientv3.WithRev(from+1))
		gone, why := l.follow(ctx, wch)
		unhook()
		cancel()
		if ctx.Err() != nil {
			return
		}
		if gone {
			l.lost("%s", why)
			return
		}
		// The watch ended (compaction, a lost leader, a connection lost): read the key
		// again, linearizably, and watch on from there.
		for {
			if !retry.Wait(ctx) {
				return
			}
			select {
			case <-l.session.Done():
				l.lost("the session lease %s was not renewed within its TTL of %v (etcd unreachable, or this process was frozen)", l.holder, l.ttl)
				return
			default:
			}
			rctx, rcancel := context.WithTimeout(ctx, l.ttl)
			resp, err := l.client.Get(rctx, l.key)
			rcancel()
			if err != nil {
				l.log.Warn("read leader key", zap.Error(err))
				continue
			}
			if len(resp.Kvs) == 0 || resp.Kvs[0].CreateRevision != l.token {
				l.lost("the leader key is gone (read at revision %d)", resp.Header.Revision)
				return
			}
			from = resp.Header.Revision
			retry.Reset()
			break
		}
	}
}

// follow reads wch until the key is deleted (gone, and why), the watch ends or the
// session does.
func (l *held) follow(ctx context.Context, wch clientv3.WatchChan) (gone bool, why string) {
	for {
		select {
		case <-ctx.Done():
			return false, ""
		case <-l.session.Done():
			return true, fmt.Sprintf("the session lease %s was not renewed within its TTL of %v (etcd unreachable, or this process was frozen)", l.holder, l.ttl)
		case wr, ok := <-wch:
			if !ok || wr.Canceled || wr.Err() != nil {
				if wr.Err() != nil {
					l.log.Warn("watch leader key", zap.Error(wr.Err()))
				}
				return false, ""
			}
			for _, ev := range wr.Events {
				if ev.Type == mvccpb.DELETE {
					return true, fmt.Sprintf("the leader key was deleted at revision %d (session lease %s expired or revoked, or the key deleted)",
						ev.Kv.ModRevision, l.holder)
				}
			}
		}
	}
}

// Release resigns (deletes the leader key if it is still ours) and revokes the session's
// lease. A lease that is already lost is revoked all the same, so that a key it may still
// hold goes at once instead of at its expiry.
func (l *held) Release(ctx context.Context) error {
	l.stop()
	<-l.stopped
	defer l.Finish(lease.ErrReleased)
	if errors.Is(l.Err(), lease.ErrReleased) {
		return nil
	}
	wasHeld := l.Err() == nil
	var rerr error
	if wasHeld {
		// A lost lease's key is gone or goes with its lease; a resign would only wait
		// for an etcd that may be unreachable.
		rerr = l.election.Resign(ctx)
	}
	l.session.Orphan()
	_, verr := l.client.Revoke(ctx, l.session.Lease())
	l.endSession()
	if errors.Is(verr, rpctypes.ErrLeaseNotFound) {
		verr = nil // expired already
	}
	if err := errors.Join(rerr, verr); err != nil && wasHeld {
		// The key goes with the lease at its expiry, TTL after the last renewal.
		return fmt.Errorf("lease: release etcd key %s: %w", l.key, err)
	}
	return nil
}
