package consul_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/lease/consul"
	"github.com/fenceproxy/fenceproxy/internal/lease/leasetest"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

func TestCampaign(t *testing.T) {
	t.Parallel()
	c := testenv.StartConsul(t)
	client := c.Client(t)

	t.Run("lock-delay 0 reaches Consul", func(t *testing.T) {
		t.Parallel()
		s := newSession(t, client, consul.WithTTL(10*time.Second), consul.WithLockDelay(0))
		info, _, err := client.Session().Info(s.ID(), nil)
		if err != nil || info == nil {
			t.Fatalf("session info: %v, %v", info, err)
		}
		if info.LockDelay != 0 || info.TTL != "10s" || info.Behavior != api.SessionBehaviorRelease {
			t.Errorf("session = lock-delay %v, TTL %s, behavior %s; want 0, 10s, release", info.LockDelay, info.TTL, info.Behavior)
		}
	})

	t.Run("second contender wins when the first session is destroyed", func(t *testing.T) {
		t.Parallel()
		const key = "locks/contenders"
		s1 := newSession(t, client)
		s2 := newSession(t, client)
		l1 := acquire(t, s1, key)

		got := make(chan *consul.Lock, 1)
		errs := make(chan error, 1)
		go func() {
			l, err := consul.Acquire(leasetest.Ctx(t), s2, key)
			if err != nil {
				errs <- err
				return
			}
			got <- l
		}()
		select {
		case l := <-got:
			t.Fatalf("second contender acquired a held lock (token %d)", l.Token())
		case err := <-errs:
			t.Fatal(err)
		case <-time.After(500 * time.Millisecond):
		}

		start := time.Now()
		if err := s1.Close(leasetest.Ctx(t)); err != nil {
			t.Fatal(err)
		}
		var l2 *consul.Lock
		select {
		case l2 = <-got:
		case err := <-errs:
			t.Fatal(err)
		case <-time.After(leasetest.WaitTimeout):
			t.Fatal("second contender did not acquire the released lock")
		}
		t.Logf("session destroyed -> new leader in %v", time.Since(start).Round(time.Millisecond))
		if l2.Token() != l1.Token()+1 {
			t.Errorf("tokens %d then %d, want consecutive", l1.Token(), l2.Token())
		}
		leasetest.WaitClosed(t, "first lock", l1.Done(), leasetest.WaitTimeout)
		if !errors.Is(l1.Err(), lease.ErrLockLost) {
			t.Errorf("first lock: %v, want lease.ErrLockLost", l1.Err())
		}
		if p := leasetest.ReadKey(t, client, key); p.Session != s2.ID() || p.LockIndex != uint64(l2.Token()) || p.Flags != api.LockFlagValue {
			t.Errorf("key = %+v", p)
		}
	})

	t.Run("lock lost when the key changes", func(t *testing.T) {
		t.Parallel()
		tests := []struct {
			name   string
			change func(key string, s *consul.Session) error
		}{
			{"deleted", func(key string, _ *consul.Session) error {
				_, err := client.KV().Delete(key, nil)
				return err
			}},
			{"plain PUT", func(key string, _ *consul.Session) error {
				_, err := client.KV().Put(&api.KVPair{Key: key, Value: []byte("x")}, nil)
				return err
			}},
			{"released by someone else", func(key string, s *consul.Session) error {
				_, _, err := client.KV().Release(&api.KVPair{Key: key, Session: s.ID()}, nil)
				return err
			}},
			{"session destroyed by someone else", func(_ string, s *consul.Session) error {
				_, err := client.Session().Destroy(s.ID(), nil)
				return err
			}},
		}
		for i, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				t.Parallel()
				key := "locks/lost-" + strconv.Itoa(i)
				s := newSession(t, client)
				l := acquire(t, s, key)
				if err := tt.change(key, s); err != nil {
					t.Fatal(err)
				}
				leasetest.WaitClosed(t, "lock", l.Done(), leasetest.WaitTimeout)
				if !errors.Is(l.Err(), lease.ErrLockLost) {
					t.Errorf("Err = %v, want lease.ErrLockLost", l.Err())
				}
			})
		}
	})

	t.Run("release keeps the LockIndex; the next holder gets +1", func(t *testing.T) {
		t.Parallel()
		const key = "locks/release"
		s1 := newSession(t, client)
		l1 := acquire(t, s1, key)
		if err := l1.Release(leasetest.Ctx(t)); err != nil {
			t.Fatal(err)
		}
		leasetest.WaitClosed(t, "released lock", l1.Done(), time.Second)
		if !errors.Is(l1.Err(), lease.ErrReleased) {
			t.Errorf("Err after Release = %v", l1.Err())
		}
		if p := leasetest.ReadKey(t, client, key); p.Session != "" || p.LockIndex != uint64(l1.Token()) {
			t.Errorf("after release: %+v", p)
		}
		l2 := acquire(t, newSession(t, client), key)
		if l2.Token() != l1.Token()+1 {
			t.Errorf("tokens %d then %d", l1.Token(), l2.Token())
		}
	})

	t.Run("lock-delay is honoured", func(t *testing.T) {
		t.Parallel()
		const key = "locks/delay"
		s1 := newSession(t, client, consul.WithLockDelay(2*time.Second))
		acquire(t, s1, key)
		start := time.Now()
		if _, err := client.Session().Destroy(s1.ID(), nil); err != nil {
			t.Fatal(err)
		}
		acquire(t, newSession(t, client), key)
		waited := time.Since(start)
		t.Logf("acquired %v after the holder's session was destroyed (lock-delay 2s)", waited.Round(time.Millisecond))
		if waited < 1500*time.Millisecond {
			t.Errorf("acquired after %v, before the 2 s lock-delay", waited)
		}
	})

	t.Run("Acquire returns when ctx ends", func(t *testing.T) {
		t.Parallel()
		const key = "locks/ctx"
		acquire(t, newSession(t, client), key)
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		start := time.Now()
		_, err := consul.Acquire(ctx, newSession(t, client), key)
		if !errors.Is(err, context.DeadlineExceeded) || time.Since(start) > 5*time.Second {
			t.Errorf("Acquire = %v after %v, want DeadlineExceeded after about 300ms", err, time.Since(start))
		}
	})

	t.Run("Acquire returns when the session ends", func(t *testing.T) {
		t.Parallel()
		const key = "locks/session-ends"
		acquire(t, newSession(t, client), key)
		s := newSession(t, client, consul.WithTTL(time.Second))
		errs := make(chan error, 1)
		go func() {
			_, err := consul.Acquire(leasetest.Ctx(t), s, key)
			errs <- err
		}()
		time.Sleep(200 * time.Millisecond)
		if _, err := client.Session().Destroy(s.ID(), nil); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-errs:
			if !errors.Is(err, lease.ErrSessionExpired) {
				t.Errorf("Acquire = %v, want lease.ErrSessionExpired", err)
			}
		case <-time.After(leasetest.WaitTimeout):
			t.Fatal("Acquire still waiting after its session ended")
		}
	})

	t.Run("session invalidated by Consul", func(t *testing.T) {
		t.Parallel()
		s := newSession(t, client, consul.WithTTL(time.Second))
		if _, err := client.Session().Destroy(s.ID(), nil); err != nil {
			t.Fatal(err)
		}
		leasetest.WaitClosed(t, "session", s.Done(), 5*time.Second)
		if !errors.Is(s.Err(), lease.ErrSessionExpired) {
			t.Errorf("Err = %v, want lease.ErrSessionExpired", s.Err())
		}
	})

	t.Run("session survives many renewals", func(t *testing.T) {
		t.Parallel()
		s := newSession(t, client, consul.WithTTL(3*time.Second)) // renewed every 1.5 s
		select {
		case <-s.Done():
			t.Fatalf("session ended: %v", s.Err())
		case <-time.After(7 * time.Second): // Consul would have invalidated it after 6 s
		}
		if info, _, err := client.Session().Info(s.ID(), nil); err != nil || info == nil {
			t.Errorf("session gone after 7 s of renewals (TTL 3 s): %v", err)
		}
	})

	t.Run("invalid options", func(t *testing.T) {
		t.Parallel()
		for _, opt := range []consul.SessionOption{consul.WithTTL(0), consul.WithLockDelay(-time.Second), consul.WithLockDelay(time.Hour)} {
			if s, err := consul.NewSession(leasetest.Ctx(t), client, opt); err == nil {
				_ = s.Close(leasetest.Ctx(t))
				t.Error("NewSession accepted an invalid option")
			}
		}
	})
}

