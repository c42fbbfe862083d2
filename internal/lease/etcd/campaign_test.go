package etcd_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap/zaptest"

	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/lease/etcd"
	"github.com/fenceproxy/fenceproxy/internal/lease/leasetest"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// createRevision reads key linearizably: its CreateRevision, 0 when it does not exist.

// TestMain doubles as the holder process of the freeze tests (leasetest.StartHolder).
func TestMain(m *testing.M) {
	leasetest.Main(m, map[string]func() int{
		"LEASE_TEST_ETCD_HOLDER": runEtcdHolder,
	})
}

func createRevision(t *testing.T, cli *clientv3.Client, key string) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), leasetest.WaitTimeout)
	defer cancel()
	resp, err := cli.Get(ctx, key)
	if err != nil {
		t.Fatalf("get %s: %v", key, err)
	}
	if len(resp.Kvs) == 0 {
		return 0
	}
	return resp.Kvs[0].CreateRevision
}

func TestEtcdLease(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcd(t)
	cli := e.Client(t)
	store := func(holder string, ttl time.Duration) *etcd.Store {
		return &etcd.Store{Client: cli, TTL: ttl, Holder: holder}
	}

	t.Run("acquire, renew past the TTL, release", func(t *testing.T) {
		t.Parallel()
		l := leasetest.Campaign(t, store("a", time.Second), "renew")
		if l.Store() != lease.StoreEtcd || !strings.HasPrefix(l.Key(), "locks/renew/") || !strings.HasSuffix(l.Key(), "/"+l.Holder()) {
			t.Errorf("lease: store %q key %q holder %q; want etcd, locks/renew/<holder>", l.Store(), l.Key(), l.Holder())
		}
		if got := createRevision(t, cli, l.Key()); got != l.Token() || got <= 0 {
			t.Fatalf("token %d, leader key's CreateRevision %d: want equal", l.Token(), got)
		}
		// Three TTLs: only the session's keepalives keep it.
		select {
		case <-l.Done():
			t.Fatalf("lease lost while kept alive: %v", l.Err())
		case <-time.After(3 * time.Second):
		}
		if got := createRevision(t, cli, l.Key()); got != l.Token() {
			t.Fatalf("after 3 TTLs the leader key's CreateRevision is %d, want %d", got, l.Token())
		}
		if err := l.Release(context.Background()); err != nil {
			t.Fatalf("Release: %v", err)
		}
		if !errors.Is(l.Err(), lease.ErrReleased) {
			t.Errorf("Err after Release = %v, want ErrReleased", l.Err())
		}
		leasetest.WaitClosed(t, "Done after Release", l.Done(), time.Second)
		if got := createRevision(t, cli, l.Key()); got != 0 {
			t.Errorf("leader key still there after Release (CreateRevision %d)", got)
		}
	})

	t.Run("tokens grow across hand-overs and key deletion", func(t *testing.T) {
		t.Parallel()
		var last int64
		for i, holder := range []string{"a", "b", "a", "a", "b"} {
			l := leasetest.Campaign(t, store(holder, 5*time.Second), "handover")
			if l.Token() <= last {
				t.Fatalf("hand-over %d: token %d after %d, want higher", i, l.Token(), last)
			}
			last = l.Token()
			if i == 2 {
				// Someone deletes the leader key by hand: the holder learns it, and the
				// next key's CreateRevision is still higher.
				if _, err := cli.Delete(context.Background(), "locks/handover/", clientv3.WithPrefix()); err != nil {
					t.Fatal(err)
				}
				leasetest.WaitClosed(t, "Done after the key was deleted", l.Done(), leasetest.WaitTimeout)
				if err := l.Err(); !errors.Is(err, lease.ErrLockLost) || !strings.Contains(err.Error(), "deleted") {
					t.Errorf("Err = %v, want ErrLockLost saying the key was deleted", err)
				}
			}
			if err := l.Release(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
	})

	t.Run("a holder whose keepalives stop is taken over with a higher token", func(t *testing.T) {
		t.Parallel()
		own := e.Client(t) // closing it stops the session's keepalives; the server keeps the key until its TTL
		a := leasetest.Campaign(t, &etcd.Store{Client: own, TTL: 2 * time.Second, Holder: "a"}, "expiry")
		own.Close()
		leasetest.WaitClosed(t, "Done after the keepalives stopped", a.Done(), leasetest.WaitTimeout)
		if err := a.Err(); !errors.Is(err, lease.ErrLockLost) {
			t.Errorf("Err = %v, want ErrLockLost", err)
		}
		stopped := time.Now()
		b := leasetest.Campaign(t, store("b", 2*time.Second), "expiry")
		t.Logf("keepalives stopped -> new holder after %v (TTL 2s)", time.Since(stopped).Round(time.Millisecond))
		if b.Token() <= a.Token() {
			t.Errorf("token %d after %d, want higher", b.Token(), a.Token())
		}
		if got := createRevision(t, cli, a.Key()); got != 0 {
			t.Errorf("the expired holder's key is still there")
		}
	})

	t.Run("contenders are never two holders", func(t *testing.T) {
		t.Parallel()
		leasetest.Contend(t, func(name string) lease.Store { return store(name, 5*time.Second) }, "leasetest.Contend", 5, 4)
	})

	t.Run("TTLs etcd cannot grant are refused", func(t *testing.T) {
		t.Parallel()
		for _, ttl := range []time.Duration{1500 * time.Millisecond, 500 * time.Millisecond, 25 * time.Hour} {
			_, err := store("x", ttl).Campaign(context.Background(), "ttl")
			if !errors.Is(err, lease.ErrRefused) {
				t.Errorf("TTL %v: %v, want ErrRefused", ttl, err)
			}
		}
	})

	t.Run("a cancelled campaign leaves no key behind", func(t *testing.T) {
		t.Parallel()
		holder := leasetest.Campaign(t, store("a", 5*time.Second), "cancel")
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		if _, err := store("b", 5*time.Second).Campaign(ctx, "cancel"); !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Campaign while held: %v, want the deadline", err)
		}
		resp, err := cli.Get(context.Background(), "locks/cancel/", clientv3.WithPrefix())
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Kvs) != 1 || string(resp.Kvs[0].Key) != holder.Key() {
			t.Errorf("keys under the prefix after a cancelled campaign: %v, want only the holder's", resp.Kvs)
		}
	})
}

