package lease

import (
	"errors"
	"fmt"
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
