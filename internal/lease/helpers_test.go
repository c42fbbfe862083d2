package lease_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/fenceproxy/fenceproxy/internal/lease"
)

// waitTimeout bounds every wait for something Consul does at once (not TTL expiry).
const waitTimeout = 15 * time.Second

// TestMain doubles as the holder process of the freeze tests: a lock holder (Consul, the
// PostgreSQL lease, etcd, or ZooKeeper) in a process of its own, that the test can SIGSTOP like a real stalled
// leader.
func TestMain(m *testing.M) {
	if os.Getenv("LEASE_TEST_HOLDER") != "" {
		os.Exit(runHolder())
	}
	if os.Getenv("LEASE_TEST_PG_HOLDER") != "" {
		os.Exit(runPGHolder())
	}
	if os.Getenv("LEASE_TEST_ETCD_HOLDER") != "" {
		os.Exit(runEtcdHolder())
	}
	if os.Getenv("LEASE_TEST_ZK_HOLDER") != "" {
		os.Exit(runZKHolder())
	}
	os.Exit(m.Run())
}

// runHolder acquires $LEASE_TEST_KEY on $LEASE_TEST_CONSUL with a 10 s TTL and lock-delay
// 0, prints "token N SESSION", then "lost ERROR" when the lock is lost.
func runHolder() int {
	client, err := lease.NewClient(lease.ConsulConfig{Addr: os.Getenv("LEASE_TEST_CONSUL")})
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	ctx := context.Background()
	s, err := lease.NewSession(ctx, client, lease.WithTTL(10*time.Second), lease.WithLockDelay(0))
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	l, err := lease.Acquire(ctx, s, os.Getenv("LEASE_TEST_KEY"))
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	fmt.Println("token", l.Token(), s.ID())
	<-l.Done()
	fmt.Println("lost", l.Err())
	return 0
}

// startHolder starts this test binary as a holder process (TestMain's roles) with env
// added, and returns it, its stdin, and next: the next line of its stdout that starts with
// prefix (lines before it are logged).
func startHolder(t *testing.T, env ...string) (*exec.Cmd, io.WriteCloser, func(prefix string) string) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	holder := exec.Command(os.Args[0], "-test.run=^$")
	holder.Env = append(os.Environ(), env...)
	holder.Stdout, holder.Stderr = w, os.Stderr
	stdin, err := holder.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	w.Close()
	t.Cleanup(func() {
		_ = holder.Process.Signal(syscall.SIGCONT)
		_ = holder.Process.Kill()
		_ = holder.Wait()
	})
	lines := lineReader(t, r)
	next := func(prefix string) string {
		t.Helper()
		for {
			select {
			case line, ok := <-lines:
				if !ok {
					t.Fatalf("holder exited before saying %q", prefix)
				}
				if strings.HasPrefix(line, prefix) {
					return line
				}
				t.Logf("holder: %s", line)
			case <-time.After(waitTimeout):
				t.Fatalf("holder did not say %q", prefix)
			}
		}
	}
	return holder, stdin, next
}

// lineReader hands out the lines of a helper's stdout.
func lineReader(t *testing.T, f *os.File) <-chan string {
	t.Helper()
	ch := make(chan string, 16)
	go func() {
		defer close(ch)
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			ch <- sc.Text()
		}
	}()
	return ch
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// newSession makes a session that the test's cleanup closes.
func newSession(t *testing.T, client *api.Client, opts ...lease.SessionOption) *lease.Session {
	t.Helper()
	s, err := lease.NewSession(context.Background(), client, opts...)
	if err != nil {
		t.Fatalf("NewSession: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = s.Close(ctx)
	})
	return s
}

func acquire(t *testing.T, s *lease.Session, key string) *lease.Lock {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	l, err := lease.Acquire(ctx, s, key)
	if err != nil {
		t.Fatalf("Acquire(%q): %v", key, err)
	}
	return l
}

// recorder collects the states a Watcher reports.
type recorder struct {
	ch chan lease.State
	mu sync.Mutex
	// seen keeps everything, for failure messages.
	seen []lease.State
}

