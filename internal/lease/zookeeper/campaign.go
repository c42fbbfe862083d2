// Package zookeeper is ZooKeeper as a lock service: campaigning through the lock recipe
// (Store, the token the lock node's czxid) and the Authority the proxy asks (the owner of the
// folder's lowest lock node, read after a sync, and a watch of the folder's children).
package zookeeper

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-zookeeper/zk"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/lease"
)

// Store grants leases through ZooKeeper's lock recipe: each contender creates an
// ephemeral sequential znode under the lock folder (default /locks/<resource>) with a
// session of its own; the lowest sequence number holds the lock, and every other contender
// watches only the node just below its own (no herd when the holder goes).
//
// The fencing token is the lock node's czxid: the zxid of the transaction that created it.
// zxids are ZooKeeper's total order of writes (epoch<<32 | counter; every newly elected
// leader starts a higher epoch, and a restarted standalone server continues its counter),
// so a node created later has a higher czxid, in any folder, also after the earlier node
// was deleted, across hand-overs, session expiry and leader elections. Each holder's
// node was created after the previous holder's (it was either created later, with a
// higher sequence number, or it was already there and the previous holder's, lower, node
// was below it), so every new holder's token is higher than its predecessor's. Only a
// restore from an old snapshot or a wiped data folder moves zxids back; the proxy
// (its LockGuard over this package's Authority) fails closed then.
//
// Lock nodes are named "_c_<random>-lock-<sequence>", the name Apache Curator's
// InterProcessMutex uses; any client that follows the recipe (Curator, Kazoo, zkCli)
// orders by the ten-digit sequence suffix alike, so its holders' czxids are valid tokens
// too.
//
// Timing. ZooKeeper expires a session TTL (the session timeout) after it last heard from
// the client; the client pings every TTL/3 and drops a connection silent for 2/3 TTL. A
// lease whose connection is lost is counted lost when no new connection has confirmed the
// session within TTL/3 of the drop, so no later than the server's expiry; Done also fires
// at once when the server reports the session expired (a thawed holder learns it on its
// first reconnection) or the lock node deleted. ZooKeeper moves a session timeout outside
// its minSessionTimeout..maxSessionTimeout (by default 2 to 20 ticks, 4 s to 40 s) into
// that range without saying so: keep TTL inside it.
type Store struct {
	// Servers are the ensemble's client addresses, host:port. Required.
	Servers []string
	// Prefix is the lock folder; default /locks/<resource>. Contenders for one resource
	// must use the same folder; it is created (with its parents) when missing.
	Prefix string
	// TTL is the session timeout, from 1 s to 24 h; default lease.DefaultTTL.
	TTL time.Duration
	// Holder is the lock node's data, shown by `zkCli.sh get`; default host:pid:random,
	// drawn anew for each Campaign.
	Holder string
	// Logger (nil: no logs).
	Logger *zap.Logger
}

// Name is lease.StoreZooKeeper.
func (s *Store) Name() string { return lease.StoreZooKeeper }

// LockDir returns the lock folder of resource: prefix without a trailing slash,
// or /locks/<resource>.
func LockDir(prefix, resource string) string {
	if prefix != "" {
		return strings.TrimSuffix(prefix, "/")
	}
	return "/locks/" + resource
}

// Sequence returns the sequence number of a lock node's name (its ten-digit
// suffix), and false for a name that is not a lock node's.
func Sequence(name string) (int64, bool) {
	if len(name) < 10 {
		return 0, false
	}
	seq, err := strconv.ParseInt(name[len(name)-10:], 10, 64)
	return seq, err == nil && seq >= 0
}

// LockOrder sorts lock node names by sequence (the holder first) and drops names
// that are not lock nodes'.
func LockOrder(children []string) []string {
	locks := slices.DeleteFunc(slices.Clone(children), func(n string) bool {
		_, ok := Sequence(n)
		return !ok
	})
	slices.SortFunc(locks, func(a, b string) int {
		sa, _ := Sequence(a)
		sb, _ := Sequence(b)
		return int(sa - sb)
	})
	return locks
}

