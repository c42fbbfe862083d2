// Package leasetest holds what the tests of every lock store share: a holder in a process
// of its own (that a test can freeze), contention checks, and waits.
package leasetest

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/lease/consul"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// WaitTimeout bounds every wait for something a store does at once (not TTL expiry).
const WaitTimeout = 15 * time.Second

// pollEvery is how often Eventually asks again.
const pollEvery = 20 * time.Millisecond

// StartHolder starts this test binary as a holder process (TestMain's roles) with env
// added, and returns it, its stdin, and next: the next line of its stdout that starts with
// prefix (lines before it are logged).
func StartHolder(t *testing.T, env ...string) (*exec.Cmd, io.WriteCloser, func(prefix string) string) {
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
	lines := LineReader(t, r)
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
			case <-time.After(WaitTimeout):
				t.Fatalf("holder did not say %q", prefix)
			}
		}
	}
	return holder, stdin, next
}

// LineReader hands out the lines of a helper's stdout.
func LineReader(t *testing.T, f *os.File) <-chan string {
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

// WaitClosed waits for ch to close.
func WaitClosed(t *testing.T, what string, ch <-chan struct{}, timeout time.Duration) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(timeout):
		t.Fatalf("%s: not done within %v", what, timeout)
	}
}

// Eventually is the one way these tests poll for a condition (as in internal/proxy's tests;
// recorder.waitFor waits for a reported state instead): it calls cond until cond returns
// nil, every pollEvery, and fails the test once within has passed, with what and cond's
// last error (what was still wrong).
func Eventually(t testing.TB, within time.Duration, what string, cond func() error) {
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

// Contend runs contenders goroutines that each take resource's lease rounds times from
// their own store (newStore(name)), and checks that there is never more than one holder
// and that the tokens, in the order of acquisition, grow.
func Contend(t *testing.T, newStore func(name string) lease.Store, resource string, contenders, rounds int) {
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

// RunStoreHolder is the body of a frozen-holder process: it takes resource's lease from s,
// prints "token N", then "lost ERROR" when the lease is lost.
func RunStoreHolder(s lease.Store, resource string) int {
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

// Campaign takes resource's lease from s within WaitTimeout, and releases it when the test
// ends.
func Campaign(t *testing.T, s lease.Store, resource string) lease.Lease {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), WaitTimeout)
	defer cancel()
	l, err := s.Campaign(ctx, resource)
	if err != nil {
		t.Fatalf("Campaign(%q) on %s: %v", resource, s.Name(), err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = l.Release(ctx)
	})
	return l
}

// LeaseDB starts a PostgreSQL server with the fence schema for the PostgreSQL lease, and
// returns it and its admin URL.
func LeaseDB(t *testing.T) (*testenv.Postgres, string) {
	t.Helper()
	pg := testenv.StartPostgres(t)
	url := pg.AdminURL()
	testenv.Migrate(t, url)
	return pg, url
}

// Main runs a test binary's tests, or, when one of holders' environment variables is set,
// that holder instead (the process StartHolder starts), and exits with its status.
func Main(m *testing.M, holders map[string]func() int) {
	for env, run := range holders {
		if os.Getenv(env) != "" {
			os.Exit(run())
		}
	}
	os.Exit(m.Run())
}

// Recorder collects the states a Watcher reports.
type Recorder struct {
	ch chan consul.State
	mu sync.Mutex
	// seen keeps everything, for failure messages.
	seen []consul.State
}

func Ctx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// Watch runs a Watcher on keys until the test ends.
func Watch(t *testing.T, client *api.Client, cfg consul.WatcherConfig) (*consul.Watcher, *Recorder) {
	t.Helper()
	rec := &Recorder{ch: make(chan consul.State, 1000)}
	user := cfg.OnChange
	cfg.OnChange = func(s consul.State) {
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
	w, err := consul.NewWatcher(client, cfg)
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

// WaitFor returns the first reported state that satisfies pred.
func (r *Recorder) WaitFor(t *testing.T, what string, pred func(consul.State) bool) consul.State {
	t.Helper()
	deadline := time.NewTimer(WaitTimeout)
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
				fmt.Fprintf(&b, "\n  %s", Describe(s))
			}
			t.Fatalf("no state %s within %v; states seen:%s", what, WaitTimeout, b.String())
		}
	}
}

func Describe(s consul.State) string {
	return fmt.Sprintf("known=%t exists=%t held=%t lockIndex=%d session=%q create=%d highest=%d regression=%v err=%v",
		s.Known, s.Exists, s.Held, s.LockIndex, s.Session, s.CreateIndex, s.Highest, s.Regression, s.Err)
}

// ReadKey is a consistent read of key.
func ReadKey(t *testing.T, client *api.Client, key string) *api.KVPair {
	t.Helper()
	p, _, err := client.KV().Get(key, &api.QueryOptions{RequireConsistent: true})
	if err != nil {
		t.Fatalf("get %q: %v", key, err)
	}
	return p
}
