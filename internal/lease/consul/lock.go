package consul

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/consul/api"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/lease"
)

// lockWaitTime is how long one blocking query of Acquire and of the Lock monitor waits.
// ctx and the session's end interrupt it; what it bounds is how long a query that started
// after a snapshot restore, on an index the restored state has not reached, waits before
// the monitor reads afresh and sees that the key moved back.
const lockWaitTime = 10 * time.Second

// Lock is a lock key held by a Session, with the fencing token of this acquisition.
type Lock struct {
	key         string
	session     *Session
	token       int64 // the LockIndex, as a token
	lockIndex   uint64
	createIndex uint64

	done    chan struct{}
	stop    context.CancelFunc // stops the monitor
	stopped chan struct{}      // closed when the monitor returned
	mu      sync.Mutex
	err     error
}

// Acquire blocks until session holds key, then returns the Lock with its token. While
// another session holds the key it waits with blocking queries (no polling); when the key
// is free but Consul refuses it (the previous holder's lock-delay), it retries with a
// backoff of at most 2 s. It returns early when ctx ends (ctx's error) or the session ends
// (lease.ErrSessionExpired or the session's ctx error). Consul errors are retried: a Consul that
// stays away ends the session after its TTL, and with it Acquire.
//
// When ctx ends while the lock request is in flight, Consul may still grant it: the key is
// then held by the session until the session is closed (Session.Close releases it).
//
// The key's Flags are set to api.LockFlagValue, so that Consul's own lock clients
// (`consul lock`, api.Lock) and this package contend for the same key correctly.
func Acquire(ctx context.Context, s *Session, key string) (*Lock, error) {
	if key == "" || key[0] == '/' {
		return nil, fmt.Errorf("lease: Acquire: invalid key %q", key)
	}
	// Every wait below also ends when the session does.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-s.Done():
			cancel()
		case <-ctx.Done():
		}
	}()

	retry := lease.NewBackoff(100*time.Millisecond, 2*time.Second)
	for {
		if err := acquireAborted(ctx, s); err != nil {
			return nil, fmt.Errorf("lease: acquire %q: %w", key, err)
		}
		l, held, err := tryLock(ctx, s, key)
		if err == nil && l != nil {
			return l, nil
		}
		if Permanent(err) {
			return nil, fmt.Errorf("lease: acquire %q: %w: %w", key, lease.ErrRefused, err)
		}
		if err != nil {
			if acquireAborted(ctx, s) == nil {
				s.log.Warn("acquire lock", zap.String("key", key), zap.Error(err))
			}
			retry.Wait(ctx)
			continue
		}
		if held == "" {
			// Free, yet refused: a lock-delay runs (or another contender won and we
			// read before its write). Consul's KV index does not move when a
			// lock-delay ends, so a blocking query would not wake us: retry.
			retry.Wait(ctx)
			continue
		}
		retry.Reset()
		if err := waitFree(ctx, s.client, key); err != nil && acquireAborted(ctx, s) == nil {
			s.log.Warn("wait for lock", zap.String("key", key), zap.Error(err))
			retry.Wait(ctx)
		}
	}
}

func acquireAborted(ctx context.Context, s *Session) error {
	select {
	case <-s.Done():
		return s.Err()
	default:
	}
	return ctx.Err()
}

// tryLock attempts the acquisition and reads the LockIndex it produced in one Consul
// transaction: the lock operation and the read are applied together through Raft, so the
// LockIndex returned is the one of our acquisition, with nothing in between (a separate
// read after the acquire could see a later holder's index). The result is still checked to
// show our session. On refusal it returns the holder it read ("" if free).
func tryLock(ctx context.Context, s *Session, key string) (*Lock, string, error) {
	ops := api.TxnOps{
		{KV: &api.KVTxnOp{Verb: api.KVLock, Key: key, Session: s.id, Flags: api.LockFlagValue}},
		{KV: &api.KVTxnOp{Verb: api.KVGet, Key: key}},
	}
	ok, resp, _, err := s.client.Txn().Txn(ops, (&api.QueryOptions{}).WithContext(ctx))
	if err != nil {
		return nil, "", fmt.Errorf("lock transaction: %w", err)
	}
	if !ok {
		// Refused: held by another session, a lock-delay, or our session is invalid.
		// A consistent read tells which.
		st, err := Read(ctx, s.client, key)
		if err != nil {
			return nil, "", err
		}
		if st.Held && st.Session == s.id {
			// Refused but ours: impossible unless another of our own calls raced us.
			return nil, "", fmt.Errorf("lock refused although held by our session: %s", txnErrors(resp))
		}
		return nil, st.Session, nil
	}
	var pair *api.KVPair
	for _, r := range resp.Results {
		if r.KV != nil && r.KV.Key == key {
			pair = r.KV
		}
	}
	switch {
	case pair == nil:
		return nil, "", errors.New("lock transaction returned no key")
	case pair.Session != s.id:
		return nil, pair.Session, fmt.Errorf("lock transaction shows holder %q, not our session %s", pair.Session, s.id)
	case pair.LockIndex == 0:
		return nil, "", errors.New("lock transaction shows LockIndex 0")
	}
	mctx, stop := context.WithCancel(context.WithoutCancel(ctx))
	l := &Lock{
		key: key, session: s, token: lease.ClampToken(pair.LockIndex), lockIndex: pair.LockIndex, createIndex: pair.CreateIndex,
		done: make(chan struct{}), stop: stop, stopped: make(chan struct{}),
	}
	go l.monitor(mctx, pair.ModifyIndex)
	return l, s.id, nil
}