// watch runs a Watcher on keys until the test ends.
func watch(t *testing.T, client *api.Client, cfg lease.WatcherConfig) (*lease.Watcher, *recorder) {
	t.Helper()
	rec := &recorder{ch: make(chan lease.State, 1000)}
	user := cfg.OnChange
	cfg.OnChange = func(s lease.State) {
		if user != nil {
			user(s)
		}
		rec.mu.Lock()
		rec.seen = append(rec.seen, s)
		rec.mu.Unlock()
		rec.ch <- s
	}
	if cfg.RetryMax == 0 {
		cfg.RetryMax = 500 * time.Millisecond
	}
	w, err := lease.NewWatcher(client, cfg)
	if err != nil {
		t.Fatalf("NewWatcher: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return w, rec
}

// waitFor returns the first reported state that satisfies pred.
func (r *recorder) waitFor(t *testing.T, what string, pred func(lease.State) bool) lease.State {
	t.Helper()
	deadline := time.NewTimer(waitTimeout)
	defer deadline.Stop()
	for {
		select {
		case s := <-r.ch:
			if pred(s) {
				return s
			}
		case <-deadline.C:
			r.mu.Lock()
			defer r.mu.Unlock()
			var b strings.Builder
			for _, s := range r.seen {
				fmt.Fprintf(&b, "\n  %s", describe(s))
			}
			t.Fatalf("no state %s within %v; states seen:%s", what, waitTimeout, b.String())
		}
	}
}

func describe(s lease.State) string {
	return fmt.Sprintf("known=%t exists=%t held=%t lockIndex=%d session=%q create=%d highest=%d regression=%v err=%v",
		s.Known, s.Exists, s.Held, s.LockIndex, s.Session, s.CreateIndex, s.Highest, s.Regression, s.Err)
}

// waitClosed waits for ch to close.
func waitClosed(t *testing.T, what string, ch <-chan struct{}, timeout time.Duration) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(timeout):
		t.Fatalf("%s: not done within %v", what, timeout)
	}
}

// readKey is a consistent read of key.
func readKey(t *testing.T, client *api.Client, key string) *api.KVPair {
	t.Helper()
	p, _, err := client.KV().Get(key, &api.QueryOptions{RequireConsistent: true})
	if err != nil {
		t.Fatalf("get %q: %v", key, err)
	}
	return p
}

// saveSnapshot returns a snapshot of Consul's state, for Snapshot().Restore.
func saveSnapshot(t *testing.T, client *api.Client) []byte {
	t.Helper()
	snap, _, err := client.Snapshot().Save(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer snap.Close()
	data, err := io.ReadAll(snap)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

func itoa(i int) string { return strconv.Itoa(i) }

// pollEvery is how often eventually asks again.
const pollEvery = 20 * time.Millisecond

// eventually is the one way these tests poll for a condition (as in internal/proxy's tests;
// recorder.waitFor waits for a reported state instead): it calls cond until cond returns
// nil, every pollEvery, and fails the test once within has passed, with what and cond's
// last error (what was still wrong).
func eventually(t testing.TB, within time.Duration, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s; last: %v", what, within, err)
		}
		time.Sleep(pollEvery)
	}
}

// waitState polls the watcher's state of key until pred holds.
func waitState(t *testing.T, w *lease.Watcher, key string, pred func(lease.State) bool) lease.State {
	t.Helper()
	var s lease.State
	eventually(t, waitTimeout, "the state of "+key+" as expected", func() error {
		if s, _ = w.State(key); !pred(s) {
			return errors.New(describe(s))
		}
		return nil
	})
	return s
}

// contend runs contenders goroutines that each take resource's lease rounds times from
// their own store (newStore(name)), and checks that there is never more than one holder
// and that the tokens, in the order of acquisition, grow.
func contend(t *testing.T, newStore func(name string) lease.Store, resource string, contenders, rounds int) {
	t.Helper()
	var holding atomic.Int32
	var mu sync.Mutex
	var tokens []int64
	var wg sync.WaitGroup
	errs := make(chan error, contenders)
	for i := range contenders {
		wg.Go(func() {
			s := newStore(fmt.Sprintf("c%d", i))
			for range rounds {
				ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
				l, err := s.Campaign(ctx, resource)
				cancel()
				if err != nil {
					errs <- err
					return
				}
				if n := holding.Add(1); n != 1 {
					errs <- fmt.Errorf("%d holders at once (token %d)", n, l.Token())
				}
				mu.Lock()
				tokens = append(tokens, l.Token())
				mu.Unlock()
				time.Sleep(10 * time.Millisecond)
				holding.Add(-1)
				if err := l.Release(context.Background()); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	// Acquisitions were serialised, so the tokens in the order of acquisition grow.
	for i := 1; i < len(tokens); i++ {
		if tokens[i] <= tokens[i-1] {
			t.Errorf("tokens in acquisition order %v: not increasing at %d", tokens, i)
			break
		}
	}
	if len(tokens) != contenders*rounds {
		t.Errorf("%d acquisitions, want %d", len(tokens), contenders*rounds)
	}
}

// runStoreHolder is the body of a frozen-holder process: it takes resource's lease from s,
// prints "token N", then "lost ERROR" when the lease is lost.
func runStoreHolder(s lease.Store, resource string) int {
	l, err := s.Campaign(context.Background(), resource)
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	fmt.Println("token", l.Token())
	<-l.Done()
	fmt.Println("lost", l.Err())
	return 0
}
