package consul_test

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/hashicorp/consul/api"

	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/lease/consul"
	"github.com/fenceproxy/fenceproxy/internal/lease/leasetest"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestWatcherCreateLock: in create-lock mode, deleting and re-creating the key (what
// `consul lock` and api.Lock's Destroy do) is a new, higher token, never a regression;
// a plain write on the held key and a snapshot restore still are.
func TestWatcherCreateLock(t *testing.T) {
	t.Parallel()
	c := testenv.StartConsul(t)
	client := c.Client(t)
	const key = "locks/create-lock"
	w, rec := leasetest.Watch(t, client, consul.WatcherConfig{Keys: []string{key}, Mode: lease.TokenCreateLock})
	rec.WaitFor(t, "synced", func(s consul.State) bool { return s.Known })

	var tokens []int64
	var snapshot []byte
	for i := range 4 {
		s := newSession(t, client)
		l := acquire(t, s, key)
		tok, err := l.TokenOf(lease.TokenCreateLock)
		if err != nil {
			t.Fatal(err)
		}
		st := rec.WaitFor(t, "holder "+itoa(i), func(st consul.State) bool { return st.Session == s.ID() })
		if cur, err := st.Token(); err != nil || cur != tok || st.Regression != nil {
			t.Fatalf("holder %d: state token %d, %v, want %d: %s", i, cur, err, tok, leasetest.Describe(st))
		}
		if _, err := w.Validate(leasetest.Ctx(t), key, tok, s.ID()); err != nil {
			t.Fatalf("holder %d: Validate: %v", i, err)
		}
		for _, old := range tokens {
			if _, err := w.Validate(leasetest.Ctx(t), key, old, ""); !errors.Is(err, lease.ErrStale) {
				t.Fatalf("holder %d: earlier token %d: %v, want ErrStale", i, old, err)
			}
		}
		tokens = append(tokens, tok)
		if i == 1 {
			snapshot = saveSnapshot(t, client)
		}
		if err := l.Release(leasetest.Ctx(t)); err != nil {
			t.Fatal(err)
		}
		if i%2 == 0 {
			// api.Lock's Destroy and `consul lock`: the key goes, LockIndex restarts.
			if _, err := client.KV().Delete(key, nil); err != nil {
				t.Fatal(err)
			}
			st := rec.WaitFor(t, "deleted", func(st consul.State) bool { return !st.Exists })
			if err := st.Check(tok, ""); !errors.Is(err, lease.ErrNotHeld) {
				t.Errorf("deleted key: Check = %v, want ErrNotHeld", err)
			}
		}
	}
	for i := 1; i < len(tokens); i++ {
		if tokens[i] <= tokens[i-1] {
			t.Fatalf("tokens %v do not grow", tokens)
		}
	}

	t.Run("plain write on the held key", func(t *testing.T) {
		s := newSession(t, client)
		acquire(t, s, key)
		if _, err := client.KV().Put(&api.KVPair{Key: key, Value: []byte("oops")}, nil); err != nil {
			t.Fatal(err)
		}
		st := rec.WaitFor(t, "regression", func(st consul.State) bool { return st.Regression != nil })
		if !strings.Contains(st.Regression.Reason, "plain write") {
			t.Errorf("reason %q", st.Regression.Reason)
		}
		t.Logf("reported: %v", st.Regression)
		if err := w.Reset(key); err != nil {
			t.Fatal(err)
		}
		rec.WaitFor(t, "reset", func(st consul.State) bool { return st.Regression == nil })
		// A new holder after the reset: history to regress from again.
		if _, err := client.Session().Destroy(s.ID(), nil); err != nil {
			t.Fatal(err)
		}
		next := newSession(t, client)
		acquire(t, next, key)
		rec.WaitFor(t, "next holder", func(st consul.State) bool { return st.Session == next.ID() && st.Highest > 0 })
	})

	t.Run("snapshot restore", func(t *testing.T) {
		if err := client.Snapshot().Restore(nil, bytes.NewReader(snapshot)); err != nil {
			t.Fatal(err)
		}
		st := rec.WaitFor(t, "regression", func(st consul.State) bool { return st.Regression != nil })
		if !strings.Contains(st.Regression.Reason, "CreateIndex went back") && !strings.Contains(st.Regression.Reason, "LockIndex went from") {
			t.Errorf("reason %q", st.Regression.Reason)
		}
		t.Logf("reported: %v", st.Regression)
	})
}

// TestConsulStoreCreateLock: a ConsulStore of mode create-lock hands out the encoded token.
func TestConsulStoreCreateLock(t *testing.T) {
	t.Parallel()
	c := testenv.StartConsul(t)
	client := c.Client(t)
	store := &consul.Store{Client: client, Key: "locks/store", TokenMode: lease.TokenCreateLock}
	l, err := store.Campaign(leasetest.Ctx(t), "store")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(leasetest.Ctx(t)) //nolint:errcheck
	p := leasetest.ReadKey(t, client, "locks/store")
	want, err := lease.EncodeToken(p.CreateIndex, p.LockIndex)
	if err != nil || l.Token() != want || p.Session != l.Holder() {
		t.Errorf("token %d, want %d (%v); key %+v", l.Token(), want, err, p)
	}
	bad := &consul.Store{Client: client, TokenMode: "createindex"}
	if _, err := bad.Campaign(leasetest.Ctx(t), "store"); !errors.Is(err, lease.ErrRefused) {
		t.Errorf("unknown mode: %v, want ErrRefused", err)
	}
}

// TestPermanent: the Consul errors that retrying cannot change. (The scheme mismatch is also
// run against a real Consul in cmd/fenceproxy's TestConsulMisconfigured; the ACL answers are
// Consul's api.StatusError values, as its client returns them.)
func TestPermanent(t *testing.T) {
	for _, tt := range []struct {
		err  error
		want bool
	}{
		{api.StatusError{Code: 403, Body: "Permission denied: token with AccessorID '...' lacks permission 'key:read'"}, true},
		{fmt.Errorf("consistent read: %w", api.StatusError{Code: 401, Body: "ACL not found"}), true},
		{api.StatusError{Code: 400, Body: "Client sent an HTTP request to an HTTPS server."}, true},
		{api.StatusError{Code: 500, Body: "No cluster leader"}, false},
		{errors.New("dial tcp 127.0.0.1:1: connect: connection refused"), false},
		{nil, false},
	} {
		if got := consul.Permanent(tt.err); got != tt.want {
			t.Errorf("Permanent(%v) = %t, want %t", tt.err, got, tt.want)
		}
	}
}
