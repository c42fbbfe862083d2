package consul

import (
	"context"
	"fmt"

	"github.com/hashicorp/consul/api"

	"github.com/fenceproxy/fenceproxy/internal/lease"
)

// State is what Consul said about one lock key at one moment. The triple (Key, LockIndex,
// Session) of a held lock is what Consul calls a sequencer; LockIndex is the fencing token.
type State struct {
	Key string
	// Known is true when the fields below come from a consistent read that followed every
	// change the watch saw. It is false before the first read, while Consul is unreachable
	// and until the first read after an outage (the resynchronisation). Err says why.
	Known bool
	Err   error

	Exists      bool   // the key exists
	LockIndex   uint64 // the token of the current (or last) holder; 0 if never locked
	Session     string // the holder session, "" when nobody holds the lock
	Held        bool   // Session != ""
	CreateIndex uint64 // changes when the key is deleted and created again
	ModifyIndex uint64
	Index       uint64 // X-Consul-Index of the read
	// Mode says which number is the token (lease.TokenLockIndex when empty).
	Mode lease.TokenMode

	// Highest is the highest token (of Mode) the Watcher saw for the key (since it
	// started or since Reset). Zero in states that do not come from a Watcher.
	Highest uint64
	// Regression is set, and stays set until Watcher.Reset, once the token went
	// backwards. Known may be true at the same time: the state is known and unusable.
	Regression *RegressionError
}

// Current returns the token (of s.Mode) of the key's current or last acquisition: its
// LockIndex, or lease.EncodeToken(CreateIndex, LockIndex); 0 when the key does not exist. The
// error wraps lease.ErrTokenRange when the indexes do not fit the encoding.
func (s State) Current() (int64, error) {
	return s.Mode.TokenOf(s.Exists, s.CreateIndex, s.LockIndex)
}

// Token returns the token of the current holder: Current of a held lock in a known,
// regression-free state. Otherwise it returns the reason as an error (lease.ErrUnavailable,
// lease.ErrRegression or lease.ErrNotHeld).
func (s State) Token() (int64, error) {
	if err := s.usable(); err != nil {
		return 0, err
	}
	cur, err := s.Current()
	if err != nil {
		return 0, &TokenError{Key: s.Key, State: s, Err: lease.ErrUnavailable, Cause: err}
	}
	if !s.Held || s.LockIndex == 0 {
		return 0, &TokenError{Key: s.Key, Token: cur, State: s, Err: lease.ErrNotHeld}
	}
	return cur, nil
}

// Check decides whether token (and session, when not "") may be admitted under this
// state: the token must equal Current of a held lock, and a given session must be the
// holder. The answers, in this order:
//
//   - unknown state, or indexes outside the encoding: lease.ErrUnavailable; regression: a
//     *RegressionError;
//   - the key does not exist: lease.ErrNotHeld (whatever the token: nobody holds anything);
//   - token < Current: lease.ErrStale (a newer leader exists, held or not);
//   - token > Current: lease.ErrNotIssued;
//   - lock free or LockIndex 0: lease.ErrNotHeld;
//   - session given and not the holder: lease.ErrSessionMismatch.
func (s State) Check(token int64, session string) error {
	if err := s.usable(); err != nil {
		return err
	}
	fail := func(sentinel error) error {
		return &TokenError{Key: s.Key, Token: token, Session: session, State: s, Err: sentinel}
	}
	cur, err := s.Current()
	if err != nil {
		return &TokenError{Key: s.Key, Token: token, Session: session, State: s, Err: lease.ErrUnavailable, Cause: err}
	}
	switch {
	case !s.Exists:
		// Deleted (`consul lock` deletes the key after every release) or never created:
		// the lock is free. Not ErrNotIssued: the token may well have been issued, by an
		// incarnation of the key that is gone.
		return fail(lease.ErrNotHeld)
	case token < cur:
		return fail(lease.ErrStale)
	case token > cur:
		return fail(lease.ErrNotIssued)
	case !s.Held || s.LockIndex == 0:
		// LockIndex 0 with a holder: a plain write reset the key; no token was issued.
		return fail(lease.ErrNotHeld)
	case session != "" && session != s.Session:
		return fail(lease.ErrSessionMismatch)
	}
	return nil
}

func (s State) usable() error {
	if !s.Known {
		return &TokenError{Key: s.Key, State: s, Err: lease.ErrUnavailable, Cause: s.Err}
	}
	if s.Regression != nil {
		return s.Regression
	}
	return nil
}

// Read returns the lock key's state from a consistent read (the leader confirms it is
// still the leader before answering), so that it reflects every write acknowledged before
// the call. A Consul error is returned wrapped, with State.Known false. The state's Mode
// is lease.TokenLockIndex; set it to read the token of another mode.
func Read(ctx context.Context, client *api.Client, key string) (State, error) {
	q := (&api.QueryOptions{RequireConsistent: true}).WithContext(ctx)
	pair, meta, err := client.KV().Get(key, q)
	if err != nil {
		err = fmt.Errorf("consistent read of %q: %w", key, err)
		return State{Key: key, Err: err}, err
	}
	return stateOf(key, pair, meta.LastIndex), nil
}

func stateOf(key string, pair *api.KVPair, index uint64) State {
	s := State{Key: key, Known: true, Index: index}
	if pair != nil {
		s.Exists = true
		s.LockIndex = pair.LockIndex
		s.Session = pair.Session
		s.Held = pair.Session != ""
		s.CreateIndex = pair.CreateIndex
		s.ModifyIndex = pair.ModifyIndex
	}
	return s
}

// Validate is the check at session start: a consistent read of the lock, then
// State.Check. It needs no Watcher, and so cannot detect regressions; the proxy uses
// Watcher.Validate, which can.
func Validate(ctx context.Context, client *api.Client, key string, token int64, session string) (State, error) {
	s, err := Read(ctx, client, key)
	if err != nil {
		return s, &TokenError{Key: key, Token: token, Session: session, State: s, Err: lease.ErrUnavailable, Cause: err}
	}
	return s, s.Check(token, session)
}