// Connect opens a ZooKeeper client session: one per lease (the session is the
// lease) or per proxy guard. events, when not nil, receives every session event (it must
// not block). The client's own messages go to log at debug level.
func Connect(servers []string, timeout time.Duration, log *zap.Logger, events func(zk.Event)) (*zk.Conn, error) {
	if len(servers) == 0 {
		return nil, fmt.Errorf("lease: %w: no ZooKeeper servers", lease.ErrRefused)
	}
	if log == nil {
		log = zap.NewNop()
	}
	conn, _, err := zk.Connect(servers, timeout, zk.WithLogInfo(false), zk.WithLogger(zkLogger{log.Named("zk-client")}),
		zk.WithEventCallback(func(ev zk.Event) {
			if events != nil && ev.Type == zk.EventSession {
				events(ev)
			}
		}))
	if err != nil {
		return nil, fmt.Errorf("lease: ZooKeeper client for %s: %w", strings.Join(servers, ","), err)
	}
	return conn, nil
}

// zkLogger sends the client's messages (connection attempts, mostly) to zap.
type zkLogger struct{ log *zap.Logger }

func (l zkLogger) Printf(format string, args ...any) { l.log.Debug(fmt.Sprintf(format, args...)) }

// permanent reports an error that retrying cannot change: authentication or an ACL
// refused, a path ZooKeeper will not take.
func permanent(err error) bool {
	for _, target := range []error{zk.ErrNoAuth, zk.ErrAuthFailed, zk.ErrInvalidACL, zk.ErrBadArguments, zk.ErrInvalidPath, zk.ErrNoChildrenForEphemerals} {
		if errors.Is(err, target) {
			return true
		}
	}
	return false
}

// zkSession follows a client's session events: whether the session expired, and since
// when it has had no connection.
type zkSession struct {
	mu        sync.Mutex
	expired   bool
	connected bool
	downSince time.Time // zero while connected
	changed   chan struct{}
}

func newZKSession() *zkSession { return &zkSession{changed: make(chan struct{}, 1)} }

func (s *zkSession) event(ev zk.Event) {
	s.mu.Lock()
	switch ev.State {
	case zk.StateHasSession:
		s.connected, s.downSince = true, time.Time{}
	case zk.StateExpired:
		s.expired = true
	case zk.StateDisconnected:
		if s.connected {
			s.connected, s.downSince = false, time.Now()
		}
	}
	s.mu.Unlock()
	select {
	case s.changed <- struct{}{}:
	default:
	}
}

// state returns whether the session expired and since when it is disconnected (zero: it
// is not).
func (s *zkSession) state() (expired bool, downSince time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.expired, s.downSince
}

// Campaign blocks until this store's session holds resource's lock, or ctx ends. A
// ZooKeeper that cannot be reached is waited for (each attempt is logged and retried with
// backoff); a refusal that retrying cannot change (authentication, an ACL, a bad path) is
// returned wrapping lease.ErrRefused.
func (s *Store) Campaign(ctx context.Context, resource string) (lease.Lease, error) {
	if len(s.Servers) == 0 {
		return nil, fmt.Errorf("lease: %w: ZooKeeper store without servers", lease.ErrRefused)
	}
	ttl := s.TTL
	if ttl == 0 {
		ttl = lease.DefaultTTL
	}
	if ttl < time.Second || ttl > 24*time.Hour {
		return nil, fmt.Errorf("lease: %w: ZooKeeper session timeout %v: want 1s to 24h", lease.ErrRefused, ttl)
	}
	dir := LockDir(s.Prefix, resource)
	if !strings.HasPrefix(dir, "/") || strings.Contains(dir, "//") {
		return nil, fmt.Errorf("lease: %w: ZooKeeper lock folder %q: want an absolute path like /locks/%s", lease.ErrRefused, dir, resource)
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
	log = log.With(zap.String("store", lease.StoreZooKeeper), zap.String("key", dir))
	log.Info("campaigning", zap.String("holder", holder))
	retry := lease.NewBackoff(100*time.Millisecond, 2*time.Second)
	for {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("lease: campaign for ZooKeeper lock %s: %w", dir, err)
		}
		l, err := s.campaignOnce(ctx, dir, holder, ttl, log)
		switch {
		case err == nil:
			return l, nil
		case ctx.Err() != nil:
			continue
		case permanent(err):
			return nil, fmt.Errorf("lease: %w: ZooKeeper lock %s: %w", lease.ErrRefused, dir, err)
		}
		log.Warn("campaign on ZooKeeper", zap.Error(err))
		retry.Wait(ctx)
	}
}

