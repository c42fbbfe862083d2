package fence

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// OnControl runs fn on a connection of pool, the control database, twice at most: an error
// that says the server ended the connection (GoingAway) may be the pooled connection's alone,
// ended while idle (pg_terminate_backend by an administrator or by a client's own SQL,
// idle_session_timeout) and reported at its next use, and so may be every idle one's: the
// pool is emptied, so the second attempt goes on a new connection, and only its answer can
// say that the server itself is going away. fn must be safe to run again: every control
// call is (the proof-checked functions record, admit, raise or read a token; a call the
// server ended rolled back, one that committed admits the same token again).
func OnControl(ctx context.Context, pool *pgxpool.Pool, fn func(*pgx.Conn) error) error {
	var err error
	for attempt := range 2 {
		if attempt > 0 {
			pool.Reset()
		}
		err = pool.AcquireFunc(ctx, func(c *pgxpool.Conn) error { return fn(c.Conn()) })
		if err == nil || !GoingAway(err) {
			return err
		}
	}
	return err
}

// GoingAway reports whether err says the server is shutting down or refuses
// connections (SQLSTATE class 57, or a refused connection).
func GoingAway(err error) bool {
	var pgErr *pgconn.PgError
	return (errors.As(err, &pgErr) && strings.HasPrefix(pgErr.Code, "57")) || errors.Is(err, syscall.ECONNREFUSED)
}

// AdmitOnControl records on the control database (pool) that a guard's lock service showed
// token as the current token of resource, held by holder (ConsulAdmit, on a connection of
// OnControl), and returns the record. A record that could not be updated is the refusal it
// returns (ZF007).
func (k Key) AdmitOnControl(ctx context.Context, pool *pgxpool.Pool, resource string, token int64, holder string) (ConsulRecord, error) {
	var rec ConsulRecord
	err := OnControl(ctx, pool, func(conn *pgx.Conn) error {
		var err error
		rec, err = k.ConsulAdmit(ctx, conn, resource, token, holder)
		return err
	})
	if err != nil {
		return rec, recordFailed(resource, err)
	}
	return rec, nil
}

// RaiseRecorded is a guard's proactive raise of token, held by holder, on the control
// database (pool): recorded first (ConsulAdmit), so that the database never stores a token
// whose holder it does not know, then raised (Raise) when the record admits it, on one
// connection. It returns the record and the token the database then holds (0: not raised).
func (k Key) RaiseRecorded(ctx context.Context, pool *pgxpool.Pool, resource string, token int64, holder string) (rec ConsulRecord, stored int64, err error) {
	err = OnControl(ctx, pool, func(conn *pgx.Conn) error {
		var err error
		stored = 0
		if rec, err = k.ConsulAdmit(ctx, conn, resource, token, holder); err != nil || !rec.Admits(token, holder) {
			return err
		}
		stored, err = k.Raise(ctx, conn, resource, token)
		return err
	})
	return rec, stored, err
}

// RegressOnControl records on the control database (pool) that resource's tokens went
// backwards (ConsulRegress; token: the highest known, for the proof), where every proxy and
// a restarted one find it until fence.reset.
func (k Key) RegressOnControl(ctx context.Context, pool *pgxpool.Pool, resource string, token int64, reason string) error {
	return OnControl(ctx, pool, func(conn *pgx.Conn) error {
		_, err := k.ConsulRegress(ctx, conn, resource, token, reason)
		return err
	})
}

// recordFailed is the refusal of a session whose lock-service token fence.consul_admit could
// not record: the database's own refusal when it refused the resource (ZF004: retrying cannot
// change it, as a PostgreSQL lease on the resource, L12), fail closed (ZF007) otherwise.
func recordFailed(res string, err error) *Error {
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == CodeMalformed {
		return &Error{Code: pe.Code, Message: pe.Message, Detail: pe.Detail, Hint: pe.Hint, Resource: res, Err: err}
	}
	return Unavailable(res, fmt.Sprintf("the database's record of admitted tokens (fence.consul_admit; this fenceproxy needs fence schema version %d: ", SchemaVersion)+
		"run fenceproxy migrate) could not be updated: "+err.Error())
}

// controlConnectTimeout bounds a guard's control connection when its URL sets none
// (connect_timeout): a frozen host of a multi-host URL (the paused old primary of a failover)
// accepts the connection and never answers, and the next host is tried only after it.
const controlConnectTimeout = 5 * time.Second

// NewGuardPool is a lock-service guard's pool on the control database url, named appName in
// pg_stat_activity ("": the URL's).
func NewGuardPool(ctx context.Context, url, appName string) (*pgxpool.Pool, error) {
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
