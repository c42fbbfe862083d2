package consul

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/hashicorp/consul/api"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/lease"
)

// Defaults of WatcherConfig.
const (
	// DefaultWaitTime is short for a blocking query (Consul's default is 5 minutes): it
	// bounds how long a hung Consul, or a snapshot restore that moved the index back
	// under a query already waiting on a newer one, goes unnoticed. One request per key
	// every 10 s costs Consul nothing.
	DefaultWaitTime = 10 * time.Second
	DefaultRetryMin = 100 * time.Millisecond
	DefaultRetryMax = 5 * time.Second
)

// errNotSynced is the Err of a key's state before its first read.
var errNotSynced = errors.New("not synchronised with Consul yet")

// WatcherConfig configures a Watcher. The zero value of every field but Keys means its
// default.
type WatcherConfig struct {
	// Keys are the lock keys to watch, e.g. "locks/billing". At least one.
	Keys []string

	// OnChange, when not nil, is called with a key's new state every time anything in it
	// changes: acquisition, release, holder, LockIndex, CreateIndex, the key's existence,
	// Known (Consul lost or back, after the resynchronising read), and Regression. Calls
	// for one key are made one at a time, in the order of the changes, from that key's
	// watch goroutine; calls for different keys may run concurrently. A slow OnChange
	// delays the key's next read (the state is never skipped over), so it should hand
	// long work (raising tokens in a database, cancelling queries) to other goroutines
	// or keep it short.
	OnChange func(State)

	// WaitTime is the longest a blocking query waits for a change (Consul caps it at
	// 10 minutes). It also bounds how long a hung Consul goes unnoticed: a query gets
	// WaitTime plus Consul's jitter (WaitTime/16) plus a margin (WaitTime/2, between 1 s
	// and 5 s) before it counts as failed.
	// Default DefaultWaitTime.
	WaitTime time.Duration

	// RetryMin and RetryMax bound the backoff between failed reads. Defaults
	// DefaultRetryMin and DefaultRetryMax.
	RetryMin, RetryMax time.Duration

	// Logger receives errors, outages, resynchronisations and regressions. Nil: no logs.
	Logger *zap.Logger

	// Mode says which number of a key is its token (State.Mode, regression detection).
	// Empty: lease.TokenLockIndex.
	Mode lease.TokenMode
}

// Watcher follows lock keys with consistent blocking queries and keeps, per key, the
// State Consul last reported, whether it is known, and the history needed to detect a
// LockIndex regression. Create it with NewWatcher, run it with Run.
type Watcher struct {
	client *api.Client
	cfg    WatcherConfig
	log    *zap.Logger
	keys   map[string]*keyWatch

	mu sync.Mutex // guards every keyWatch's state and history
}

type keyWatch struct {
	key string
	// emit serialises the computation of a new state with its OnChange call, so that
	// OnChange sees a key's states in order even when Reset runs concurrently.
	emit  sync.Mutex
	state State

	// History, for regression detection.
	mode        lease.TokenMode
	highest     uint64 // highest token (of mode) issued while watched
	createIndex uint64 // TokenLockIndex: CreateIndex when the key was first seen (0: never seen)
	holder      string // the session that held the lock with highest ("": not seen held)
}

// NewWatcher validates cfg and returns a Watcher that is not running yet.
func NewWatcher(client *api.Client, cfg WatcherConfig) (*Watcher, error) {
	if client == nil {
		return nil, errors.New("lease: NewWatcher: nil Consul client")
	}
	if len(cfg.Keys) == 0 {
		return nil, errors.New("lease: NewWatcher: no keys to watch")
	}
	if cfg.WaitTime < 0 || cfg.WaitTime > 10*time.Minute {
		return nil, fmt.Errorf("lease: NewWatcher: WaitTime %v outside (0, 10m]", cfg.WaitTime)
	}
	if cfg.WaitTime == 0 {
		cfg.WaitTime = DefaultWaitTime
	}
	if cfg.RetryMin <= 0 {
		cfg.RetryMin = DefaultRetryMin
	}
	if cfg.RetryMax <= 0 {
		cfg.RetryMax = DefaultRetryMax
	}
	mode, err := lease.ParseTokenMode(string(cfg.Mode))
	if err != nil {
		return nil, err
	}
	cfg.Mode = mode
	if cfg.RetryMax < cfg.RetryMin {
		return nil, fmt.Errorf("lease: NewWatcher: RetryMax %v < RetryMin %v", cfg.RetryMax, cfg.RetryMin)
	}
	w := &Watcher{client: client, cfg: cfg, log: cfg.Logger, keys: make(map[string]*keyWatch, len(cfg.Keys))}
	if w.log == nil {
		w.log = zap.NewNop()
	}
	for _, k := range cfg.Keys {
		if k == "" || k[0] == '/' {
			return nil, fmt.Errorf("lease: NewWatcher: invalid key %q", k)
		}
		if _, dup := w.keys[k]; dup {
			return nil, fmt.Errorf("lease: NewWatcher: key %q given twice", k)
		}
		w.keys[k] = &keyWatch{key: k, mode: mode, state: State{Key: k, Err: errNotSynced, Mode: mode}}
	}
	return w, nil
}

