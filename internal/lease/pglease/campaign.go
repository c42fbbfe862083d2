// Package pglease is the PostgreSQL lease of the fence schema (fence.leases) as a lock
// service: campaigning, renewing and releasing through the schema's lease functions (Store,
// the token the lease row's generation). The proxy asks no service for it: the database's own
// bind checks its tokens against the lease row (fence.lease_bind).
package pglease

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/standby"
)

// Store grants the PostgreSQL lease of migration 5 (fence.leases in the protected
// database, `fenceproxy lock --store postgres`): a row per resource with its holder, an
// expiry decided by the database's clock and a generation, the fencing token, that every
// acquisition increments and admits (fence.lease_acquire). No other service is needed: the
// proxy's bind checks the token against the same row.
//
// Timing. The database expires a lease TTL after it last set its expiry, by its own clock;
// this side counts the lease lost TTL after it SENT the request that set the expiry, which
// is earlier (the clocks' offset does not matter, only that they tick at the same rate), so
// a holder stops before any other process can take over. Renewals go out every TTL/3: a
// renewal that fails (a connection lost, a slow server) is retried every TTL/10 (at most 1 s),
// and two more renewals fit before the lease runs out. A renewal the database refuses (the
// lease expired, was released, or another holder took it over) ends the lease at once, and so
// does reaching the local deadline without a successful renewal, whatever the database says
// later: a frozen holder that wakes up after TTL never believes it still leads.
type Store struct {
	// URL is the protected database, reached directly (not through the proxy): a
	// postgres:// URL or keyword/value string, as pgx accepts. Required.
	URL string
	// TTL is the lease's time to live, 1 s to 24 h; default lease.DefaultTTL.
	TTL time.Duration
	// Holder names this process in the lease row; default host:pid:random, drawn anew for
	// each Campaign. A held lease is never taken by naming its holder (schema version 8): a
	// restarted process with a fixed name waits for its old lease to expire. Keep names
	// unique all the same: two stores with one name renew and release each other's lease.
	Holder string
	// Logger (nil: no logs).
	Logger *zap.Logger
	// Standbys are the standbys a failover may promote: an acquisition's new generation is
	// handed out only once they have flushed it, so that a failover cannot issue it again
	// (issue 21). The zero Set waits for none. The URL's role needs pg_read_all_stats for
	// standbys named by application_name.
	Standbys standby.Set
	// FlushTimeout bounds that wait (0: standby.DefaultTimeout). A standby that has not
	// confirmed by then: the lease is released and the campaign goes on.
	FlushTimeout time.Duration
}

// Name is lease.StorePostgres.
func (p *Store) Name() string { return lease.StorePostgres }

const (
	acquireQuery = "SELECT acquired, generation, coalesce(current_holder, '') FROM fence.lease_acquire($1, $2, $3)"
	renewQuery   = "SELECT fence.lease_renew($1, $2, $3, $4)"
	releaseQuery = "SELECT fence.lease_release($1, $2, $3)"
)

