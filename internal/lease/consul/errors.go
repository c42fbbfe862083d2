package consul

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/fenceproxy/fenceproxy/internal/lease"
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
// Consul said. It matches (errors.Is) exactly one of lease.ErrStale, lease.ErrNotIssued, lease.ErrNotHeld,
// lease.ErrUnavailable, lease.ErrSessionMismatch, and the Consul error behind an lease.ErrUnavailable.
type TokenError struct {
	Key     string
	Token   int64
	Session string // the session given with the token, "" if none
	State   State  // what Consul said (State.Known is false for lease.ErrUnavailable)
	Err     error  // the sentinel
	Cause   error  // for ErrUnavailable: the Consul error, if any
}

func (e *TokenError) Error() string {
	s := e.State
	cur, _ := s.Current()
	what := s.Mode.Describe()
	switch e.Err {
	case lease.ErrStale:
		return fmt.Sprintf("lock %q: %v: token %d is lower than the lock's current %s %d: a newer leader "+
			"was elected; stop writing and acquire the lock again", e.Key, e.Err, e.Token, what, cur)
	case lease.ErrNotIssued:
		return fmt.Sprintf("lock %q: %v: token %d is higher than the lock's current %s %d: use the "+
			"%s read from Consul after acquiring the lock", e.Key, e.Err, e.Token, what, cur, what)
	case lease.ErrNotHeld:
		if !s.Exists {
			return fmt.Sprintf("lock %q: %v: the key does not exist in Consul (deleted, or never created): "+
				"nobody holds the lock; acquire it first", e.Key, e.Err)
		}
		return fmt.Sprintf("lock %q: %v: token %d is the current %s but no session holds the lock: "+
			"its session ended (expired, invalidated or destroyed) or released it; acquire the lock again", e.Key, e.Err, e.Token, what)
	case lease.ErrSessionMismatch:
		return fmt.Sprintf("lock %q: %v: session %s is not the holder of %s %d (holder %s)",
			e.Key, e.Err, e.Session, what, cur, s.Session)
	case lease.ErrUnavailable:
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
// been seen before. It matches lease.ErrRegression and lease.ErrUnavailable.
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
		e.Key, lease.ErrRegression, e.Reason, what, e.Highest, cur, what)
}

// Is reports a match with lease.ErrRegression and ErrUnavailable: a regressed lock's state is
// unusable, whatever else the caller does with it.
func (e *RegressionError) Is(target error) bool {
	return target == lease.ErrRegression || target == lease.ErrUnavailable
}
