package consul

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/consul/api"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/lease"
)

// Session defaults.
const (
	// DefaultLockDelay is 0, not Consul's 15 s: see the package documentation.
	DefaultLockDelay = 0 * time.Second
)

// SessionOption configures NewSession.
type SessionOption func(*sessionConfig)

type sessionConfig struct {
	ttl       time.Duration
	lockDelay time.Duration
	name      string
	log       *zap.Logger
	now       lease.Clock
}

// WithTTL sets the session TTL (default lease.DefaultTTL; Consul accepts 10 s to 24 h unless its
// session_ttl_min says otherwise). The session is renewed every TTL/2.
func WithTTL(ttl time.Duration) SessionOption { return func(c *sessionConfig) { c.ttl = ttl } }

// WithLockDelay sets the session's lock-delay: how long Consul refuses to hand a lock that
// this session held to anyone after the session is invalidated: 0, or 1 ms to 60 s.
// Default DefaultLockDelay.
func WithLockDelay(d time.Duration) SessionOption {
	return func(c *sessionConfig) { c.lockDelay = d }
}

// WithName sets the session's name, shown by `consul operator` and the UI.
func WithName(name string) SessionOption { return func(c *sessionConfig) { c.name = name } }

// WithLogger sets the logger for renewal failures and the session's end. Default: none.
func WithLogger(l *zap.Logger) SessionOption { return func(c *sessionConfig) { c.log = l } }

// WithClock sets the clock the keep-alive reads (see lease.Clock). Default, and nil: time.Now.
func WithClock(now lease.Clock) SessionOption { return func(c *sessionConfig) { c.now = now } }

// Session is a Consul session kept alive by renewing it every TTL/2. Locks are held by a
// session: when it ends, they are released (behavior "release", so that the keys and
// their LockIndex survive; "delete" would restart LockIndex at 1, a regression).
type Session struct {
	client *api.Client
	id     string
	ttl    time.Duration
	log    *zap.Logger
	now    lease.Clock

	done    chan struct{}
	cancel  context.CancelFunc // stops the keep-alive
	closing atomic.Bool        // Close destroys the session itself, with its own ctx
	mu      sync.Mutex
	err     error
}

// NewSession creates a session and starts renewing it. ctx bounds the session's whole
// life, not only its creation: when ctx ends, renewal stops and the session is destroyed,
// which releases its locks. A session that must outlive a request takes
// context.WithoutCancel(ctx), and ends with Close.
func NewSession(ctx context.Context, client *api.Client, opts ...SessionOption) (*Session, error) {
	cfg := sessionConfig{ttl: lease.DefaultTTL, lockDelay: DefaultLockDelay, name: "fenceproxy"}
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.ttl <= 0 {
		return nil, fmt.Errorf("lease: NewSession: TTL %v must be positive", cfg.ttl)
	}
	// Consul reads a lock-delay below 1 µs as seconds, and caps it at 60 s.
	if cfg.lockDelay < 0 || (cfg.lockDelay > 0 && cfg.lockDelay < time.Millisecond) || cfg.lockDelay > time.Minute {
		return nil, fmt.Errorf("lease: NewSession: lock-delay %v: want 0 or 1ms to 60s", cfg.lockDelay)
	}
	if cfg.log == nil {
		cfg.log = zap.NewNop()
	}
	if cfg.now == nil {
		cfg.now = time.Now
	}
	// Not Session().Create: the api client leaves LockDelay out of the request when it
	// is 0, and Consul then applies its default of 15 s. Sent as a string of
	// milliseconds, which Consul parses as a duration ("0ms" is 0).
	body := map[string]any{
		"Name":      cfg.name,
		"TTL":       cfg.ttl.String(),
		"Behavior":  api.SessionBehaviorRelease,
		"LockDelay": fmt.Sprintf("%dms", cfg.lockDelay.Milliseconds()),
	}
	var out struct{ ID string }
	if _, err := client.Raw().Write("/v1/session/create", body, &out, (&api.WriteOptions{}).WithContext(ctx)); err != nil {
		return nil, fmt.Errorf("lease: create consul session: %w", err)
	}
	if out.ID == "" {
		return nil, errors.New("lease: create consul session: no session ID in Consul's answer")
	}
	id := out.ID
	life, cancel := context.WithCancel(ctx)
	s := &Session{client: client, id: id, ttl: cfg.ttl, log: cfg.log, now: cfg.now, done: make(chan struct{}), cancel: cancel}
	go s.keepAlive(life)
	return s, nil
}

