package proxy

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// onControl runs fn on a connection of pool, the control database, twice at most: an error
// that says the server ended the connection (goingAway) may be the pooled connection's alone,
// ended while idle (pg_terminate_backend by an administrator or by a client's own SQL,
// idle_session_timeout) and reported at its next use, and so may be every idle one's: the
// pool is emptied, so the second attempt goes on a new connection, and only its answer can
// say that the server itself is going away. fn must be safe to run again: every control
// call is (the proof-checked functions record, admit, raise or read a token; a call the
// server ended rolled back, one that committed admits the same token again).
func onControl(ctx context.Context, pool *pgxpool.Pool, fn func(*pgx.Conn) error) error {
	var err error
	for attempt := range 2 {
		if attempt > 0 {
			pool.Reset()
		}
		err = pool.AcquireFunc(ctx, func(c *pgxpool.Conn) error { return fn(c.Conn()) })
		if err == nil || !goingAway(err) {
			return err
		}
	}
	return err
}

// controlConnectTimeout bounds a guard's control connection when its URL sets none
// (connect_timeout): a frozen host of a multi-host URL (the paused old primary of a failover)
// accepts the connection and never answers, and the next host is tried only after it.
const controlConnectTimeout = 5 * time.Second

// newGuardPool is a lock-service guard's pool on the control database url, named appName in
// pg_stat_activity ("": the URL's).
func newGuardPool(ctx context.Context, url, appName string) (*pgxpool.Pool, error) {
	pc, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("control database: %w", err)
	}
	if pc.ConnConfig.ConnectTimeout <= 0 {
		pc.ConnConfig.ConnectTimeout = controlConnectTimeout
	}
	if appName != "" {
		pc.ConnConfig.RuntimeParams["application_name"] = appName
	}
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("control database: %w", err)
	}
	return pool, nil
}