// Campaign blocks until this store's holder holds resource's lease, polling every TTL/10 (at
// most 1 s) while another holder has it. Database errors are logged and retried with backoff
// until ctx ends; a refusal that retrying cannot change (a malformed argument or TTL, a schema
// without migration 5, a role without EXECUTE, failed authentication) is returned wrapping
// lease.ErrRefused.
func (p *Store) Campaign(ctx context.Context, resource string) (lease.Lease, error) {
	ttl := p.TTL
	if ttl == 0 {
		ttl = lease.DefaultTTL
	}
	if ttl < time.Second || ttl > 24*time.Hour {
		return nil, fmt.Errorf("lease: %w: postgres lease TTL %v: want 1s to 24h", lease.ErrRefused, ttl)
	}
	holder := p.Holder
	if holder == "" {
		var err error
		if holder, err = lease.DefaultHolder(); err != nil {
			return nil, err
		}
	}
	log := p.Logger
	if log == nil {
		log = zap.NewNop()
	}
	cfg, err := pgxpool.ParseConfig(p.URL)
	if err != nil {
		return nil, fmt.Errorf("lease: %w: postgres lease database: %w", lease.ErrRefused, err)
	}
	// Two connections: a renewal never waits behind a release or a slow acquire.
	cfg.MaxConns = 2
	if cfg.ConnConfig.RuntimeParams == nil {
		cfg.ConnConfig.RuntimeParams = map[string]string{}
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = "fenceproxy lock " + resource
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("lease: postgres lease database: %w", err)
	}
	log = log.With(zap.String("store", lease.StorePostgres), zap.String("session", holder))
	log.Info("campaigning", zap.String("key", leaseKey(resource)))
	poll := min(ttl/10, time.Second)
	retry := lease.NewBackoff(100*time.Millisecond, 2*time.Second)
	var lastHolder string
	for {
		if err := ctx.Err(); err != nil {
			pool.Close()
			return nil, fmt.Errorf("lease: campaign for %s: %w", leaseKey(resource), err)
		}
		sent := time.Now()
		var acquired bool
		var generation int64
		var current string
		err := pool.QueryRow(ctx, acquireQuery, resource, holder, ttl).Scan(&acquired, &generation, &current)
		switch {
		case err != nil && ctx.Err() != nil:
			continue
		case err != nil && permanent(err):
			pool.Close()
			hint := ""
			switch sqlState(err) {
			case "3F000", "42883":
				hint = fmt.Sprintf(" (this fenceproxy needs fence schema version %d in this database: run fenceproxy migrate)", fence.SchemaVersion)
			case "42501":
				hint = " (grant this role EXECUTE on fence.lease_acquire, fence.lease_renew and fence.lease_release: docs/postgres-lease.md)"
			case "ZF003", "ZF005":
				hint = " (the lease's --database must reach PostgreSQL directly, not through fenceproxy: the lease is what gives the token)"
			default:
				// The database's own HINT says what to do (a newcomer had to call
				// fence.lease_acquire in psql to read it).
				var pe *pgconn.PgError
				if errors.As(err, &pe) && pe.Hint != "" {
					hint = " (" + pe.Hint + ")"
				}
			}
			return nil, fmt.Errorf("lease: %w: acquire %s: %w%s", lease.ErrRefused, leaseKey(resource), err, hint)
		case err != nil:
			log.Warn("acquire postgres lease", zap.Error(err))
			retry.Wait(ctx)
			continue
		case acquired:
			if err := p.waitStandbys(ctx, pool, resource, holder, generation, log); err != nil {
				if errors.Is(err, lease.ErrRefused) {
					pool.Close()
					return nil, err
				}
				if ctx.Err() != nil { // the campaign's end, whatever the last wait said
					pool.Close()
					return nil, fmt.Errorf("lease: campaign for %s ended: %w (the last acquisition was released: %w)", leaseKey(resource), ctx.Err(), err)
				}
				log.Warn("acquired postgres lease released: not on the failover standbys", zap.Int64("generation", generation), zap.Error(err))
				retry.Wait(ctx)
				continue
			}
			l := &held{
				pool: pool, resource: resource, holder: holder, token: generation, ttl: ttl, log: log,
				Outcome: lease.NewOutcome(), stopped: make(chan struct{}),
			}
			rctx, stop := context.WithCancel(context.WithoutCancel(ctx))
			l.stop = stop
			go l.renew(rctx, sent.Add(ttl))
			return l, nil
		}
		retry.Reset()
		if current != lastHolder {
			log.Info("lease held by another holder; waiting", zap.String("holder", current), zap.Int64("generation", generation))
			lastHolder = current
		}
		t := time.NewTimer(poll)
		select {
		case <-ctx.Done():
		case <-t.C:
		}
		t.Stop()
	}
}

