package fence

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
)

// The statements the proxy sends: a bind at session start, and a raise or a settled read on its
// control connection, each a single SELECT of one function of the fence schema (see
// docs/proof.md for what they guarantee) whose parameters are a resource
// name that passed ValidResource, an integer token and a hex proof: never text a client sent.

// Key is the proxy key: the secret that proves to the database that a bind or a raise comes
// from fenceproxy (proof obligation P5, docs/proof.md). The same key is stored in the
// database's fence.keys (SetKey) and given to every proxy (--key-file).
type Key []byte

// KeySize is the size of a generated key.
const KeySize = 32

// GenerateKey returns a new random key.
func GenerateKey() (Key, error) {
	k := make(Key, KeySize)
	if _, err := rand.Read(k); err != nil {
		return nil, err
	}
	return k, nil
}

// ParseKey decodes a key file's text: hex, white space around it ignored, 16 bytes or more.
func ParseKey(text string) (Key, error) {
	k, err := hex.DecodeString(strings.TrimSpace(text))
	if err != nil {
		return nil, fmt.Errorf("fence: key is not hex: %w", err)
	}
	if len(k) < 16 {
		return nil, fmt.Errorf("fence: key has %d bytes, needs 16 or more", len(k))
	}
	return k, nil
}

// LoadKey reads a key file.
func LoadKey(path string) (Key, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("fence: key file: %w", err)
	}
	k, err := ParseKey(string(b))
	if err != nil {
		return nil, fmt.Errorf("%w (%s)", err, path)
	}
	return k, nil
}

// WriteKeyFile writes k to a new file at path, readable by its owner only.
func WriteKeyFile(path string, k Key) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("fence: key file: %w", err)
	}
	if _, err := f.WriteString(hex.EncodeToString(k) + "\n"); err != nil {
		f.Close()
		return fmt.Errorf("fence: key file: %w", err)
	}
	return f.Close()
}

// Proof is the MAC fence.verify expects from the backend with process ID pid in database:
// hex(sha256(key || sha256(key || message))), message = kind, database, resource, token and pid
// joined by newlines (migrations/functions/fence.mac.sql).
func (k Key) Proof(kind, database, resource string, token int64, pid uint32) string {
	msg := kind + "\n" + database + "\n" + resource + "\n" + strconv.FormatInt(token, 10) + "\n" + strconv.FormatUint(uint64(pid), 10)
	inner := sha256.Sum256(append(append([]byte(nil), k...), msg...))
	outer := sha256.Sum256(append(append([]byte(nil), k...), inner[:]...))
	return hex.EncodeToString(outer[:])
}

// BindQuery, RaiseQuery and SettledQuery are the statements the proxy sends, with a Call's Args as their
// parameters (extended protocol): never with the proof as a literal, so that the proof does not
// show in pg_stat_activity.query to the sessions that may read it (proof obligation P5).
//
// LeaseBindQuery is the bind of a session of a resource declared as led through the PostgreSQL
// lease (--lease-resource, schema version 10): refused (ZF006) while the resource has no lease,
// else fence.bind's; its row is the lease's holder (NULL when the token is not the current
// generation's) and the stored token.
const (
	BindQuery      = "SELECT fence.bind($1, $2, $3)"
	LeaseBindQuery = "SELECT holder, stored FROM fence.lease_bind($1, $2, $3)"
	RaiseQuery     = "SELECT fence.raise($1, $2, $3)"
	SettledQuery   = "SELECT fence.settled($1, $2, $3)"
)

// Call is a bind, a raise or a settled read with its proof: the parameters of its query.
type Call struct {
	Resource string
	Token    int64
	Proof    string
}

// Args returns the call's parameters in text format.
func (c Call) Args() [][]byte {
	return [][]byte{[]byte(c.Resource), strconv.AppendInt(nil, c.Token, 10), []byte(c.Proof)}
}