func txnErrors(resp *api.TxnResponse) string {
	if resp == nil {
		return "no details"
	}
	var msgs []string
	for _, e := range resp.Errors {
		msgs = append(msgs, e.What)
	}
	return strings.Join(msgs, "; ")
}

// waitFree blocks until the key's holder changes or it is free (or after one blocking
// query's wait time).
func waitFree(ctx context.Context, client *api.Client, key string) error {
	kv := client.KV()
	pair, meta, err := kv.Get(key, (&api.QueryOptions{RequireConsistent: true}).WithContext(ctx))
	if err != nil {
		return err
	}
	if pair == nil || pair.Session == "" {
		return nil
	}
	holder := pair.Session
	index := meta.LastIndex
	for {
		q := &api.QueryOptions{RequireConsistent: true, WaitIndex: index, WaitTime: lockWaitTime}
		started := time.Now()
		pair, meta, err = kv.Get(key, q.WithContext(ctx))
		if err != nil {
			return err
		}
		if pair == nil || pair.Session != holder {
			return nil
		}
		index = nextIndex(index, meta.LastIndex, time.Since(started) < lockWaitTime/2)
	}
}

// Key is the lock's Consul key.
func (l *Lock) Key() string { return l.key }

// Token is the fencing token of mode TokenLockIndex: the LockIndex of this acquisition.
func (l *Lock) Token() int64 { return l.token }

// TokenOf is the fencing token of this acquisition in mode m (lease.EncodeToken for
// lease.TokenCreateLock); the error wraps lease.ErrTokenRange when the indexes do not fit.
func (l *Lock) TokenOf(m lease.TokenMode) (int64, error) {
	return m.TokenOf(true, l.createIndex, l.lockIndex)
}

// Session is the session that holds the lock.
func (l *Lock) Session() *Session { return l.session }

// Done is closed when the lock is lost (the session ended, or the key was released,
// taken, deleted or overwritten: anything after which the key no longer shows this
// acquisition) or released. Err says which.
func (l *Lock) Done() <-chan struct{} { return l.done }

// Err is nil while the lock is held; after Done it wraps lease.ErrLockLost (with the cause,
// lease.ErrSessionExpired among them) or is lease.ErrReleased.
func (l *Lock) Err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.err
}

func (l *Lock) finish(err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err == nil {
		l.err = err
		close(l.done)
	}
}

// monitor watches the key with consistent blocking queries and ends the lock as soon as
// the key stops showing this acquisition. Consul errors are retried: while Consul is
// away the session's own renewal decides (it ends after one TTL without renewal).
func (l *Lock) monitor(ctx context.Context, index uint64) {
	defer close(l.stopped)
	defer l.stop() // ends the goroutine below when the lock is lost
	kv := l.session.client.KV()
	retry := lease.NewBackoff(100*time.Millisecond, 2*time.Second)
	lost := func(format string, args ...any) {
		err := fmt.Errorf("%w: %q: %s", lease.ErrLockLost, l.key, fmt.Sprintf(format, args...))
		l.session.log.Warn("lock lost", zap.String("key", l.key), zap.Int64("token", l.token), zap.Error(err))
		l.finish(err)
	}
	go func() {
		select {
		case <-l.session.Done():
			lost("session ended: %v", l.session.Err())
		case <-ctx.Done():
		}
	}()
	for {
		q := &api.QueryOptions{RequireConsistent: true, WaitIndex: index, WaitTime: lockWaitTime}
		started := time.Now()
		pair, meta, err := kv.Get(l.key, q.WithContext(ctx))
		if ctx.Err() != nil {
			return
		}
		select {
		case <-l.done:
			return
		default:
		}
		if err != nil {
			retry.Wait(ctx)
			continue
		}
		retry.Reset()
		switch {
		case pair == nil:
			lost("the key was deleted")
			return
		case pair.CreateIndex != l.createIndex:
			lost("the key was deleted and created again")
			return
		case pair.Session != l.session.id:
			if pair.Session == "" {
				lost("the key was released")
			} else {
				lost("the key is held by session %s", pair.Session)
			}
			return
		case l.lockIndex != pair.LockIndex:
			lost("LockIndex is %d, not our %d", pair.LockIndex, l.lockIndex)
			return
		}
		index = nextIndex(index, meta.LastIndex, time.Since(started) < lockWaitTime/2)
	}
}

