package zookeeper_test

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

	"github.com/go-zookeeper/zk"
	"go.uber.org/zap/zaptest"

	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/lease/leasetest"
	"github.com/fenceproxy/fenceproxy/internal/lease/zookeeper"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// czxid reads path's czxid, 0 when it does not exist.

// TestMain doubles as the holder process of the freeze tests (leasetest.StartHolder).
func TestMain(m *testing.M) {
	leasetest.Main(m, map[string]func() int{
		"LEASE_TEST_ZK_HOLDER": runZKHolder,
	})
}

func czxid(t *testing.T, c *zk.Conn, path string) int64 {
	t.Helper()
	ok, st, err := c.Exists(path)
	if err != nil {
		t.Fatalf("exists %s: %v", path, err)
	}
	if !ok {
		return 0
	}
	return st.Czxid
}

// waitChildren waits until dir has n children.
func waitChildren(t *testing.T, c *zk.Conn, dir string, n int) {
	t.Helper()
	leasetest.Eventually(t, leasetest.WaitTimeout, fmt.Sprintf("%s has %d children", dir, n), func() error {
		children, _, err := c.Children(dir)
		if err == nil && len(children) != n {
			err = fmt.Errorf("children %v", children)
		}
		return err
	})
}

// TestZooKeeperLease runs the lock recipe against one real ZooKeeper server: its subtests
// share it (a JVM start is the slow part), and the last step stops it.
func TestZooKeeperLease(t *testing.T) {
	t.Parallel()
	z := testenv.StartZooKeeper(t)
	c := z.Conn(t)
	store := func(holder string, ttl time.Duration) *zookeeper.Store {
		return &zookeeper.Store{Servers: []string{z.Addr}, TTL: ttl, Holder: holder}
	}

	t.Run("recipe", func(t *testing.T) {
		t.Run("acquire, renew past the TTL, release", func(t *testing.T) {
			t.Parallel()
			// 3 s: a client starved for 2/3 of its session timeout drops the connection,
			// which a loaded machine must not turn into a lost lease.
			l := leasetest.Campaign(t, store("a", 3*time.Second), "renew")
			if l.Store() != lease.StoreZooKeeper || !strings.HasPrefix(l.Key(), "/locks/renew/_c_") || l.Holder() == "" {
				t.Errorf("lease: store %q key %q holder %q; want zookeeper, /locks/renew/_c_...", l.Store(), l.Key(), l.Holder())
			}
			if got := czxid(t, c, l.Key()); got != l.Token() || got <= 0 {
				t.Fatalf("token %d, lock node's czxid %d: want equal", l.Token(), got)
			}
			data, st, err := c.Get(l.Key())
			if err != nil || string(data) != "a" || fmt.Sprintf("%x", st.EphemeralOwner) != l.Holder() {
				t.Errorf("lock node: data %q owner %x (%v); want a, session %s", data, st.EphemeralOwner, err, l.Holder())
			}
			// Over two session timeouts: only the client's pings keep it.
			select {
			case <-l.Done():
				t.Fatalf("lease lost while kept alive: %v", l.Err())
			case <-time.After(7 * time.Second):
			}
			if got := czxid(t, c, l.Key()); got != l.Token() {
				t.Fatalf("after two session timeouts the lock node's czxid is %d, want %d", got, l.Token())
			}
			if err := l.Release(context.Background()); err != nil {
				t.Fatalf("Release: %v", err)
			}
			if !errors.Is(l.Err(), lease.ErrReleased) {
				t.Errorf("Err after Release = %v, want ErrReleased", l.Err())
			}
			leasetest.WaitClosed(t, "Done after Release", l.Done(), time.Second)
			if got := czxid(t, c, l.Key()); got != 0 {
				t.Errorf("lock node still there after Release (czxid %d)", got)
			}
		})

		t.Run("tokens grow across hand-overs and node deletion", func(t *testing.T) {
			t.Parallel()
			var last int64
			for i, holder := range []string{"a", "b", "a", "a", "b"} {
				l := leasetest.Campaign(t, store(holder, 5*time.Second), "handover")
				if l.Token() <= last {
					t.Fatalf("hand-over %d: token %d after %d, want higher", i, l.Token(), last)
				}
				last = l.Token()
				if i == 2 {
					// Someone deletes the lock node by hand: the holder learns it, and the
					// next node's czxid is still higher.
					if err := c.Delete(l.Key(), -1); err != nil {
						t.Fatal(err)
					}
					leasetest.WaitClosed(t, "Done after the node was deleted", l.Done(), leasetest.WaitTimeout)
					if err := l.Err(); !errors.Is(err, lease.ErrLockLost) || !strings.Contains(err.Error(), "deleted") {
						t.Errorf("Err = %v, want ErrLockLost saying the node was deleted", err)
					}
				}
				if err := l.Release(context.Background()); err != nil {
					t.Fatal(err)
				}
			}
		})

		t.Run("each waiter watches its predecessor and the lock goes in order", func(t *testing.T) {
			t.Parallel()
			const dir = "/locks/order"
			a := leasetest.Campaign(t, store("a", 5*time.Second), "order")
			type result struct {
				l   lease.Lease
				err error
			}
			wait := func(holder string) <-chan result {
				ch := make(chan result, 1)
				go func() {
					ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
					defer cancel()
					l, err := store(holder, 5*time.Second).Campaign(ctx, "order")
					ch <- result{l, err}
				}()
				return ch
			}
			bc := wait("b")
			waitChildren(t, c, dir, 2)
			cc := wait("c")
			waitChildren(t, c, dir, 3)
			if err := a.Release(context.Background()); err != nil {
				t.Fatal(err)
			}
			got := func(ch <-chan result) lease.Lease {
				t.Helper()
				r := <-ch
				if r.err != nil {
					t.Fatal(r.err)
				}
				t.Cleanup(func() { _ = r.l.Release(context.Background()) })
				return r.l
			}
			b := got(bc)
			// b holds: c, which watches b's node, cannot have the lock.
			select {
			case r := <-cc:
				t.Fatalf("c won while b holds: %v, %v", r.l, r.err)
			default:
			}
			if err := b.Release(context.Background()); err != nil {
				t.Fatal(err)
			}
			third := got(cc)
			if !(a.Token() < b.Token() && b.Token() < third.Token()) {
				t.Errorf("tokens a %d, b %d, c %d: want growing in lock order", a.Token(), b.Token(), third.Token())
			}
		})

		t.Run("contenders are never two holders", func(t *testing.T) {
			t.Parallel()
			leasetest.Contend(t, func(name string) lease.Store { return store(name, 5*time.Second) }, "leasetest.Contend", 4, 3)
		})

		t.Run("a frozen holder's session expires and the next token is higher", func(t *testing.T) {
			t.Parallel()
			const resource = "frozen"
			holder, _, next := leasetest.StartHolder(t, "LEASE_TEST_ZK_HOLDER=1", "LEASE_TEST_ZK="+z.Addr, "LEASE_TEST_RESOURCE="+resource)
			token, err := strconv.ParseInt(strings.TrimPrefix(next("token "), "token "), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			if err := holder.Process.Signal(syscall.SIGSTOP); err != nil {
				t.Fatal(err)
			}
			frozen := time.Now()
			contender := leasetest.Campaign(t, store("contender", 2*time.Second), resource)
			t.Logf("holder frozen -> new holder after %v (session timeout 2s)", time.Since(frozen).Round(time.Millisecond))
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
		})

		t.Run("a cancelled campaign leaves no node behind", func(t *testing.T) {
			t.Parallel()
			holder := leasetest.Campaign(t, store("a", 5*time.Second), "cancel")
			ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
			defer cancel()
			if _, err := store("b", 5*time.Second).Campaign(ctx, "cancel"); !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("Campaign while held: %v, want the deadline", err)
			}
			waitChildren(t, c, "/locks/cancel", 1)
			if children, _, err := c.Children("/locks/cancel"); err != nil || "/locks/cancel/"+children[0] != holder.Key() {
				t.Errorf("nodes after a cancelled campaign: %v (%v), want only the holder's", children, err)
			}
		})

		t.Run("settings ZooKeeper cannot take are refused", func(t *testing.T) {
			t.Parallel()
			for _, s := range []*zookeeper.Store{
				{Servers: []string{z.Addr}, TTL: 500 * time.Millisecond},
				{Servers: []string{z.Addr}, TTL: 25 * time.Hour},
				{Servers: []string{z.Addr}, Prefix: "locks/relative"},
				{},
			} {
				if _, err := s.Campaign(context.Background(), "refused"); !errors.Is(err, lease.ErrRefused) {
					t.Errorf("%+v: %v, want ErrRefused", s, err)
				}
			}
		})
	})

	// Last, with the server down: a holder counts its lease lost a third of its session
	// timeout after the connection dropped, without ZooKeeper's word; Release then returns
	// nil.
	l := leasetest.Campaign(t, &zookeeper.Store{Servers: []string{z.Addr}, TTL: 3 * time.Second, Holder: "a", Logger: zaptest.NewLogger(t)}, "down")
	z.Stop(t)
	stopped := time.Now()
	leasetest.WaitClosed(t, "Done with ZooKeeper down", l.Done(), leasetest.WaitTimeout)
	t.Logf("lease lost %v after ZooKeeper stopped (session timeout 3s)", time.Since(stopped).Round(time.Millisecond))
	if err := l.Err(); !errors.Is(err, lease.ErrLockLost) || !strings.Contains(err.Error(), "no connection to ZooKeeper") {
		t.Errorf("Err = %v, want ErrLockLost: no connection to ZooKeeper", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := l.Release(ctx); err != nil {
		t.Errorf("Release of a lost lease with ZooKeeper down: %v, want nil", err)
	}
}

// runZKHolder is the frozen holder of TestZooKeeperLease, in a process of its own: it takes
// the lock of $LEASE_TEST_RESOURCE on $LEASE_TEST_ZK with a 2 s session timeout, prints
// "token N", then "lost ERROR" when the lease is lost.
func runZKHolder() int {
	s := &zookeeper.Store{Servers: []string{os.Getenv("LEASE_TEST_ZK")}, TTL: 2 * time.Second, Holder: "frozen"}
	return leasetest.RunStoreHolder(s, os.Getenv("LEASE_TEST_RESOURCE"))
}
