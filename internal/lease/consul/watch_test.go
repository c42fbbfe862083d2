package consul_test

import (
	"bytes"
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/lease/consul"
	"github.com/fenceproxy/fenceproxy/internal/lease/leasetest"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

func TestWatcherFollowsAcquisitions(t *testing.T) {
	t.Parallel()
	c := testenv.StartConsul(t)
	client := c.Client(t)
	const key = "locks/follow"
	_, rec := leasetest.Watch(t, client, consul.WatcherConfig{Keys: []string{key}})

	st := rec.WaitFor(t, "synced, key missing", func(s consul.State) bool { return s.Known })
	if st.Exists || st.Held {
		t.Fatalf("first state %s: want a missing key", leasetest.Describe(st))
	}
	s := newSession(t, client)

	l1 := acquire(t, s, key)
	if l1.Token() != 1 {
		t.Errorf("first token = %d, want 1", l1.Token())
	}
	st = rec.WaitFor(t, "held with LockIndex 1", func(s consul.State) bool { return s.Held })
	if st.LockIndex != 1 || st.Session != s.ID() || st.Highest != 1 || st.Regression != nil {
		t.Errorf("after acquire: %s", leasetest.Describe(st))
	}
	if tok, err := st.Token(); err != nil || tok != 1 {
		t.Errorf("Token() = %d, %v; want 1", tok, err)
	}

	if err := l1.Release(leasetest.Ctx(t)); err != nil {
		t.Fatal(err)
	}
	st = rec.WaitFor(t, "released", func(s consul.State) bool { return !s.Held })
	if st.LockIndex != 1 || st.Session != "" {
		t.Errorf("after release: %s", leasetest.Describe(st))
	}
	if _, err := st.Token(); !errors.Is(err, lease.ErrNotHeld) {
		t.Errorf("Token() of a free lock: %v, want lease.ErrNotHeld", err)
	}

	// The same session acquiring again still counts as a new acquisition.
	l2 := acquire(t, s, key)
	if l2.Token() != 2 {
		t.Errorf("re-acquired token = %d, want 2", l2.Token())
	}
	st = rec.WaitFor(t, "held with LockIndex 2", func(s consul.State) bool { return s.Held })
	if st.LockIndex != 2 || st.Highest != 2 || st.Regression != nil {
		t.Errorf("after re-acquire: %s", leasetest.Describe(st))
	}
}

func TestValidate(t *testing.T) {
	t.Parallel()
	c := testenv.StartConsul(t)
	client := c.Client(t)
	const (
		heldKey = "locks/validate-held" // held, LockIndex 2
		freeKey = "locks/validate-free" // released, LockIndex 1
		noKey   = "locks/validate-missing"
	)
	w, _ := leasetest.Watch(t, client, consul.WatcherConfig{Keys: []string{heldKey, freeKey, noKey}})
	holder := newSession(t, client)
	other := newSession(t, client)
	l := acquire(t, holder, heldKey)
	if err := l.Release(leasetest.Ctx(t)); err != nil {
		t.Fatal(err)
	}
	acquire(t, holder, heldKey)
	if err := acquire(t, holder, freeKey).Release(leasetest.Ctx(t)); err != nil {
		t.Fatal(err)
	}
	// Let the watcher see all of it, so that its Validate has the history.
	waitState(t, w, heldKey, func(s consul.State) bool { return s.Known && s.LockIndex == 2 && s.Held })
	waitState(t, w, freeKey, func(s consul.State) bool { return s.Known && s.LockIndex == 1 && !s.Held })
	waitState(t, w, noKey, func(s consul.State) bool { return s.Known })

	down, err := api.NewClient(&api.Config{Address: "127.0.0.1:" + itoa(testenv.FreePort(t))})
	if err != nil {
		t.Fatal(err)
	}

	tests := []struct {
		name    string
		client  *api.Client
		key     string
		token   int64
		session string
		want    error // nil: admitted
	}{
		{"current token of a held lock", client, heldKey, 2, "", nil},
		{"current token with the holder session", client, heldKey, 2, holder.ID(), nil},
		{"lower token", client, heldKey, 1, "", lease.ErrStale},
		{"lower token with the holder session", client, heldKey, 1, holder.ID(), lease.ErrStale},
		{"higher token", client, heldKey, 3, "", lease.ErrNotIssued},
		{"session not the holder", client, heldKey, 2, other.ID(), lease.ErrSessionMismatch},
		{"free lock, its last token", client, freeKey, 1, "", lease.ErrNotHeld},
		{"free lock, higher token", client, freeKey, 2, "", lease.ErrNotIssued},
		{"missing key", client, noKey, 1, "", lease.ErrNotHeld},
		{"missing key, token 0", client, noKey, 0, "", lease.ErrNotHeld},
		{"negative token", client, heldKey, -1, "", lease.ErrStale},
		{"consul unreachable", down, heldKey, 2, "", lease.ErrUnavailable},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			st, err := consul.Validate(ctx, tt.client, tt.key, tt.token, tt.session)
			check := func(fn string, err error) {
				t.Helper()
				if tt.want == nil {
					if err != nil {
						t.Errorf("%s: %v, want admitted", fn, err)
					}
					return
				}
				if !errors.Is(err, tt.want) {
					t.Errorf("%s: %v, want %v", fn, err, tt.want)
				}
				var te *consul.TokenError
				if !errors.As(err, &te) || te.Key != tt.key || te.Token != tt.token {
					t.Errorf("%s: %#v, want a *TokenError for %s/%d", fn, err, tt.key, tt.token)
				}
			}
			check("Validate", err)
			if tt.want != lease.ErrUnavailable && !st.Known {
				t.Errorf("Validate state not known: %s", leasetest.Describe(st))
			}
			if tt.client == client {
				_, err = w.Validate(ctx, tt.key, tt.token, tt.session)
				check("Watcher.Validate", err)
			}
		})
	}

	t.Run("unwatched key", func(t *testing.T) {
		if _, err := w.Validate(leasetest.Ctx(t), "locks/other", 1, ""); err == nil {
			t.Error("Watcher.Validate of an unwatched key: nil error")
		}
	})
}