// Run watches every key until ctx ends, then returns ctx's error. Consul errors never end
// it: the key's state becomes unknown, and the watch retries with backoff and reports the
// state known again after its first successful read.
func (w *Watcher) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	for _, k := range w.keys {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w.watch(ctx, k)
		}()
	}
	wg.Wait()
	return ctx.Err()
}

// State returns the key's current state; false if the key is not watched.
func (w *Watcher) State(key string) (State, bool) {
	k, ok := w.keys[key]
	if !ok {
		return State{Key: key}, false
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return k.state, true
}

// watch is one key's loop of consistent blocking queries.
func (w *Watcher) watch(ctx context.Context, k *keyWatch) {
	kv := w.client.KV()
	retry := lease.NewBackoff(w.cfg.RetryMin, w.cfg.RetryMax)
	// Consul adds up to WaitTime/16 of jitter to a blocking query; past that plus a
	// margin, Consul is hung or the network is, and the state must become unknown.
	timeout := w.cfg.WaitTime + w.cfg.WaitTime/16 + max(time.Second, min(5*time.Second, w.cfg.WaitTime/2))
	var index uint64 // 0: read at once (first read, and resynchronisation after errors)
	var seen uint64  // the last index Consul reported, to notice it going backwards
	for {
		q := &api.QueryOptions{RequireConsistent: true, WaitIndex: index, WaitTime: w.cfg.WaitTime}
		qctx, cancel := context.WithTimeout(ctx, timeout)
		started := time.Now()
		pair, meta, err := kv.Get(k.key, q.WithContext(qctx))
		cancel()
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			w.lost(k, err)
			index = 0
			if !retry.Wait(ctx) {
				return
			}
			continue
		}
		retry.Reset()
		if meta.LastIndex < seen {
			w.log.Warn("consul index went backwards; watch restarts from 0",
				zap.String("key", k.key), zap.Uint64("index", meta.LastIndex), zap.Uint64("previous", seen))
		}
		seen = meta.LastIndex
		w.observe(k, pair, meta.LastIndex)
		index = nextIndex(index, meta.LastIndex, time.Since(started) < w.cfg.WaitTime/2)
	}
}

// nextIndex returns the WaitIndex of the next blocking query, after one that waited on
// prev and returned index last, early or after (about) its whole wait time.
func nextIndex(prev, last uint64, early bool) uint64 {
	switch {
	case last < prev:
		// The index went backwards: a snapshot restore or a rebuilt cluster. Waiting
		// on the old index would block until Consul catches up with it; start over.
		return 0
	case last == prev && early && prev != 0:
		// Woken early with nothing new: Consul abandoned its state store (a snapshot
		// restore wakes every blocking query with the old state's answer). Read the new
		// state at once instead of waiting on an index it may not reach for long.
		return 0
	case last == 0:
		// Never block on 0 again and again (Consul's advice: the index is at least 1).
		return 1
	}
	return last
}

// lost records a failed read: the state becomes unknown (reported once per outage).
func (w *Watcher) lost(k *keyWatch, err error) {
	k.emit.Lock()
	defer k.emit.Unlock()
	w.mu.Lock()
	prev := k.state
	next := prev
	next.Known = false
	next.Err = fmt.Errorf("watch of %q: %w", k.key, err)
	k.state = next
	w.mu.Unlock()
	if prev.Known || prev.Err == errNotSynced {
		w.log.Warn("consul lock state unknown", zap.String("key", k.key), zap.Error(err))
	}
	if prev.Known {
		w.notify(next)
	}
}

