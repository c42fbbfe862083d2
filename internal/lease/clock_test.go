package lease_test

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/lease"
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