// TestWatcherRegression covers the ways a LockIndex goes backwards that a client can
// cause; TestWatcherSnapshotRestore covers the operator's.
func TestWatcherRegression(t *testing.T) {
	t.Parallel()
	c := testenv.StartConsul(t)
	client := c.Client(t)

	tests := []struct {
		name    string
		regress func(t *testing.T, key string, holder *consul.Session)
		want    string // in the reason
	}{
		{
			name: "key deleted and acquired again",
			regress: func(t *testing.T, key string, holder *consul.Session) {
				if _, err := client.KV().Delete(key, nil); err != nil {
					t.Fatal(err)
				}
				acquire(t, newSession(t, client), key) // LockIndex 1 again
			},
			want: "deleted and created again",
		},
		{
			name: "plain PUT on the held key",
			regress: func(t *testing.T, key string, holder *consul.Session) {
				// No ?acquire: Consul resets LockIndex to 0 and keeps the holder.
				if _, err := client.KV().Put(&api.KVPair{Key: key, Value: []byte("oops")}, nil); err != nil {
					t.Fatal(err)
				}
			},
			want: "went from 2 to 0",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			key := "locks/regress-" + itoa(len(tt.name))
			w, rec := leasetest.Watch(t, client, consul.WatcherConfig{Keys: []string{key}})
			rec.WaitFor(t, "synced", func(s consul.State) bool { return s.Known })
			holder := newSession(t, client)
			if err := acquire(t, holder, key).Release(leasetest.Ctx(t)); err != nil {
				t.Fatal(err)
			}
			acquire(t, holder, key)
			rec.WaitFor(t, "LockIndex 2", func(s consul.State) bool { return s.Held && s.LockIndex == 2 })

			tt.regress(t, key, holder)
			st := rec.WaitFor(t, "regression", func(s consul.State) bool { return s.Regression != nil })
			re := st.Regression
			if !errors.Is(re, lease.ErrRegression) || !errors.Is(re, lease.ErrUnavailable) {
				t.Errorf("regression %v: want lease.ErrRegression and lease.ErrUnavailable", re)
			}
			if !bytes.Contains([]byte(re.Reason), []byte(tt.want)) || re.Highest != 2 || re.Key != key {
				t.Errorf("regression = %+v, want reason with %q, highest 2", re, tt.want)
			}
			t.Logf("reported: %v", re)
			if _, err := st.Token(); !errors.Is(err, lease.ErrRegression) {
				t.Errorf("Token() after regression: %v", err)
			}
			if _, err := w.Validate(leasetest.Ctx(t), key, int64(st.LockIndex), ""); !errors.Is(err, lease.ErrRegression) {
				t.Errorf("Watcher.Validate after regression: %v", err)
			}

			// Sticky: the next acquisitions are still under the regression.
			other := newSession(t, client)
			if _, err := client.Session().Destroy(st.Session, nil); err != nil {
				t.Fatal(err)
			}
			l := acquire(t, other, key)
			st = rec.WaitFor(t, "new holder", func(s consul.State) bool { return s.Session == other.ID() })
			if st.Regression != re {
				t.Errorf("regression not sticky: %s", leasetest.Describe(st))
			}

			// The operator's way out.
			if err := w.Reset(key); err != nil {
				t.Fatal(err)
			}
			st = rec.WaitFor(t, "reset", func(s consul.State) bool { return s.Regression == nil })
			if st.Highest != uint64(l.Token()) {
				t.Errorf("after Reset: %s, want highest %d", leasetest.Describe(st), l.Token())
			}
			if _, err := w.Validate(leasetest.Ctx(t), key, l.Token(), other.ID()); err != nil {
				t.Errorf("Validate after Reset: %v", err)
			}
		})
	}

	t.Run("re-created key that never issued a token", func(t *testing.T) {
		t.Parallel()
		const key = "locks/never-locked"
		if _, err := client.KV().Put(&api.KVPair{Key: key, Value: []byte("a")}, nil); err != nil {
			t.Fatal(err)
		}
		_, rec := leasetest.Watch(t, client, consul.WatcherConfig{Keys: []string{key}})
		rec.WaitFor(t, "synced", func(s consul.State) bool { return s.Known && s.Exists })
		if _, err := client.KV().Delete(key, nil); err != nil {
			t.Fatal(err)
		}
		acquire(t, newSession(t, client), key)
		st := rec.WaitFor(t, "held", func(s consul.State) bool { return s.Held })
		if st.Regression != nil || st.LockIndex != 1 {
			t.Errorf("want LockIndex 1 and no regression: %s", leasetest.Describe(st))
		}
	})
}

