package consul_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/fenceproxy/fenceproxy/internal/lease/consul"
	"github.com/fenceproxy/fenceproxy/internal/lease/leasetest"
)

// TestMain doubles as the holder process of the freeze tests (leasetest.StartHolder).
func TestMain(m *testing.M) {
	leasetest.Main(m, map[string]func() int{
		"LEASE_TEST_HOLDER": runHolder,
	})
}

// runHolder acquires $LEASE_TEST_KEY on $LEASE_TEST_CONSUL with a 10 s TTL and lock-delay
// 0, prints "token N SESSION", then "lost ERROR" when the lock is lost.
func runHolder() int {
	client, err := consul.NewClient(consul.Config{Addr: os.Getenv("LEASE_TEST_CONSUL")})
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	ctx := context.Background()
	s, err := consul.NewSession(ctx, client, consul.WithTTL(10*time.Second), consul.WithLockDelay(0))
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	l, err := consul.Acquire(ctx, s, os.Getenv("LEASE_TEST_KEY"))
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	fmt.Println("token", l.Token(), s.ID())
	<-l.Done()
	fmt.Println("lost", l.Err())
	return 0
}

// newSession makes a session that the test's cleanup closes.
func newSession(t *testing.T, client *api.Client, opts ...consul.SessionOption) *consul.Session {
	t.Helper()
	s, err := consul.NewSession(context.Background(), client, opts...)
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

func acquire(t *testing.T, s *consul.Session, key string) *consul.Lock {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), leasetest.WaitTimeout)
	defer cancel()
	l, err := consul.Acquire(ctx, s, key)
	if err != nil {
		t.Fatalf("Acquire(%q): %v", key, err)
	}
	return l
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

// waitState polls the watcher's state of key until pred holds.
func waitState(t *testing.T, w *consul.Watcher, key string, pred func(consul.State) bool) consul.State {
	t.Helper()
	var s consul.State
	leasetest.Eventually(t, leasetest.WaitTimeout, "the state of "+key+" as expected", func() error {
		if s, _ = w.State(key); !pred(s) {
			return errors.New(leasetest.Describe(s))
		}
		return nil
	})
	return s
}