// waitStandbys waits until p.Standbys have flushed the acquisition of generation. When they
// do not confirm in time it releases the lease (the generation was never handed out) and
// returns the error that names them; a wait that cannot succeed (no privilege, no slot)
// returns an error wrapping lease.ErrRefused.
func (p *Store) waitStandbys(ctx context.Context, pool *pgxpool.Pool, resource, holder string, generation int64, log *zap.Logger) error {
	if p.Standbys.Empty() {
		return nil
	}
	var lsn string
	err := pool.QueryRow(ctx, standby.CommitLSNQuery).Scan(&lsn)
	if err == nil {
		err = p.Standbys.WaitFlushed(ctx, pool, lsn, p.FlushTimeout)
	}
	if err == nil {
		return nil
	}
	if errors.Is(err, standby.ErrSetup) {
		err = fmt.Errorf("lease: %w: %s generation %d: %w", lease.ErrRefused, leaseKey(resource), generation, err)
	} else {
		err = fmt.Errorf("lease: %s generation %d: %w", leaseKey(resource), generation, err)
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	var ok bool
	if rerr := pool.QueryRow(rctx, releaseQuery, resource, holder, generation).Scan(&ok); rerr != nil {
		log.Warn("release postgres lease", zap.Error(rerr))
	}
	return err
}

// permanent reports an error that retrying the same call cannot change: a refusal of the
// arguments (ZF004), a missing schema or function (3F000, 42883: the fence schema is not at
// version 5), a missing privilege (42501), failed authentication (28000, 28P01), a missing
// database (3D000), or fenceproxy's refusal of a session without a token or of an unknown
// resource (ZF003, ZF005: the URL leads to the proxy instead of the database).
func permanent(err error) bool {
	switch sqlState(err) {
	case "ZF004", "3F000", "42883", "42501", "28000", "28P01", "3D000", "ZF003", "ZF005":
		return true
	}
	return false
}

func sqlState(err error) string {
	var se interface{ SQLState() string }
	if errors.As(err, &se) {
		return se.SQLState()
	}
	return ""
}

func leaseKey(resource string) string { return "fence.leases/" + resource }

// held is a held PostgreSQL lease.
type held struct {
	pool     *pgxpool.Pool
	resource string
	holder   string
	token    int64
	ttl      time.Duration
	log      *zap.Logger

	lease.Outcome
	stop    context.CancelFunc // stops the renewer
	stopped chan struct{}      // closed when the renewer returned
}

func (l *held) Store() string  { return lease.StorePostgres }
func (l *held) Key() string    { return leaseKey(l.resource) }
func (l *held) Holder() string { return l.holder }
func (l *held) Token() int64   { return l.token }

func (l *held) lost(format string, args ...any) {
	err := fmt.Errorf("%w: %s generation %d: %s", lease.ErrLockLost, leaseKey(l.resource), l.token, fmt.Sprintf(format, args...))
	l.log.Warn("lock lost", zap.String("key", leaseKey(l.resource)), zap.Int64("token", l.token), zap.Error(err))
	l.Finish(err)
}

// renew keeps the lease until ctx ends or the lease is lost (see Store for the
// timing). deadline is when this side counts the lease as expired.
func (l *held) renew(ctx context.Context, deadline time.Time) {
	defer close(l.stopped)
	interval := l.ttl / 3
	retryEvery := min(l.ttl/10, time.Second)
	next := time.Now().Add(interval)
	var lastErr error
	for {
		wake := next
		if deadline.Before(wake) {
			wake = deadline
		}
		t := time.NewTimer(time.Until(wake))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		if !time.Now().Before(deadline) {
			// Also the frozen holder's case: its timers fire when it wakes, past the
			// deadline, and it stops before asking the database anything.
			if lastErr != nil {
				l.lost("not renewed within its TTL of %v: %v", l.ttl, lastErr)
			} else {
				l.lost("not renewed within its TTL of %v", l.ttl)
			}
			return
		}
		sent := time.Now()
		rctx, cancel := context.WithDeadline(ctx, deadline)
		var ok bool
		err := l.pool.QueryRow(rctx, renewQuery, l.resource, l.holder, l.token, l.ttl).Scan(&ok)
		cancel()
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			lastErr = err
			l.log.Warn("renew postgres lease", zap.Error(err))
			next = time.Now().Add(retryEvery)
		case !ok:
			l.lost("the database refused the renewal: %s", l.describe())
			return
		default:
			lastErr = nil
			deadline = sent.Add(l.ttl)
			next = sent.Add(interval)
		}
	}
}

// describe says who holds the lease now, for the error of a refused renewal.
func (l *held) describe() string {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	var holder *string
	var generation int64
	var expired bool
	err := l.pool.QueryRow(ctx, "SELECT holder, generation, coalesce(expires_at <= clock_timestamp(), true) FROM fence.leases WHERE resource = $1",
		l.resource).Scan(&holder, &generation, &expired)
	switch {
	case err != nil:
		return "the lease expired, was released or was taken over"
	case generation != l.token && holder != nil:
		return fmt.Sprintf("taken over by %s with generation %d", *holder, generation)
	case generation != l.token:
		return fmt.Sprintf("taken over with generation %d, released since", generation)
	case holder == nil:
		return "released"
	default:
		return "expired (by the database's clock)"
	}
}

// Release stops renewing, releases the lease, and closes the connections. A lease this side
// counts as lost may still be ours in the database (lost to the local deadline, which comes
// first): it is released all the same, so that the next holder need not wait for the expiry.
// The database releases only for this holder and generation, so a lease another holder took
// over is left alone.
func (l *held) Release(ctx context.Context) error {
	l.stop()
	<-l.stopped
	defer l.pool.Close()
	defer l.Finish(lease.ErrReleased)
	if errors.Is(l.Err(), lease.ErrReleased) {
		return nil
	}
	var ok bool
	if err := l.pool.QueryRow(ctx, releaseQuery, l.resource, l.holder, l.token).Scan(&ok); err != nil {
		if l.Err() != nil {
			return nil // lost already; it expires on its own
		}
		// It expires on its own TTL after the last renewal.
		return fmt.Errorf("lease: release %s: %w", leaseKey(l.resource), err)
	}
	return nil
}