// observe records a successful consistent read.
func (w *Watcher) observe(k *keyWatch, pair *api.KVPair, index uint64) {
	k.emit.Lock()
	defer k.emit.Unlock()
	w.mu.Lock()
	prev := k.state
	next := stateOf(k.key, pair, index)
	next.Mode = k.mode
	newRegression := false
	if prev.Regression == nil {
		if reason := k.regressed(next); reason != "" {
			next.Regression = &RegressionError{
				Key: k.key, Reason: reason, Highest: k.highest, CreateIndex: k.createIndex,
				Seen: next, At: time.Now(),
			}
			newRegression = true
		}
	} else {
		// Sticky until Reset: the database still holds tokens of the old sequence.
		next.Regression = prev.Regression
	}
	if next.Regression == nil {
		k.record(next)
	}
	next.Highest = k.highest
	k.state = next
	w.mu.Unlock()

	switch {
	case newRegression:
		w.log.Error("consul token regression: failing closed for this lock",
			zap.String("key", k.key), zap.Error(next.Regression))
	case !prev.Known && prev.Err != errNotSynced:
		w.log.Info("consul lock state resynchronised", zap.String("key", k.key),
			zap.Uint64("token", next.LockIndex), zap.String("session", next.Session))
	}
	if changed(prev, next) {
		w.notify(next)
	}
}

// regressed says why next breaks the monotonic sequence of tokens the key issued, or ""
// if it does not. Only keys that issued a token (highest > 0) can regress: deleting and
// re-creating a key nobody ever locked harms nobody.
//
// TokenLockIndex: any new CreateIndex is a regression (LockIndex restarted), and so is a
// LockIndex below the highest. TokenCreateLock: only a token below the highest is, which
// takes a plain write on a held key (LockIndex back to 0 under the same CreateIndex) or a
// snapshot restore (CreateIndex back); a re-created key's tokens are higher (lease.EncodeToken).
//
// In both modes, the highest token held by another session than the one seen with it is a
// regression too: Consul issued the number twice, which one transaction that writes the held
// key (LockIndex back to 0), unlocks it and locks it for another session (LockIndex 1 again)
// does without the watch ever seeing the lower number.
func (k *keyWatch) regressed(next State) string {
	if !next.Exists || k.highest == 0 {
		return ""
	}
	if cur, err := next.Current(); err == nil && uint64(cur) == k.highest && next.Held && next.LockIndex > 0 &&
		k.holder != "" && next.Session != k.holder && (k.mode == lease.TokenCreateLock || next.CreateIndex == k.createIndex) {
		return fmt.Sprintf("token %d was held by Consul session %s and is now held by session %s: Consul issued the number twice "+
			"(a write to the held key in the transaction that handed the lock over resets its LockIndex)", cur, k.holder, next.Session)
	}
	if k.mode == lease.TokenCreateLock {
		cur, err := next.Current()
		if err != nil || uint64(cur) >= k.highest {
			return "" // out of range: unusable, and Check says so (ZF007); not a regression
		}
		hc, hl := lease.DecodeToken(int64(k.highest))
		if next.CreateIndex < hc {
			return fmt.Sprintf("the key's CreateIndex went back from %d to %d (a snapshot restore, or a Consul that lost its data)",
				hc, next.CreateIndex)
		}
		return fmt.Sprintf("LockIndex went from %d to %d under CreateIndex %d (a plain write to the held key resets it to 0)",
			hl, next.LockIndex, next.CreateIndex)
	}
	if k.createIndex != 0 && next.CreateIndex != k.createIndex {
		return fmt.Sprintf("the key was deleted and created again (CreateIndex %d, was %d), so its LockIndex restarted at %d "+
			"(with `consul lock` or api.Lock's Destroy, use --consul-token-mode create-lock)",
			next.CreateIndex, k.createIndex, next.LockIndex)
	}
	if next.LockIndex < k.highest {
		return fmt.Sprintf("LockIndex went from %d to %d (a plain write to the key resets it to 0; a snapshot restore moves it back)",
			k.highest, next.LockIndex)
	}
	return ""
}

// record adds a regression-free state to the history.
func (k *keyWatch) record(s State) {
	if !s.Exists {
		return // a deleted key keeps its history: a lower token later is a regression
	}
	if k.mode == lease.TokenCreateLock {
		if cur, err := s.Current(); err == nil && s.LockIndex > 0 {
			k.raise(uint64(cur), s)
		}
		return
	}
	if k.createIndex == 0 {
		k.createIndex = s.CreateIndex
	}
	k.raise(s.LockIndex, s)
}

// raise makes tok the highest token if it is higher, and notes its holder when s is held.
func (k *keyWatch) raise(tok uint64, s State) {
	if tok > k.highest {
		k.highest, k.holder = tok, ""
	}
	if tok == k.highest && s.Held && k.holder == "" {
		k.holder = s.Session
	}
}