// TestEtcdLeaseServerDown: a holder that cannot reach etcd counts its lease lost one TTL
// after its last renewal, without etcd's word; Release afterwards returns nil.
func TestEtcdLeaseServerDown(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcd(t)
	l := leasetest.Campaign(t, &etcd.Store{Client: e.Client(t), TTL: 2 * time.Second, Holder: "a", Logger: zaptest.NewLogger(t)}, "down")
	e.Stop(t)
	stopped := time.Now()
	leasetest.WaitClosed(t, "Done with etcd down", l.Done(), leasetest.WaitTimeout)
	t.Logf("lease lost %v after etcd stopped (TTL 2s)", time.Since(stopped).Round(time.Millisecond))
	if err := l.Err(); !errors.Is(err, lease.ErrLockLost) || !strings.Contains(err.Error(), "not renewed within its TTL") {
		t.Errorf("Err = %v, want ErrLockLost: not renewed within its TTL", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if err := l.Release(ctx); err != nil {
		t.Errorf("Release of a lost lease with etcd down: %v, want nil", err)
	}
}

// runEtcdHolder is the frozen holder of TestEtcdLeaseFrozenHolder, in a process of its own:
// it wins the election of $LEASE_TEST_RESOURCE on $LEASE_TEST_ETCD with a 2 s TTL, prints
// "token N", then "lost ERROR" when the lease is lost.
func runEtcdHolder() int {
	cli, err := etcd.NewClient(etcd.Config{Endpoints: []string{os.Getenv("LEASE_TEST_ETCD")}})
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	return leasetest.RunStoreHolder(&etcd.Store{Client: cli, TTL: 2 * time.Second, Holder: "frozen"}, os.Getenv("LEASE_TEST_RESOURCE"))
}

// TestEtcdLeaseFrozenHolder freezes a holder (a process of its own, SIGSTOP): etcd expires
// its session, another holder wins with a higher token, and the old holder learns that its
// lease is lost when it thaws.
func TestEtcdLeaseFrozenHolder(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcd(t)
	const resource = "frozen"
	holder, _, next := leasetest.StartHolder(t, "LEASE_TEST_ETCD_HOLDER=1", "LEASE_TEST_ETCD="+e.Endpoint, "LEASE_TEST_RESOURCE="+resource)
	token, err := strconv.ParseInt(strings.TrimPrefix(next("token "), "token "), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	if err := holder.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	frozen := time.Now()
	contender := leasetest.Campaign(t, &etcd.Store{Client: e.Client(t), TTL: 2 * time.Second, Holder: "contender"}, resource)
	t.Logf("holder frozen -> new holder after %v (TTL 2s)", time.Since(frozen).Round(time.Millisecond))
	if contender.Token() <= token {
		t.Errorf("tokens %d then %d, want higher", token, contender.Token())
	}
	thawed := time.Now()
	if err := holder.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	line := next("lost ")
	t.Logf("thawed holder learned %v later: %s", time.Since(thawed).Round(time.Millisecond), line)
	if !strings.Contains(line, lease.ErrLockLost.Error()) {
		t.Errorf("holder's loss: %q, want %v", line, lease.ErrLockLost)
	}
}