// BindCall returns the bind of the session's backend (process ID pid, in database) to
// (resource, token). BindQuery returns one row, one column: the token stored afterwards; it
// fails with ZF001 when a higher token is stored, and binds nothing then.
//
// Run it in its own READ COMMITTED, READ WRITE transaction: fence.bind refuses other
// isolation levels, and a read-only transaction cannot raise.
//
// It returns a ZF004 *Error (errors.Is(err, ErrMalformed)) for an invalid resource name or a
// token below 1, and never panics: the values come from a session's startup parameters, so a
// bad one is the client's mistake, answered with an error.
func (k Key) BindCall(database, resource string, token int64, pid uint32) (Call, error) {
	return k.call("bind", database, resource, token, pid)
}

func (k Key) call(kind, database, resource string, token int64, pid uint32) (Call, error) {
	if !ValidResource(resource) {
		return Call{}, Malformed(fmt.Sprintf("resource %q must match %s", resource, resourcePattern))
	}
	if token < 1 {
		return Call{}, Malformed(fmt.Sprintf("token %d must be 1 or more", token))
	}
	return Call{Resource: resource, Token: token, Proof: k.Proof(kind, database, resource, token, pid)}, nil
}

// Raise admits token for resource through conn (the proxy's control connection, not a
// client's session), ending every backend bound to a lower token before it commits, and
// returns the token stored afterwards: higher than token when a newer one was admitted.
// conn must not be inside a transaction: the raise commits its own.
func (k Key) Raise(ctx context.Context, conn *pgx.Conn, resource string, token int64) (int64, error) {
	return k.control(ctx, conn, "raise", RaiseQuery, resource, token)
}

// Settled returns the token stored for resource (0: none) once no raise of it is in flight,
// read through conn (the proxy's control connection): when the server ended a session bound
// to token, a result above token says that a raise ended it. It waits as long as a raise holds
// the resource (the raise's own bound is 5 seconds); ctx bounds the wait.
func (k Key) Settled(ctx context.Context, conn *pgx.Conn, resource string, token int64) (int64, error) {
	return k.control(ctx, conn, "settled", SettledQuery, resource, token)
}

// control runs query (a fence function of (resource, token, proof) returning a token) on the
// proxy's control connection, in its own READ COMMITTED, READ WRITE transaction whatever the
// connection's defaults (the functions refuse other isolation levels, and lock the row).
func (k Key) control(ctx context.Context, conn *pgx.Conn, kind, query, resource string, token int64) (int64, error) {
	var stored int64
	err := k.inTx(ctx, conn, kind, resource, token, func(tx pgx.Tx, c Call) error {
		return tx.QueryRow(ctx, query, c.Resource, c.Token, c.Proof).Scan(&stored)
	})
	return stored, err
}

// inTx runs fn with the proof of a call of kind, in a READ COMMITTED, READ WRITE transaction
// of its own on the proxy's control connection, and commits it.
func (k Key) inTx(ctx context.Context, conn *pgx.Conn, kind, resource string, token int64, fn func(pgx.Tx, Call) error) error {
	c, err := k.call(kind, DatabaseName(conn.Config()), resource, token, conn.PgConn().PID())
	if err != nil {
		return err
	}
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted, AccessMode: pgx.ReadWrite})
	if err != nil {
		return err
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // after Commit, a no-op
	if err := fn(tx, c); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// DatabaseName is the database a connection with config c is in: its dbname, or PostgreSQL's
// default, the user name.
func DatabaseName(c *pgx.ConnConfig) string {
	if c.Database != "" {
		return c.Database
	}
	return c.User
}

// SetKey stores k as the proxy key of the database at databaseURL (a role that owns the fence
// schema). Proxies with another key are refused from then on (ZF010).
func SetKey(ctx context.Context, databaseURL string, k Key) error {
	if len(k) < 16 {
		return errors.New("fence: key too short")
	}
	conn, err := pgx.Connect(ctx, databaseURL)
	if err != nil {
		return fmt.Errorf("fence: set key: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	_, err = conn.Exec(ctx, `INSERT INTO fence.keys (id, key) VALUES (1, $1)
		ON CONFLICT (id) DO UPDATE SET key = excluded.key, updated_at = now()
		WHERE fence.keys.key IS DISTINCT FROM excluded.key`, []byte(k))
	if err != nil {
		return fmt.Errorf("fence: set key: %w", err)
	}
	return nil
}
