package consul_test

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/lease/consul"
	"github.com/fenceproxy/fenceproxy/internal/lease/leasetest"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestSessionClockJump jumps the clock of a session's keep-alive: back by more than its TTL,
// which changes nothing while renewals succeed (Consul decides), then forward by more than
// its TTL, after which the session's holder cannot tell that it still holds anything and
// gives up at its next renewal (the early side, never the late one).
func TestSessionClockJump(t *testing.T) {
	t.Parallel()
	c := testenv.StartConsul(t)
	client := c.Client(t)
	const ttl = 2 * time.Second
	path := filepath.Join(t.TempDir(), "offset")
	jump := func(offset string) {
		if err := os.WriteFile(path, []byte(offset), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	jump("-30s")
	s := newSession(t, client, consul.WithTTL(ttl), consul.WithClock(lease.OffsetFileClock(path)))
	// Several renewals (every TTL/2) on the clock set back.
	select {
	case <-s.Done():
		t.Fatalf("session ended with the clock set back: %v", s.Err())
	case <-time.After(2 * ttl):
	}
	jump("+30s")
	leasetest.WaitClosed(t, "the session's end after the clock jumped forward", s.Done(), leasetest.WaitTimeout)
	if err := s.Err(); !errors.Is(err, lease.ErrSessionExpired) {
		t.Fatalf("session ended with %v, want ErrSessionExpired", err)
	}
}
