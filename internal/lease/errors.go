package lease

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/hashicorp/consul/api"
)

// Sentinel errors. Callers ask errors.Is questions; the SQLSTATE each maps to is the one
// the proxy reports (docs/ARCHITECTURE.md).
var (
	// ErrStale: the token is lower than the lock's current LockIndex, so a newer leader
	// was elected. SQLSTATE ZF001.
	ErrStale = errors.New("stale fencing token")
	// ErrNotIssued: the token is higher than the lock's current LockIndex; Consul never
	// issued it. SQLSTATE ZF002.
	ErrNotIssued = errors.New("fencing token not issued")
	// ErrNotHeld: the lock key exists with the token's LockIndex (or does not exist) but
	// no session holds it: its session ended or released it. SQLSTATE ZF006.
	ErrNotHeld = errors.New("lock not held")
	// ErrUnavailable: the lock's state is unknown (Consul unreachable, no leader, ACL
	// denied, or the watch has not resynchronised yet). SQLSTATE ZF007.
	ErrUnavailable = errors.New("lock state unknown")
	// ErrRegression: the lock's LockIndex went backwards (key deleted and re-created, plain
	// PUT on the key, snapshot restore). Tokens of the resource cannot be trusted until an
	// operator intervenes. A *RegressionError matches both ErrRegression and
	// ErrUnavailable. SQLSTATE ZF007.
	ErrRegression = errors.New("LockIndex regression")
	// ErrSessionMismatch: a session was given with the token and it is not the lock's
	// holder (Consul's sequencer check). SQLSTATE ZF009.
	ErrSessionMismatch = errors.New("holder session mismatch")

	// ErrSessionExpired: a Session was invalidated by Consul, or could not be renewed
	// within its TTL, so every lock it held must be considered lost.
	ErrSessionExpired = errors.New("consul session expired")
	// ErrLockLost: a Lock's key no longer shows our acquisition (session invalidated,
	// key released, taken, deleted or overwritten).
	ErrLockLost = errors.New("lock lost")
	// ErrReleased: Lock.Err after Lock.Release.
	ErrReleased = errors.New("lock released")
	// ErrRefused: a Store refused a campaign for a reason that retrying cannot change (a
	// malformed argument, a fence schema without the lease, a role without the privilege,
	// failed authentication). RunLocked returns it instead of campaigning again.
	ErrRefused = errors.New("campaign refused")
)

// Permanent reports whether a Consul error is one that retrying cannot change: an ACL refusal
// (HTTP 401 or 403: a token without the rights, or none where ACLs are on), or a scheme that
// does not match the server's (HTTPS to an HTTP port, HTTP to an HTTPS port). A refused
// connection, a timeout or a 5xx may pass and are not permanent.
func Permanent(err error) bool {
	var se api.StatusError
	if errors.As(err, &se) {
		return se.Code == http.StatusUnauthorized || se.Code == http.StatusForbidden ||
			se.Code == http.StatusBadRequest && strings.Contains(se.Body, "HTTP request to an HTTPS server")
	}
	var rhe tls.RecordHeaderError
	return errors.Is(err, http.ErrSchemeMismatch) || errors.As(err, &rhe) ||
		// The api package flattens the transport's error into text in places.
		err != nil && strings.Contains(err.Error(), http.ErrSchemeMismatch.Error())
}

// TokenError is the answer of a token check that failed: which lock, which token, what
// Consul said. It matches (errors.Is) exactly one of ErrStale, ErrNotIssued, ErrNotHeld,
// ErrUnavailable, ErrSessionMismatch, and the Consul error behind an ErrUnavailable.
type TokenError struct {
	Key     string
	Token   int64
	Session string // the session given with the token, "" if none
	State   State  // what Consul said (State.Known is false for ErrUnavailable)
	Err     error  // the sentinel
	Cause   error  // for ErrUnavailable: the Consul error, if any
}

func (e *TokenError) Error() string {
	s := e.State
	cur, _ := s.Current()
	what := s.Mode.Describe()
	switch e.Err {
	case ErrStale:
		return fmt.Sprintf("lock %q: %v: token %d is lower than the lock's current %s %d: a newer leader "+
			"was elected; stop writing and acquire the lock again", e.Key, e.Err, e.Token, what, cur)
	case ErrNotIssued:
		return fmt.Sprintf("lock %q: %v: token %d is higher than the lock's current %s %d: use the "+
			"%s read from Consul after acquiring the lock", e.Key, e.Err, e.Token, what, cur, what)
	case ErrNotHeld:
		if !s.Exists {
			return fmt.Sprintf("lock %q: %v: the key does not exist in Consul (deleted, or never created): "+
				"nobody holds the lock; acquire it first", e.Key, e.Err)
		}
		return fmt.Sprintf("lock %q: %v: token %d is the current %s but no session holds the lock: "+
			"its session ended (expired, invalidated or destroyed) or released it; acquire the lock again", e.Key, e.Err, e.Token, what)
	case ErrSessionMismatch:
		return fmt.Sprintf("lock %q: %v: session %s is not the holder of %s %d (holder %s)",
			e.Key, e.Err, e.Session, what, cur, s.Session)
	case ErrUnavailable:
		if e.Cause != nil {
			return fmt.Sprintf("lock %q: %v: %v: new tokens are refused until Consul answers", e.Key, e.Err, e.Cause)
		}
		return fmt.Sprintf("lock %q: %v: new tokens are refused until Consul answers", e.Key, e.Err)
	}
	return fmt.Sprintf("lock %q: token %d: %v", e.Key, e.Token, e.Err)
}

func (e *TokenError) Unwrap() []error {
	if e.Cause != nil {
		return []error{e.Err, e.Cause}
	}
	return []error{e.Err}
}

// RegressionError says that a lock's LockIndex went backwards, what was seen and what had
// been seen before. It matches ErrRegression and ErrUnavailable.
//
// Why it matters: the database keeps the highest token it admitted, so after a regression
// every new leader's token is lower than the stored one and all its writes fail as stale,
// while Consul says it is the leader. Rather than silently locking every future leader
// out (or, worse, accepting a lower token), the resource fails closed and says why.
type RegressionError struct {
	Key    string
	Reason string // e.g. "LockIndex went from 34 to 0"

	// What had been seen before: the highest LockIndex and the key's CreateIndex.
	Highest     uint64
	CreateIndex uint64
	// What is seen now.
	Seen State
	At   time.Time
}

func (e *RegressionError) Error() string {
	cur, _ := e.Seen.Current()
	what := e.Seen.Mode.Describe()
	return fmt.Sprintf("lock %q: %v: %s (highest %s seen %d, now %d): tokens of this lock are not "+
		"trusted until an operator resets the resource's fence to the new %s",
		e.Key, ErrRegression, e.Reason, what, e.Highest, cur, what)
}

// Is reports a match with ErrRegression and ErrUnavailable: a regressed lock's state is
// unusable, whatever else the caller does with it.
func (e *RegressionError) Is(target error) bool {
	return target == ErrRegression || target == ErrUnavailable
}

// ExitError is RunLocked's answer when the child command exited unsuccessfully. Code is its
// exit status, or 128+signal when a signal ended it (the shell's convention), so that a
// command line tool can exit with the same status.
type ExitError struct {
	Code int
	Err  error // the *exec.ExitError
}

func (e *ExitError) Error() string {
	return fmt.Sprintf("child exited with status %d: %v", e.Code, e.Err)
}
func (e *ExitError) Unwrap() error { return e.Err }

// ExitCode returns Code, for callers that ask errors.As(err, &interface{ ExitCode() int }).
func (e *ExitError) ExitCode() int { return e.Code }
