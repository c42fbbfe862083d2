package lease_test

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

func TestParseOffset(t *testing.T) {
	for in, want := range map[string]time.Duration{
		"": 0, "0": 0, " 0\n": 0, "90s": 90 * time.Second, "+2m\n": 2 * time.Minute, "-1.5s": -1500 * time.Millisecond,
	} {
		got, err := lease.ParseOffset(in)
		if err != nil || got != want {
			t.Errorf("ParseOffset(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"1", "soon", "5 s"} {
		if _, err := lease.ParseOffset(in); err == nil {
			t.Errorf("ParseOffset(%q): no error", in)
		}
	}
}

func TestOffsetFileClock(t *testing.T) {
	path := filepath.Join(t.TempDir(), "offset")
	now := lease.OffsetFileClock(path)
	if d := now().Sub(time.Now()); d < -time.Second || d > time.Second {
		t.Errorf("no file: the clock is %v off", d)
	}
	if err := os.WriteFile(path, []byte("-1h\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if d := time.Now().Sub(now()); d < 59*time.Minute || d > 61*time.Minute {
		t.Errorf("-1h: the clock is %v behind, want 1h", d)
	}
}

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
	s := newSession(t, client, lease.WithTTL(ttl), lease.WithClock(lease.OffsetFileClock(path)))
	// Several renewals (every TTL/2) on the clock set back.
	select {
	case <-s.Done():
		t.Fatalf("session ended with the clock set back: %v", s.Err())
	case <-time.After(2 * ttl):
	}
	jump("+30s")
	waitClosed(t, "the session's end after the clock jumped forward", s.Done(), waitTimeout)
	if err := s.Err(); !errors.Is(err, lease.ErrSessionExpired) {
		t.Fatalf("session ended with %v, want ErrSessionExpired", err)
	}
}
