package fence

import (
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgproto3"
)

// SQLSTATEs of fencing rejections. Class ZF: the SQL standard leaves classes
// beginning with I to Z to implementations, and PostgreSQL uses none
// beginning with Z.
//
// Each constant's comment is the error reference of docs/errors.md (go generate
// ./cmd/fenceproxy writes it; TestReference checks that it is current).
const (
	// A higher token was admitted for the resource: the write, or the session, is stale.
	// Message: "stale fencing token: resource "billing" token 33 is lower than the highest
	// admitted token 34".
	CodeStale = "ZF001"
	// A token higher than the lock's current one, so never issued: above Consul's LockIndex
	// (or create-lock token), the PostgreSQL lease's generation, the etcd leader key's
	// CreateRevision or the ZooKeeper lock node's czxid. Message: "fencing token not issued".
	CodeNotIssued = "ZF002"
	// No token where one is required (--unfenced reject), fence.resource without
	// fence.token, or no fence.session for a resource that etcd or ZooKeeper validates (or
	// Consul with --consul-require-session). Message: "fencing token missing", "fencing
	// session missing".
	CodeMissing = "ZF003"
	// A malformed fence.token or fence.resource (from the proxy), an unknown fence.* startup
	// parameter, malformed arguments of a fence.* call, or a resource led by another lock
	// service than the one asked (from the database). Message: "fencing parameter malformed",
	// "malformed fencing token", "malformed fencing resource name", "fencing lease refused",
	// "fencing lock service refused".
	CodeMalformed = "ZF004"
	// The resource is not configured in this proxy (checked before authentication, so
	// resource names are not secret). Message: "unknown fencing resource".
	CodeUnknown = "ZF005"
	// Nobody holds the lock: the lease expired or was released, or the Consul key does not
	// exist. Message: "fencing lock not held".
	CodeNotHeld = "ZF006"
	// Fencing cannot be decided, so the proxy fails closed: the lock service is unreachable,
	// or its numbers went backwards (a regression), or it showed one number held by two
	// holders; or the bind could not run: no proxy key stored, the fence schema missing or
	// too old, the schema owner without pg_read_all_stats, a transaction that is not READ
	// COMMITTED, a server that sent no BackendKeyData. Message: "fencing unavailable", or
	// "fenceproxy could not bind the session".
	CodeUnavailable = "ZF007"
	// The session is bound already: a backend is bound once, and client SQL cannot re-bind
	// it. Message: "not allowed in a fenced session".
	CodeNotAllowed = "ZF008"
	// fence.session is not the lock's holder (Consul's session, etcd's lease, ZooKeeper's
	// session; the PostgreSQL lease does not read it). Message: "fencing session mismatch".
	CodeHolderMismatch = "ZF009"
	// fence.bind, fence.raise or fence.settled without the proxy's proof: client SQL, or a
	// proxy whose --key-file is not the key stored in the database (the proxy then says so,
	// naming its key file; with --control-database it does not start: docs/operations.md).
	// Message: "fencing proof invalid".
	CodeProof = "ZF010"
	// A raise could not end the backends bound to lower tokens within 5 s, or prepared
	// transactions exist in the database; nothing was raised. Message: "fencing raise failed".
	CodeRaiseFailed = "ZF011"
	// A write to a row of a protected table (fence.protect) whose resource this session is
	// not bound to: the row's resource (before or after an UPDATE) is another partition's.
	// Message: "fencing resource not bound". A write to a row written under a higher token is
	// ZF001; a session without a token on a protected table, ZF003; TRUNCATE of one, ZF008.
	CodeNotBound = "ZF012"
)

// Error is a fencing rejection. It carries the SQLSTATE the client sees.
type Error struct {
	Code    string
	Message string
	Detail  string
	Hint    string
	// Resource and Token describe the session, when known.
	Resource string
	Token    int64
	// Admitted is the highest admitted token, when known (stale rejections).
	Admitted int64
	Err      error // cause, if any
}

func (e *Error) Error() string { return e.Message }
func (e *Error) Unwrap() error { return e.Err }

// Is lets errors.Is(err, ErrStale) and friends match by SQLSTATE.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Message == "" && t.Code == e.Code
}

// Sentinels to test a rejection's kind with errors.Is.
var (
	ErrStale          = &Error{Code: CodeStale}
	ErrNotIssued      = &Error{Code: CodeNotIssued}
	ErrMissing        = &Error{Code: CodeMissing}
	ErrMalformed      = &Error{Code: CodeMalformed}
	ErrUnknown        = &Error{Code: CodeUnknown}
	ErrNotHeld        = &Error{Code: CodeNotHeld}
	ErrUnavailable    = &Error{Code: CodeUnavailable}
	ErrHolderMismatch = &Error{Code: CodeHolderMismatch}
)

// IsFencing reports whether err is a fencing rejection and returns it.
func IsFencing(err error) (*Error, bool) {
	var fe *Error
	if errors.As(err, &fe) {
		return fe, true
	}
	return nil, false
}

const howToPass = "pass the lock's token (FENCE_TOKEN of fenceproxy lock: Consul's LockIndex, etcd's leader key revision, ZooKeeper's lock node czxid, or the PostgreSQL lease's generation) as the startup parameter fence.token with fence.resource, " +
	"e.g. options='-c fence.resource=billing -c fence.token=34' (libpq, PGOPTIONS) or ?fence.resource=billing&fence.token=34 (pgx)"

