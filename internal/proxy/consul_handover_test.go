package proxy_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
)

// withoutControl is a proxy without --control-database: only the protected database records
// anything.
func withoutControl(c *proxy.Config) { c.ControlDatabase = "" }

func createLockMode(c *proxy.Config) { c.ConsulTokenMode = string(lease.TokenCreateLock) }

// newConsulSession is a Consul session for the tests' locks.
func newConsulSession(t *testing.T, c *api.Client) string {
	t.Helper()
	id, _, err := c.Session().Create(&api.SessionEntry{TTL: "60s", LockDelay: time.Millisecond, Behavior: api.SessionBehaviorRelease}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// handOverTxn hands key from session from to session to in one Consul transaction, writing
// the key first when set (which resets its LockIndex to 0, so that the lock gives 1 again).
func handOverTxn(t *testing.T, c *api.Client, key, from, to string, set bool) *api.KVPair {
	t.Helper()
	var ops api.TxnOps
	if set {
		ops = append(ops, &api.TxnOp{KV: &api.KVTxnOp{Verb: api.KVSet, Key: key, Value: []byte("x")}})
	}
	ops = append(ops,
		&api.TxnOp{KV: &api.KVTxnOp{Verb: api.KVUnlock, Key: key, Session: from}},
		&api.TxnOp{KV: &api.KVTxnOp{Verb: api.KVLock, Key: key, Session: to}})
	ok, resp, _, err := c.Txn().Txn(ops, nil)
	if err != nil || !ok {
		t.Fatalf("hand-over transaction: %t %v %+v", ok, err, resp)
	}
	p, _, err := c.KV().Get(key, &api.QueryOptions{RequireConsistent: true})
	if err != nil || p == nil || p.Session != to {
		t.Fatalf("read back %s: %+v %v", key, p, err)
	}
	return p
}

func createLockToken(t *testing.T, p *api.KVPair) int64 {
	t.Helper()
	tok, err := lease.EncodeToken(p.CreateIndex, p.LockIndex)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// TestConsulTxnSameTokenSecondHolder (review finding F1): through proxies WITHOUT a control
// database, one Consul transaction writes the held key, unlocks it and locks it for another
// session: LockIndex 0, then 1 again, so the second session holds the very create-lock token
// the first one was admitted with. The token is admitted to one holder only: the second
// holder is refused (ZF007: Consul issued the number twice), and the first holder's open
// transaction does not commit. With the second holder on a proxy started after the
// transaction (its watch never saw the first holder), the protected database's own record
// of the holder refuses it and ends the first holder's backend.
func TestConsulTxnSameTokenSecondHolder(t *testing.T) {
	t.Parallel()
	for _, fresh := range []bool{false, true} {
		t.Run(fmt.Sprintf("second_proxy_%t", fresh), func(t *testing.T) {
			t.Parallel()
			s := startConsulProxy(t, withoutControl, createLockMode)
			const key = "locks/billing"
			a, _ := consulLock(t, s.client, key)
			pair, _, err := s.client.KV().Get(key, &api.QueryOptions{RequireConsistent: true})
			if err != nil || pair == nil {
				t.Fatalf("read %s: %+v %v", key, pair, err)
			}
			tok := createLockToken(t, pair)

			old := connect(t, s.url(tok))
			tx, err := old.Begin(ctxT(t))
			if err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(ctxT(t), "INSERT INTO items (tag, token) VALUES ('deposed', $1)", tok); err != nil {
				t.Fatal(err)
			}

			b := newConsulSession(t, s.client)
			after := handOverTxn(t, s.client, key, a, b, true)
			if got := createLockToken(t, after); got != tok {
				t.Fatalf("the transaction gave token %d, want the same token %d (LockIndex %d)", got, tok, after.LockIndex)
			}

			url := s.url
			if fresh {
				url = startGuardedProxy(t, s, withoutControl, createLockMode).url
			}
			err = connectErr(url(tok, "fence.session="+b))
			wantCode(t, err, fence.CodeUnavailable)
			t.Logf("second holder: %v", err)
			wantCode(t, connectErr(url(tok)), fence.CodeUnavailable)

			err = tx.Commit(ctxT(t))
			if err == nil {
				t.Fatal("the deposed holder's transaction committed")
			}
			t.Logf("deposed holder's commit: %v", err)
			if n := count(t, s.admin, "SELECT count(*)::int FROM items WHERE tag = 'deposed'"); n != 0 {
				t.Errorf("%d rows of the deposed holder committed", n)
			}
			wantCode(t, connectErr(s.url(tok)), fence.CodeUnavailable)
			if fresh {
				if n := count(t, s.admin, "SELECT count(*)::int FROM fence.consul_tokens WHERE resource = 'billing' AND regression IS NOT NULL"); n != 1 {
					t.Errorf("%d regressions recorded in the protected database, want 1", n)
				}
			}
		})
	}
}

// waitLockWaiters waits until n backends of role wait for a lock.
func waitLockWaiters(t *testing.T, admin querier, role string, n int) {
	t.Helper()
	eventually(t, 15*time.Second, "a bind waits for the fence row", func() error {
		if got := count(t, admin, "SELECT count(*)::int FROM pg_stat_activity WHERE usename = $1 AND wait_event_type = 'Lock'", role); got < n {
			return fmt.Errorf("%d waiting", got)
		}
		return nil
	})
}

// TestConsulStaleBindDuringHandOverIsZF001 (review finding F2): Consul shows the holder's token
// as current when the session starts, and a hand-over commits its raise before the session's
// bind reads the stored token (held here behind the fence row's lock, so that the interleaving
// happens every time). The database refuses the bind (ZF001), and so does the proxy: the
// holder is stale, not the victim of a regression (ZF007, as it was told before).
func TestConsulStaleBindDuringHandOverIsZF001(t *testing.T) {
	t.Parallel()
	s := startConsulProxy(t, withoutControl)
	const key = "locks/billing"
	a, tokA := consulLock(t, s.client, key)

	hold, err := connect(t, s.pg.AdminURL()).Begin(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := hold.Exec(ctxT(t), "INSERT INTO fence.tokens (resource, token) VALUES ('billing', 0) ON CONFLICT DO NOTHING"); err != nil {
		t.Fatal(err)
	}
	if _, err := hold.Exec(ctxT(t), "SELECT 1 FROM fence.tokens WHERE resource = 'billing' FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	res := make(chan error, 1)
	go func() { res <- connectErr(s.url(tokA, "fence.session="+a)) }()
	waitLockWaiters(t, s.admin, "app", 1)

	b := newConsulSession(t, s.client)
	tokB := int64(handOverTxn(t, s.client, key, a, b, false).LockIndex)
	// The new holder's raise, committed while the old holder's bind waits.
	if _, err := hold.Exec(ctxT(t), "UPDATE fence.tokens SET token = $1 WHERE resource = 'billing'", tokB); err != nil {
		t.Fatal(err)
	}
	if err := hold.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	err = <-res
	wantCode(t, err, fence.CodeStale)
	t.Logf("old holder: %v", err)
	mustExec(t, connect(t, s.url(tokB, "fence.session="+b)), "INSERT INTO items (tag, token) VALUES ('leader', $1)", tokB)
}

// TestConsulFastHandOversStaleIsZF001 (review finding F2): hand-overs in quick succession (one
// Consul transaction each: no moment without a holder), watched by two proxies with a control
// database whose proactive raises race the stale holders' binds. Every stale holder is told
// ZF001, never ZF007; the last holder is admitted.
func TestConsulFastHandOversStaleIsZF001(t *testing.T) {
	t.Parallel()
	s := startConsulProxy(t)
	p2 := startGuardedProxy(t, s)
	urls := []func(int64, ...string) string{s.url, p2.url}
	const key = "locks/billing"
	holder, tok := consulLock(t, s.client, key)
	mustExec(t, connect(t, s.url(tok, "fence.session="+holder)), "INSERT INTO items (tag, token) VALUES ('first', $1)", tok)

	var wg sync.WaitGroup
	var mu sync.Mutex
	codes := map[string]int{}
	var others []error
	for range 12 {
		next := newConsulSession(t, s.client)
		stale, staleHolder := tok, holder
		tok = int64(handOverTxn(t, s.client, key, holder, next, false).LockIndex)
		holder = next
		for _, url := range urls {
			wg.Go(func() {
				err := connectErr(url(stale, "fence.session="+staleHolder))
				mu.Lock()
				defer mu.Unlock()
				codes[sqlstate(err)]++
				if sqlstate(err) != fence.CodeStale {
					others = append(others, err)
				}
			})
		}
	}
	wg.Wait()
	t.Logf("stale holders' answers by SQLSTATE: %v", codes)
	for _, err := range others {
		t.Errorf("a stale holder was told: %v", err)
	}
	for i, url := range urls {
		eventually(t, 15*time.Second, fmt.Sprintf("proxy %d admits the last holder", i+1), func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			c, err := pgx.Connect(ctx, url(tok, "fence.session="+holder))
			if err != nil {
				if errors.Is(err, context.DeadlineExceeded) || sqlstate(err) != fence.CodeUnavailable {
					return err
				}
				t.Fatalf("proxy %d refused the current holder with ZF007: %v", i+1, err)
			}
			defer c.Close(ctx)
			_, err = c.Exec(ctx, "INSERT INTO items (tag, token) VALUES ('last', $1)", tok)
			return err
		})
	}
}