// ID is the Consul session ID: the holder a lock's Session field shows.
func (s *Session) ID() string { return s.id }

// TTL is the session's TTL as requested.
func (s *Session) TTL() time.Duration { return s.ttl }

// Done is closed when the session has ended: invalidated by Consul, not renewed within
// its TTL, its ctx ended, or Close. Err says which.
func (s *Session) Done() <-chan struct{} { return s.done }

// Err is nil while the session lives; after Done it is lease.ErrSessionExpired (wrapped with the
// cause) or the ctx's error or context.Canceled after Close.
func (s *Session) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// Close stops renewing and destroys the session in Consul, which releases every lock it
// holds at once. It waits until the keep-alive has stopped; ctx bounds the destroy call.
func (s *Session) Close(ctx context.Context) error {
	s.closing.Store(true)
	s.cancel()
	<-s.done
	_, err := s.client.Session().Destroy(s.id, (&api.WriteOptions{}).WithContext(ctx))
	if err != nil {
		return fmt.Errorf("lease: destroy consul session %s: %w", s.id, err)
	}
	return nil
}

func (s *Session) end(err error) {
	s.mu.Lock()
	if s.err == nil {
		s.err = err
	}
	s.mu.Unlock()
}

// keepAlive renews the session every TTL/2 until ctx ends or the session is lost.
//
// The session counts as lost when Consul says it does not exist, or when no renewal
// succeeded for a whole TTL: Consul may invalidate a session any time after TTL (it
// grants up to 2 x TTL), so past TTL this process cannot know it still holds anything.
// Failed renewals are retried every second until then.
func (s *Session) keepAlive(ctx context.Context) {
	defer close(s.done)
	sessions := s.client.Session()
	ttl := s.ttl
	lastOK := s.now()
	wait := ttl / 2
	for {
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			s.end(ctx.Err())
			if s.closing.Load() {
				return
			}
			// Destroy on a fresh context: ctx is over, and a session left behind would
			// keep its locks for up to 2 x TTL.
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			if _, err := sessions.Destroy(s.id, (&api.WriteOptions{}).WithContext(dctx)); err != nil {
				s.log.Warn("destroy consul session", zap.String("session", s.id), zap.Error(err))
			}
			cancel()
			return
		case <-t.C:
		}
		deadline := lastOK.Add(ttl)
		// Consul restarts the TTL when it receives the renewal, which is after this
		// moment: counting from here errs on the early side.
		sent := s.now()
		// A timeout measured by s.now (context deadlines follow time.Now): a clock that
		// jumped past the deadline leaves no time to renew.
		rctx, cancel := context.WithTimeout(ctx, deadline.Sub(sent))
		entry, _, err := sessions.Renew(s.id, (&api.WriteOptions{}).WithContext(rctx))
		cancel()
		switch {
		case ctx.Err() != nil:
			wait = 0 // handled at the top of the loop
		case err == nil && entry == nil:
			s.end(fmt.Errorf("%w: session %s was invalidated by Consul", lease.ErrSessionExpired, s.id))
			s.log.Warn("consul session invalidated", zap.String("session", s.id))
			return
		case err != nil && !s.now().Before(deadline):
			s.end(fmt.Errorf("%w: session %s not renewed for %v: %w", lease.ErrSessionExpired, s.id, ttl, err))
			s.log.Warn("consul session lost: not renewed within its TTL", zap.String("session", s.id), zap.Error(err))
			return
		case err != nil:
			s.log.Warn("renew consul session", zap.String("session", s.id), zap.Error(err))
			wait = min(time.Second, deadline.Sub(s.now()))
		default:
			lastOK = sent
			// Consul may raise the TTL (never lower it below what we asked).
			if d, perr := time.ParseDuration(entry.TTL); perr == nil && d > 0 {
				ttl = d
			}
			wait = ttl / 2
		}
	}
}