func changed(a, b State) bool {
	return a.Known != b.Known || a.Exists != b.Exists || a.LockIndex != b.LockIndex ||
		a.Session != b.Session || a.CreateIndex != b.CreateIndex || a.ModifyIndex != b.ModifyIndex ||
		a.Regression != b.Regression
}

func (w *Watcher) notify(s State) {
	if w.cfg.OnChange != nil {
		w.cfg.OnChange(s)
	}
}

// Reset is the operator's way out of a regression: it forgets the key's history and
// takes its current state as the new baseline (highest LockIndex and CreateIndex). Call
// it only after the resource's stored token in the database was reset to match Consul's
// new sequence, or every new leader stays fenced out as stale. It reports the new state
// through OnChange; it returns an error if the key is not watched or its state is unknown.
func (w *Watcher) Reset(key string) error {
	k, ok := w.keys[key]
	if !ok {
		return fmt.Errorf("lease: Reset: key %q is not watched", key)
	}
	k.emit.Lock()
	defer k.emit.Unlock()
	w.mu.Lock()
	prev := k.state
	if !prev.Known {
		w.mu.Unlock()
		return &TokenError{Key: key, State: prev, Err: lease.ErrUnavailable, Cause: prev.Err}
	}
	next := prev
	next.Regression = nil
	k.highest, k.createIndex, k.holder = 0, 0, ""
	k.record(next)
	next.Highest = k.highest
	k.state = next
	w.mu.Unlock()
	w.log.Warn("lock history reset by operator", zap.String("key", key), zap.Uint64("lock_index", next.LockIndex))
	if changed(prev, next) {
		w.notify(next)
	}
	return nil
}

// Regress marks the key's state regressed with reason (unless it already is), as if the watch
// had seen it: for regressions learned elsewhere (the database's record of one, made by another
// proxy or before a restart). It is sticky until Reset, and reported through OnChange.
func (w *Watcher) Regress(key, reason string) error {
	k, ok := w.keys[key]
	if !ok {
		return fmt.Errorf("lease: Regress: key %q is not watched", key)
	}
	k.emit.Lock()
	defer k.emit.Unlock()
	w.mu.Lock()
	prev := k.state
	if prev.Regression != nil {
		w.mu.Unlock()
		return nil
	}
	next := prev
	next.Regression = &RegressionError{Key: key, Reason: reason, Highest: k.highest, CreateIndex: k.createIndex, Seen: prev, At: time.Now()}
	k.state = next
	w.mu.Unlock()
	w.log.Error("consul token regression recorded elsewhere: failing closed for this lock",
		zap.String("key", key), zap.Error(next.Regression))
	w.notify(next)
	return nil
}

// Read is a consistent read of a watched key, with the watcher's token mode; it changes
// nothing in the watcher.
func (w *Watcher) Read(ctx context.Context, key string) (State, error) {
	s, err := Read(ctx, w.client, key)
	s.Mode = w.cfg.Mode
	return s, err
}

// Validate is the token check at session start. It refuses while the key's state is not
// known (never synchronised, Consul lost, or not yet resynchronised after an outage) or
// regressed, then does its own consistent read and checks the token against it
// (State.Check), and against the key's history: a read that shows a LockIndex lower than
// the highest seen, or a re-created key, is refused as a regression even before the watch
// reports it. The history is taken before the read starts, so a concurrent change the
// watch saw first can never make a fresh read look like a regression.
func (w *Watcher) Validate(ctx context.Context, key string, token int64, session string) (State, error) {
	k, ok := w.keys[key]
	if !ok {
		return State{Key: key}, fmt.Errorf("lease: Validate: key %q is not watched", key)
	}
	w.mu.Lock()
	cur := k.state
	hist := keyWatch{key: key, mode: k.mode, highest: k.highest, createIndex: k.createIndex, holder: k.holder}
	w.mu.Unlock()
	if cur.Regression != nil {
		return cur, cur.Regression
	}
	// A watch that lost Consul (state not Known) waits out its backoff before it reads
	// again: the consistent read below answers now, checked against the same history (a
	// newcomer's holders were refused "Consul unreachable" for seconds after a 3 s restart of
	// Consul that was answering again). It fails as the watch did while Consul is down.

	s, err := Read(ctx, w.client, key)
	s.Mode = k.mode
	if err != nil {
		return s, &TokenError{Key: key, Token: token, Session: session, State: s, Err: lease.ErrUnavailable, Cause: err}
	}
	s.Highest = hist.highest
	if reason := hist.regressed(s); reason != "" {
		return s, &RegressionError{Key: key, Reason: reason, Highest: hist.highest, CreateIndex: hist.createIndex, Seen: s, At: time.Now()}
	}
	return s, s.Check(token, session)
}