// Release releases the lock (its holder becomes empty; the LockIndex stays, and the next
// acquisition by anyone increments it) and stops watching it. A lock that was already lost
// is not touched: Consul only releases a key for its holder session. The session stays
// alive; Close it when done.
func (l *Lock) Release(ctx context.Context) error {
	l.stop()
	<-l.stopped
	pair := &api.KVPair{Key: l.key, Session: l.session.id, Flags: api.LockFlagValue}
	if _, _, err := l.session.client.KV().Release(pair, (&api.WriteOptions{}).WithContext(ctx)); err != nil {
		return fmt.Errorf("lease: release %q: %w", l.key, err)
	}
	l.finish(lease.ErrReleased)
	return nil
}

// Store grants Consul locks (Store): each Campaign creates a session and acquires the
// resource's key with it (NewSession, Acquire). Releasing one of its leases releases the key
// and destroys the session.
type Store struct {
	Client *api.Client // required
	// Key is the lock key; empty: "locks/" + the resource.
	Key       string
	TTL       time.Duration // session TTL; default lease.DefaultTTL
	LockDelay time.Duration // session lock-delay; default DefaultLockDelay (0)
	// TokenMode is the token its leases hand out (lease.Lease.Token); it must be the proxy's
	// --consul-token-mode. Empty: lease.TokenLockIndex.
	TokenMode lease.TokenMode
	Logger    *zap.Logger // nil: no logs
	Clock     lease.Clock // the session keep-alive's clock; nil: time.Now
}

// Name is lease.StoreConsul.
func (c *Store) Name() string { return lease.StoreConsul }

// Campaign creates a session and blocks until it holds the lock key (Acquire). The session
// outlives ctx on purpose: a holder must be able to stop its work before the key is released,
// which the lease's Release does.
func (c *Store) Campaign(ctx context.Context, resource string) (lease.Lease, error) {
	if c.Client == nil {
		return nil, errors.New("lease: Store: nil Consul client")
	}
	mode, err := lease.ParseTokenMode(string(c.TokenMode))
	if err != nil {
		return nil, fmt.Errorf("%w: %w", lease.ErrRefused, err)
	}
	key := c.Key
	if key == "" {
		key = "locks/" + resource
	}
	log := c.Logger
	if log == nil {
		log = zap.NewNop()
	}
	ttl := c.TTL
	if ttl == 0 {
		ttl = lease.DefaultTTL
	}
	sess, err := NewSession(context.WithoutCancel(ctx), c.Client,
		WithTTL(ttl), WithLockDelay(c.LockDelay), WithLogger(log), WithName("fenceproxy lock "+resource), WithClock(c.Clock))
	if Permanent(err) {
		// An ACL refusal or a wrong scheme: campaigning again cannot change it.
		return nil, fmt.Errorf("%w: %w", lease.ErrRefused, err)
	}
	if err != nil {
		return nil, err
	}
	log.Info("campaigning", zap.String("store", lease.StoreConsul), zap.String("session", sess.ID()), zap.String("key", key))
	lock, err := Acquire(ctx, sess, key)
	if err != nil {
		closeSession(sess, log)
		return nil, err
	}
	l := &held{Lock: lock, log: log}
	if l.token, err = lock.TokenOf(mode); err != nil {
		// The key's indexes do not fit the encoding: no token to give. Campaigning again
		// would win the same key; the operator has to act (lease.EncodeToken says how).
		rerr := l.Release(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("%w: lock %q: %w", lease.ErrRefused, key, errors.Join(err, rerr))
	}
	return l, nil
}

// held is a Lock as a lease.Lease, with the token of the store's mode: its Release also
// destroys the session.
type held struct {
	*Lock
	token int64
	log   *zap.Logger
}

func (l *held) Token() int64 { return l.token }

func (l *held) Store() string  { return lease.StoreConsul }
func (l *held) Holder() string { return l.session.id }

func (l *held) Release(ctx context.Context) error {
	err := l.Lock.Release(ctx)
	// Destroying the session releases the key as well, should the release have failed.
	closeSession(l.session, l.log)
	return err
}

func closeSession(s *Session, log *zap.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.Close(ctx); err != nil {
		log.Warn("close consul session", zap.Error(err))
	}
}