// TestCampaignFrozenHolder freezes a lock holder (a separate process, SIGSTOP) with the
// production settings, TTL 10 s and lock-delay 0, and measures how long a contender
// waits: Consul's own bound is 2 x TTL after the last renewal. When the holder thaws it
// must learn at once that its lock is gone.
func TestCampaignFrozenHolder(t *testing.T) {
	t.Parallel()
	c := testenv.StartConsul(t)
	client := c.Client(t)
	const key = "locks/frozen"

	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	holder := exec.Command(os.Args[0], "-test.run=^$")
	holder.Env = append(os.Environ(), "LEASE_TEST_HOLDER=1", "LEASE_TEST_CONSUL="+c.Addr, "LEASE_TEST_KEY="+key)
	holder.Stdout, holder.Stderr = w, os.Stderr
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	w.Close()
	t.Cleanup(func() {
		_ = holder.Process.Kill()
		_ = holder.Wait()
	})
	lines := leasetest.LineReader(t, r)
	var line string
	select {
	case line = <-lines:
	case <-time.After(leasetest.WaitTimeout):
		t.Fatal("holder did not report its token")
	}
	var token int64
	var holderSession string
	if f := strings.Fields(line); len(f) == 3 && f[0] == "token" {
		token, _ = strconv.ParseInt(f[1], 10, 64)
		holderSession = f[2]
	} else {
		t.Fatalf("holder said %q", line)
	}

	contender := newSession(t, client, consul.WithTTL(10*time.Second), consul.WithLockDelay(0))
	frozen := time.Now()
	if err := holder.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	l, err := consul.Acquire(ctx, contender, key)
	if err != nil {
		t.Fatalf("contender: %v", err)
	}
	failover := time.Since(frozen)
	t.Logf("holder frozen -> new leader after %v (TTL 10s, lock-delay 0)", failover.Round(10*time.Millisecond))
	if l.Token() != token+1 {
		t.Errorf("tokens %d then %d, want consecutive", token, l.Token())
	}
	if failover > 21*time.Second {
		t.Errorf("failover took %v, more than 2 x TTL", failover)
	}
	if info, _, err := client.Session().Info(holderSession, nil); err != nil || info != nil {
		t.Errorf("frozen holder's session still exists: %+v, %v", info, err)
	}

	thawed := time.Now()
	if err := holder.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	select {
	case line = <-lines:
		t.Logf("thawed holder learned %v later: %s", time.Since(thawed).Round(time.Millisecond), line)
		if !strings.HasPrefix(line, "lost ") {
			t.Errorf("holder said %q, want lost", line)
		}
	case <-time.After(leasetest.WaitTimeout):
		t.Error("thawed holder did not notice it lost the lock")
	}
}
