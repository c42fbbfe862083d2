// Package consul is Consul as a lock service: campaigning for a lock key (NewSession,
// Acquire, Lock, Store), following lock keys (Watcher: consistent blocking queries, a State
// per key, every change reported, LockIndex regressions detected), the token check at
// session start (Validate and Watcher.Validate, with one sentinel error of package lease per
// answer), and the proxy's Guard, which admits a session's token only when Consul shows it
// current and raises each new holder's token in the database.
//
// A Consul lock is a KV key acquired with a session. Its LockIndex goes up by one on every
// successful acquisition and is the fencing token (or, in mode lease.TokenCreateLock, part
// of it: see "Token modes" below); (key, LockIndex, holder session) is what Consul calls a
// sequencer.
//
// # Consistency
//
// Every read that decides something is a consistent read (`?consistent`): the Consul
// leader confirms it still leads before answering, so a read reflects every write
// acknowledged before it started. A stale read could admit a token Consul already
// replaced. Watches are blocking queries on the key's index, so a change is seen within
// one round trip, and a Consul index that goes backwards (snapshot restore) restarts the
// watch from 0. After any failed read a key's state is unknown until a read succeeds
// again, which is the resynchronisation: nothing is admitted in between.
//
// # The token of our own acquisition
//
// Acquire locks the key and reads it back in one Consul transaction, so the LockIndex it
// returns is the one its own acquisition produced, checked to show its own session. A
// separate read after the acquire could return a later holder's LockIndex if the session
// was lost in between.
//
// # Lock-delay is 0 by default
//
// Consul's lock-delay (15 s unless the session says otherwise) keeps a lock unavailable
// for that long after its holder's session is invalidated, in the hope that a holder that
// lost its lease notices before the next holder starts. It is a guess, not a guarantee: a
// holder frozen for longer than the delay still wakes up believing it leads. Fencing makes
// the guess unnecessary: the database refuses the old holder's writes whenever they
// arrive, because the new holder's higher token was admitted first. So the delay would
// only add unavailability to every failover. Measured on Consul 1.16.3 with a holder
// frozen (SIGSTOP) and a 10 s TTL, the next holder acquires after 20.0 s with lock-delay 0
// (Consul's own bound of 2 x TTL; TestCampaignFrozenHolder) and after about 35 s with the
// default 15 s. NewSession sends the lock-delay explicitly: Consul's api client omits a
// zero LockDelay from the request, which Consul reads as "use the default 15 s".
//
// # Sessions and timing
//
// A Session is renewed every TTL/2. Consul invalidates a silent session between TTL and
// 2 x TTL after its last renewal; this side gives up after one TTL without a successful
// renewal (Session.Done), because past that it cannot know whether it still holds
// anything. A Lock's Done closes as soon as its key stops showing the acquisition
// (released, taken, deleted or overwritten) or its session ends.
//
// # Token modes
//
// LockIndex restarts at 1 when a key is deleted and created again, and Consul's own lock
// tools do exactly that: `consul lock` deletes its key after every release, api.Lock's
// Destroy deletes it, and a session with behavior "delete" deletes its keys when it ends.
// With the LockIndex as the token (TokenLockIndex, the default, kept for the deployments
// whose database and clients already use it) every such hand-over is a regression. The
// mode TokenCreateLock makes the token EncodeToken(CreateIndex, LockIndex) =
// CreateIndex<<24 | LockIndex, chosen over the alternatives for these reasons:
//
//   - It is monotonic across re-creation by Consul's own rules: CreateIndex is the Raft
//     index of the creating write, above every index of the key's previous incarnations
//     (EncodeToken has the argument).
//   - It is a function of the key's current state, which anyone can read at any time: the
//     child of `consul lock`, an application after api.Lock, the proxy validating it. The
//     ModifyIndex of the acquiring write would also grow, but any later write to the key
//     (the holder updating its value, a re-acquire by the same session) moves ModifyIndex
//     without a new acquisition, and a reader cannot tell which write acquired.
//   - It still fails closed where the sequence really goes back: a plain write on a held
//     key (LockIndex 0 under the same CreateIndex) and a snapshot restore (CreateIndex
//     back) give a token below the highest seen.
//   - Moving a resource from LockIndex to create-lock tokens is a raise, never a reset:
//     every create-lock token (at least 2^24) is above every LockIndex that fits.
//
// The price is a bound: 24 bits of LockIndex per incarnation of the key, 39 bits of
// CreateIndex. Past either, State.Check answers ErrUnavailable (ErrTokenRange), never a
// wrong order.
//
// # Regressions, and the operator's way out
//
// LockIndex is not always monotonic. Deleting the key and acquiring it again restarts at
// 1 (so does a session with behavior "delete", which is why sessions here use "release";
// in mode TokenCreateLock neither is a regression);
// a plain write to the key (a PUT without ?acquire) resets LockIndex to 0 even while it is
// held; a snapshot restore moves it back to the snapshot's value. The database keeps the
// highest token it admitted, so after a regression every new leader would be refused as
// stale while Consul says it leads. The Watcher notices (a LockIndex below the highest
// seen, or a changed CreateIndex) and marks the key's state with a *RegressionError, which
// stays until Watcher.Reset: the proxy fails closed for the resource (ZF007), logs it and
// counts it, instead of silently accepting a lower token or locking leaders out without
// saying why.
//
// The way out, for an operator: stop the writers of the resource (or let them fail), make
// sure the lock's key is the one they should use, reset the resource's stored token in the
// database to the lock's current LockIndex (the proxy's fence tooling), then reset the
// watcher's history (Watcher.Reset, or restart the proxy, which starts with none and
// compares the stored token with Consul's LockIndex itself). An alternative that needs no
// database change is to raise Consul's LockIndex past the stored token by acquiring and
// releasing the key that many times, practical only for small gaps.
package consul