// Stale is the rejection of a token lower than the highest admitted one.
func Stale(resource string, token, admitted int64) *Error {
	return &Error{
		Code:     CodeStale,
		Message:  fmt.Sprintf("stale fencing token: resource %q token %d is lower than the highest admitted token %d", resource, token, admitted),
		Detail:   "Another holder of the lock was admitted with a higher token; this session may no longer write.",
		Hint:     "This process is no longer the leader. Stop writing; acquire the lock again to get a new token.",
		Resource: resource, Token: token, Admitted: admitted,
	}
}

// NotIssued is the rejection of a token higher than Consul's LockIndex.
func NotIssued(resource string, token, current int64) *Error {
	return &Error{
		Code:     CodeNotIssued,
		Message:  fmt.Sprintf("fencing token not issued: resource %q token %d is higher than the lock's current LockIndex %d", resource, token, current),
		Hint:     "Use the LockIndex Consul returned when this process acquired the lock.",
		Resource: resource, Token: token, Admitted: current,
	}
}

// NotHeld is the rejection of a token for a lock nobody holds.
func NotHeld(resource string, token int64) *Error {
	return &Error{
		Code:     CodeNotHeld,
		Message:  fmt.Sprintf("fencing lock not held: nobody holds the lock of resource %q (token %d); its holder's session ended or the lock was released", resource, token),
		Hint:     "Acquire the lock again and use the token it returns (Consul's LockIndex).",
		Resource: resource, Token: token,
	}
}

// HolderMismatch is the rejection of a fence.session that is not the holder.
func HolderMismatch(resource, session, holder string) *Error {
	return &Error{
		Code:     CodeHolderMismatch,
		Message:  fmt.Sprintf("fencing session mismatch: resource %q is held by Consul session %q, not %q", resource, holder, session),
		Hint:     "This process is no longer the leader.",
		Resource: resource,
	}
}

// Unavailable is the fail-closed rejection when token state is unknown.
func Unavailable(resource, why string) *Error {
	return &Error{
		Code:     CodeUnavailable,
		Message:  fmt.Sprintf("fencing unavailable for resource %q: %s", resource, why),
		Hint:     "No token is admitted until the proxy can confirm it; retry later. See docs/consul.md, 'When Consul is unreachable' and 'LockIndex regressions'.",
		Resource: resource,
	}
}

// errRegression is the cause of every Regression error (IsRegression).
var errRegression = errors.New("token regression")

// IsRegression reports whether err is a Regression refusal (a ZF007 that says the lock's
// token went backwards, not that its state is unknown).
func IsRegression(err error) bool { return errors.Is(err, errRegression) }

// Regression is the fail-closed refusal after Consul's LockIndex for the
// resource went backwards (why says what was seen).
func Regression(resource, why string) *Error {
	fe := Unavailable(resource, "LockIndex regression: "+why)
	fe.Err = errRegression
	fe.Hint = "An operator must reset the resource: `fenceproxy fence reset --resource " + resource +
		" --token <the lock's current token> --database <the protected database's URL, as its owner>`; proxies whose --control-database is that database follow it at once, restart the others (docs/consul.md: LockIndex regressions)."
	return fe
}

// Missing is the refusal of a session without a token.
func Missing(why string) *Error {
	return &Error{
		Code:    CodeMissing,
		Message: "fencing token missing: " + why,
		Hint:    howToPass,
	}
}

// Malformed is the refusal of a malformed fence parameter.
func Malformed(why string) *Error {
	return &Error{
		Code:    CodeMalformed,
		Message: "fencing parameter malformed: " + why,
		Hint:    howToPass,
	}
}

// Unknown is the refusal of a resource the proxy does not know.
func Unknown(resource string, known []string) *Error {
	return &Error{
		Code:     CodeUnknown,
		Message:  fmt.Sprintf("unknown fencing resource %q", resource),
		Detail:   fmt.Sprintf("This proxy fences the resources %q.", known),
		Hint:     "Check fence.resource, or add the resource to the proxy's --resource list.",
		Resource: resource,
	}
}

// Ended is the error a fenced session sees when a raise of its resource ended its backend:
// the admission of a higher token. inFlight says whether a unit the client sent was still
// unanswered then (its COMMIT may have committed before the raise); otherwise nothing the
// session sent can have committed after its last answer.
func Ended(resource string, token, admitted int64, inFlight bool) *Error {
	e := Stale(resource, token, admitted)
	if inFlight {
		e.Detail = "This session's backend was ended when the higher token was admitted, while a statement of this session was unanswered: a transaction still open was rolled back; if that statement was a COMMIT, or ran outside a transaction block (autocommit), it may have committed before the new token was admitted, as when any connection is lost."
	} else {
		e.Detail = "This session's backend was ended when the higher token was admitted, while the session waited for no answer: a transaction still open was rolled back, and nothing committed that this session was not told of."
	}
	return e
}

// Response renders the error as the ErrorResponse the client sees.
func (e *Error) Response(severity string) *pgproto3.ErrorResponse {
	return &pgproto3.ErrorResponse{
		Severity:            severity,
		SeverityUnlocalized: severity,
		Code:                e.Code,
		Message:             e.Message,
		Detail:              e.Detail,
		Hint:                e.Hint,
	}
}
