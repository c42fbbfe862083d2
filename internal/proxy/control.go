package proxy

import (
	"context"

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