func TestWatcherSnapshotRestore(t *testing.T) {
	t.Parallel()
	c := testenv.StartConsul(t)
	client := c.Client(t)
	const key = "locks/snapshot"
	core, logs := observer.New(zap.WarnLevel)
	_, rec := leasetest.Watch(t, client, consul.WatcherConfig{Keys: []string{key}, Logger: zap.New(core)})
	rec.WaitFor(t, "synced", func(s consul.State) bool { return s.Known })

	s := newSession(t, client)
	l := acquire(t, s, key)
	rec.WaitFor(t, "LockIndex 1", func(s consul.State) bool { return s.LockIndex == 1 })
	data := saveSnapshot(t, client)
	for range 2 {
		if err := l.Release(leasetest.Ctx(t)); err != nil {
			t.Fatal(err)
		}
		l = acquire(t, s, key)
	}
	rec.WaitFor(t, "LockIndex 3", func(s consul.State) bool { return s.LockIndex == 3 })

	if err := client.Snapshot().Restore(nil, bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	st := rec.WaitFor(t, "regression", func(s consul.State) bool { return s.Regression != nil })
	if st.LockIndex != 1 || st.Regression.Highest != 3 {
		t.Errorf("after restore: %s", leasetest.Describe(st))
	}
	t.Logf("reported: %v", st.Regression)
	// A monitor query that was waiting during the restore wakes at once; one that
	// started just after it, on the old (now future) index, wakes after its wait time.
	select {
	case <-l.Done():
		t.Logf("lock 3 lost: %v", l.Err())
	case <-time.After(20 * time.Second):
		t.Error("the lock of LockIndex 3 did not notice the restore")
	}
	if logs.FilterMessage("consul index went backwards; watch restarts from 0").Len() == 0 {
		t.Error("the watch did not notice the index going backwards")
	}
}

// TestWatcherConsulRestart stops Consul while a watcher and a stream of validations
// run: the state must become unknown (and every validation refused) until Consul is back
// and the watch has read the key again.
func TestWatcherConsulRestart(t *testing.T) {
	t.Parallel()
	c := testenv.StartConsul(t)
	client := c.Client(t)
	const key = "locks/restart"
	w, rec := leasetest.Watch(t, client, consul.WatcherConfig{Keys: []string{key}, RetryMax: 200 * time.Millisecond})
	s := newSession(t, client, consul.WithTTL(20*time.Second))
	l := acquire(t, s, key)
	rec.WaitFor(t, "held", func(s consul.State) bool { return s.Held })

	// Load: validations of the current token, back to back, through the whole outage.
	var admitted, unavailable, other atomic.Int64
	var lastOther atomic.Value
	ctx, stopLoad := context.WithCancel(context.Background())
	loadDone := make(chan struct{})
	go func() {
		defer close(loadDone)
		for ctx.Err() == nil {
			vctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			_, err := w.Validate(vctx, key, l.Token(), s.ID())
			cancel()
			switch {
			case err == nil:
				admitted.Add(1)
			case errors.Is(err, lease.ErrUnavailable):
				unavailable.Add(1)
				time.Sleep(time.Millisecond) // refusals are instant: do not starve Consul's restart
			case ctx.Err() != nil:
			default:
				other.Add(1)
				lastOther.Store(err)
			}
		}
	}()
	time.Sleep(200 * time.Millisecond)

	stopped := time.Now()
	c.Stop(t)
	st := rec.WaitFor(t, "unknown", func(s consul.State) bool { return !s.Known })
	t.Logf("state unknown %v after Consul stopped: %v", time.Since(stopped).Round(time.Millisecond), st.Err)
	if _, err := st.Token(); !errors.Is(err, lease.ErrUnavailable) {
		t.Errorf("Token() while Consul is down: %v", err)
	}
	if _, err := w.Validate(leasetest.Ctx(t), key, l.Token(), ""); !errors.Is(err, lease.ErrUnavailable) {
		t.Errorf("Validate while Consul is down: %v", err)
	}
	time.Sleep(500 * time.Millisecond)

	restarted := time.Now()
	c.Start(t)
	st = rec.WaitFor(t, "known again", func(s consul.State) bool { return s.Known })
	t.Logf("resynchronised %v after Start returned", time.Since(restarted).Round(time.Millisecond))
	if !st.Held || st.LockIndex != uint64(l.Token()) || st.Session != s.ID() || st.Regression != nil {
		t.Errorf("after restart: %s", leasetest.Describe(st))
	}
	if _, err := w.Validate(leasetest.Ctx(t), key, l.Token(), s.ID()); err != nil {
		t.Errorf("Validate after restart: %v", err)
	}
	time.Sleep(200 * time.Millisecond)
	stopLoad()
	<-loadDone
	t.Logf("validations under load: %d admitted, %d unavailable, %d other", admitted.Load(), unavailable.Load(), other.Load())
	if other.Load() != 0 {
		t.Errorf("%d validations failed with other errors, e.g. %v", other.Load(), lastOther.Load())
	}
	if admitted.Load() == 0 || unavailable.Load() == 0 {
		t.Error("want both admitted and refused validations around the outage")
	}
	select {
	case <-l.Done():
		t.Errorf("lock lost across a short Consul restart: %v", l.Err())
	default:
	}
}

// TestWatcherConsulHung freezes Consul (SIGSTOP): its sockets stay open and nothing
// answers, so only the watch's own timeout can notice.
func TestWatcherConsulHung(t *testing.T) {
	t.Parallel()
	c := testenv.StartConsul(t)
	client := c.Client(t)
	const key = "locks/hung"
	_, rec := leasetest.Watch(t, client, consul.WatcherConfig{Keys: []string{key}, WaitTime: time.Second})
	acquire(t, newSession(t, client, consul.WithTTL(30*time.Second)), key)
	rec.WaitFor(t, "held", func(s consul.State) bool { return s.Held })

	paused := time.Now()
	c.Pause(t)
	st := rec.WaitFor(t, "unknown", func(s consul.State) bool { return !s.Known })
	t.Logf("hung Consul noticed after %v (WaitTime 1s): %v", time.Since(paused).Round(time.Millisecond), st.Err)
	if time.Since(paused) > 5*time.Second {
		t.Errorf("took %v, want about WaitTime + 1/16 + 1 s", time.Since(paused))
	}
	c.Resume(t)
	st = rec.WaitFor(t, "known again", func(s consul.State) bool { return s.Known })
	if !st.Held || st.Regression != nil {
		t.Errorf("after resume: %s", leasetest.Describe(st))
	}
}

// TestWatcherValidateReadsWhileTheWatchWaits: a watch that lost Consul waits out its backoff
// before it reads again; Validate reads at once, so that a holder is admitted as soon as
// Consul answers (a newcomer's two replicas were refused "Consul unreachable" after a 3 s
// restart of Consul that already answered them, and both exited).
func TestWatcherValidateReadsWhileTheWatchWaits(t *testing.T) {
	t.Parallel()
	c := testenv.StartConsul(t)
	client := c.Client(t)
	const key = "locks/waits"
	w, rec := leasetest.Watch(t, client, consul.WatcherConfig{Keys: []string{key}, WaitTime: time.Second, RetryMin: time.Minute, RetryMax: time.Minute})
	l := acquire(t, newSession(t, client, consul.WithTTL(30*time.Second)), key)
	rec.WaitFor(t, "held", func(s consul.State) bool { return s.Held })
	c.Pause(t)
	rec.WaitFor(t, "unknown", func(s consul.State) bool { return !s.Known })
	c.Resume(t) // the watch retries in a minute
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := w.Validate(ctx, key, l.Token(), l.Session().ID()); err != nil {
		t.Fatalf("Validate with Consul answering, the watch waiting: %v", err)
	}
}
