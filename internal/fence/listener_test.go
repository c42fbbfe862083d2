package fence_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/fence"
)

// TestListen: a listener on database X feeds X's stored tokens, raises and resets into the
// registry as X's, never as another database's: the fence schema, and so every token, is per
// database. A raise in database Y, which it does not listen to, is never observed.
func TestListen(t *testing.T) {
	c := startSchemaCluster(t)
	urlX, urlY := c.migratedDB(t), c.migratedDB(t)
	x, y := dbName(t, urlX), dbName(t, urlY)
	ctlX, ctlY := schemaConnect(t, urlX), schemaConnect(t, urlY)
	mustRaise(t, ctlX, "billing", 5)
	mustRaise(t, ctlY, "billing", 9)

	reg := fence.NewRegistry()
	ready := make(chan struct{}, 8)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- fence.Listen(ctx, urlX+"&application_name=fence-listener", reg, zap.NewNop(), func() { ready <- struct{}{} })
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if !errors.Is(err, context.Canceled) {
				t.Errorf("Listen returned %v after its context ended, want context.Canceled", err)
			}
		case <-time.After(10 * time.Second):
			t.Error("Listen did not return after its context ended")
		}
	})
	select {
	case <-ready:
	case <-time.After(20 * time.Second):
		t.Fatal("the listener never synced")
	}

	// waitFor polls until X's highest token for resource is want: the listener's goroutine
	// feeds the registry asynchronously.
	waitFor := func(resource string, want int64) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for reg.Highest(x, resource) != want {
			if time.Now().After(deadline) {
				t.Fatalf("Highest(%q, %q) = %d, want %d", x, resource, reg.Highest(x, resource), want)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	// The initial read of fence.tokens, as X's.
	if h := reg.Highest(x, "billing"); h != 5 {
		t.Fatalf("after the sync Highest(X) = %d, want 5", h)
	}
	if h := reg.Highest(y, "billing"); h != 0 {
		t.Fatalf("after the sync of X, Highest(Y) = %d, want 0 (Y's 9 is Y's own)", h)
	}

	staleX := make(chan int64, 1)
	staleY := make(chan int64, 1)
	subX := reg.Subscribe(x, "billing", 5, fence.Handler{Stale: func(a int64) { staleX <- a }})
	defer subX.Close()
	subY := reg.Subscribe(y, "billing", 1, fence.Handler{Stale: func(a int64) { staleY <- a }})
	defer subY.Close()

	// A raise in X: X's session is told, Y's is not.
	mustRaise(t, ctlX, "billing", 6)
	select {
	case a := <-staleX:
		if a != 6 {
			t.Fatalf("X's session told %d, want 6", a)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("X's session was not told of the raise in X")
	}
	waitFor("billing", 6)

	// A raise in Y, then a marker raise in X: once the marker is observed, a notification
	// from Y would have been too, had the listener heard it.
	mustRaise(t, ctlY, "billing", 20)
	mustRaise(t, ctlX, "marker", 1)
	waitFor("marker", 1)
	if h := reg.Highest(y, "billing"); h != 0 {
		t.Fatalf("Highest(Y) = %d after raises in Y, which nobody listens to", h)
	}
	if h := reg.Highest(x, "billing"); h != 6 {
		t.Fatalf("Highest(X) = %d after a raise in Y, want X's 6", h)
	}
	select {
	case a := <-staleY:
		t.Fatalf("Y's session was told %d by raises in X", a)
	default:
	}

	// A bind that raises in X is a raise too; a reset in X resets X's token only.
	mustBind(t, schemaConnect(t, urlX), "billing", 7)
	waitFor("billing", 7)
	if _, err := ctlX.Exec(t.Context(), "SELECT fence.reset('billing', 2)"); err != nil {
		t.Fatal(err)
	}
	waitFor("billing", 2)

	// After a reconnection the listener reads fence.tokens again: raises it missed count.
	var ended int
	if err := ctlX.QueryRow(t.Context(), "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = 'fence-listener'").Scan(&ended); err != nil || ended != 1 {
		t.Fatalf("ended %d listener backends, %v; want 1", ended, err)
	}
	mustRaise(t, ctlX, "billing", 30)
	select {
	case <-ready:
	case <-time.After(20 * time.Second):
		t.Fatal("the listener never synced again after its backend was ended")
	}
	waitFor("billing", 30)
	if h := reg.Highest(y, "billing"); h != 0 {
		t.Fatalf("Highest(Y) = %d after the listener of X reconnected", h)
	}
}