// zkCall runs f, a call of the client (which takes no ctx: it returns when the server
// answers or the connection is given up), and returns ctx's error if ctx ends first.
func Call(ctx context.Context, f func() error) error {
	done := make(chan error, 1)
	go func() { done <- f() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// campaignOnce opens a session, creates its lock node and waits until the node is the
// lowest. Whatever fails, the session is closed (which deletes its node) before returning.
func (s *Store) campaignOnce(ctx context.Context, dir, holder string, ttl time.Duration, log *zap.Logger) (l *held, err error) {
	sess := newZKSession()
	conn, err := Connect(s.Servers, ttl, log, sess.event)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			conn.Close()
		}
	}()
	acl := zk.WorldACL(zk.PermAll)
	var node string
	err = Call(ctx, func() error {
		if err := ensureDir(conn, dir, acl); err != nil {
			return err
		}
		var err error
		node, err = conn.CreateProtectedEphemeralSequential(dir+"/lock-", []byte(holder), acl)
		if err != nil {
			return fmt.Errorf("create the lock node under %s: %w", dir, err)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	var st *zk.Stat
	if err := Call(ctx, func() error {
		var err error
		_, st, err = conn.Get(node)
		return err
	}); err != nil {
		return nil, fmt.Errorf("read the lock node %s: %w", node, err)
	}
	if st.EphemeralOwner != conn.SessionID() {
		return nil, fmt.Errorf("the lock node %s belongs to session %x, not ours (%x): the session expired", node, st.EphemeralOwner, conn.SessionID())
	}
	name := node[strings.LastIndex(node, "/")+1:]
	session := fmt.Sprintf("%x", st.EphemeralOwner)
	for waited := false; ; {
		var children []string
		if err := Call(ctx, func() error {
			var err error
			children, _, err = conn.Children(dir)
			return err
		}); err != nil {
			return nil, fmt.Errorf("list %s: %w", dir, err)
		}
		locks := LockOrder(children)
		i := slices.Index(locks, name)
		if i < 0 {
			return nil, fmt.Errorf("session %s: the lock node %s is gone (the session expired, or someone deleted it)", session, node)
		}
		if i == 0 {
			break
		}
		pred := dir + "/" + locks[i-1]
		var exists bool
		var wch <-chan zk.Event
		if err := Call(ctx, func() error {
			var err error
			exists, _, wch, err = conn.ExistsW(pred)
			return err
		}); err != nil {
			return nil, fmt.Errorf("watch %s: %w", pred, err)
		}
		if !exists {
			continue
		}
		if !waited {
			holderNode := dir + "/" + locks[0]
			if data, hst, err := conn.Get(holderNode); err == nil {
				log.Info("lock held by another holder; waiting", zap.String("holder", string(data)), zap.Int64("token", hst.Czxid))
			}
			waited = true
		}
		if err := s.waitFor(ctx, wch, sess, ttl); err != nil {
			return nil, fmt.Errorf("session %s: %w", session, err)
		}
	}
	l = &held{
		conn: conn, sess: sess, key: node, token: st.Czxid, holder: session, ttl: ttl,
		log:     log.With(zap.String("session", session)),
		Outcome: lease.NewOutcome(), stopped: make(chan struct{}),
	}
	mctx, stop := context.WithCancel(context.WithoutCancel(ctx))
	l.stop = stop
	go l.monitor(mctx)
	return l, nil
}

// waitFor waits for an event on wch (the predecessor went, or the watch ended), or until
// the session expires or has been disconnected for too long, or ctx ends.
func (s *Store) waitFor(ctx context.Context, wch <-chan zk.Event, sess *zkSession, ttl time.Duration) error {
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-wch:
			return nil
		case <-sess.changed:
			if expired, down := sess.state(); expired {
				return errors.New("session expired while waiting for the lock")
			} else if !down.IsZero() && time.Since(down) > ttl {
				return errors.New("no connection to ZooKeeper for the session timeout while waiting for the lock")
			}
		}
	}
}

// ensureDir creates dir and its parents as persistent nodes where missing.
func ensureDir(conn *zk.Conn, dir string, acl []zk.ACL) error {
	parts := strings.Split(strings.TrimPrefix(dir, "/"), "/")
	for i := range parts {
		p := "/" + strings.Join(parts[:i+1], "/")
		if _, err := conn.Create(p, nil, 0, acl); err != nil && !errors.Is(err, zk.ErrNodeExists) {
			return fmt.Errorf("create %s: %w", p, err)
		}
	}
	return nil
}

// held is a held ZooKeeper lock.
type held struct {
	conn   *zk.Conn
	sess   *zkSession
	key    string
	token  int64
	holder string
	ttl    time.Duration
	log    *zap.Logger

	lease.Outcome
	stop    context.CancelFunc // stops the monitor
	stopped chan struct{}      // closed when the monitor returned
}

func (l *held) Store() string  { return lease.StoreZooKeeper }
func (l *held) Key() string    { return l.key }
func (l *held) Holder() string { return l.holder }
func (l *held) Token() int64   { return l.token }

func (l *held) lost(format string, args ...any) {
	err := fmt.Errorf("%w: ZooKeeper lock node %s (czxid %d): %s", lease.ErrLockLost, l.key, l.token, fmt.Sprintf(format, args...))
	l.log.Warn("lock lost", zap.Int64("token", l.token), zap.Error(err))
	l.Finish(err)
}

// monitor ends the lease when the server expires the session, when the connection has
// been lost for TTL/3 (the server may expire the session from then on), or when the lock
// node is deleted, whichever it learns first.
func (l *held) monitor(ctx context.Context) {
	defer close(l.stopped)
	grace := l.ttl / 3
	for {
		if expired, _ := l.sess.state(); expired {
			l.lost("ZooKeeper expired the session %s (it had not heard from this client within the session timeout of %v: unreachable, or this process was frozen)", l.holder, l.ttl)
			return
		}
		exists, st, wch, err := l.conn.ExistsW(l.key)
		switch {
		case err == nil && !exists:
			l.lost("the lock node is gone (the session %s expired, or someone deleted the node)", l.holder)
			return
		case err == nil && st.Czxid != l.token:
			l.lost("the lock node was deleted and created again (czxid now %d)", st.Czxid)
			return
		case err != nil:
			wch = nil // wait for the connection below, then watch again
		}
		retry := time.NewTimer(time.Second)
	wait:
		for {
			expired, down := l.sess.state()
			if expired {
				break wait
			}
			var deadline <-chan time.Time
			if !down.IsZero() {
				left := time.Until(down.Add(grace))
				if left <= 0 {
					retry.Stop()
					l.lost("no connection to ZooKeeper for %v (a third of the session timeout %v): the server may expire the session %s from now on", grace, l.ttl, l.holder)
					return
				}
				deadline = time.After(left)
			}
			select {
			case <-ctx.Done():
				retry.Stop()
				return
			case ev := <-wch:
				if ev.Type == zk.EventNodeDeleted {
					retry.Stop()
					l.lost("the lock node was deleted (the session %s expired, or someone deleted the node)", l.holder)
					return
				}
				break wait // changed, or the watch ended: look again
			case <-l.sess.changed:
			case <-deadline:
			case <-retry.C:
				if err != nil {
					break wait
				}
				retry.Reset(time.Second)
			}
		}
		retry.Stop()
	}
}

// Release deletes the lock node if it is still held and closes the session (which would
// delete it anyway). A lost lease's session is closed all the same.
func (l *held) Release(ctx context.Context) error {
	l.stop()
	<-l.stopped
	defer l.Finish(lease.ErrReleased)
	if errors.Is(l.Err(), lease.ErrReleased) {
		return nil
	}
	wasHeld := l.Err() == nil
	var derr error
	if wasHeld {
		derr = Call(ctx, func() error {
			err := l.conn.Delete(l.key, -1)
			if errors.Is(err, zk.ErrNoNode) {
				return nil
			}
			return err
		})
	}
	// Close tells the server to end the session (waiting at most a second for it), which
	// deletes the node if the delete failed.
	l.conn.Close()
	if derr != nil && wasHeld {
		return fmt.Errorf("lease: release ZooKeeper lock node %s: %w (the node goes when the server expires the session)", l.key, derr)
	}
	return nil
}
