package chaos_test

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/chaos"
	"github.com/fenceproxy/fenceproxy/internal/history"
)

// envInt reads a positive integer from the environment, else def.
func envInt(t *testing.T, name string, def int) int {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		t.Fatalf("$%s=%q: want a positive integer", name, v)
	}
	return n
}

func envDuration(t *testing.T, name string, def time.Duration) time.Duration {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		t.Fatalf("$%s=%q: want a positive duration", name, v)
	}
	return d
}

// keep is $CHAOS_DIR/name when $CHAOS_DIR is set: the campaign's logs and outcome files
// stay there.
func keep(t *testing.T, name string) string {
	if d := os.Getenv("CHAOS_DIR"); d != "" {
		dir := filepath.Join(d, name)
		t.Logf("chaos: logs and outcomes in %s", dir)
		return dir
	}
	return ""
}

// TestCampaign runs the campaign through fenceproxy, which must show no violation and no
// failed round, then its negative control straight to PostgreSQL, which must show
// violations. $CHAOS_ROUNDS (default 20), $CHAOS_CONTROL_ROUNDS (default 4), $CHAOS_SEED,
// $CHAOS_TTL (default 1s), $CHAOS_FAULTS (kinds, comma-separated; default all) and
// $CHAOS_DIR (keep the logs there) tune it;
// `make chaos` runs a long one.
func TestCampaign(t *testing.T) {
	seed := uint64(envInt(t, "CHAOS_SEED", int(time.Now().UnixNano()%(1<<31)+1)))
	ttl := envDuration(t, "CHAOS_TTL", time.Second)
	var faults []string
	if f := os.Getenv("CHAOS_FAULTS"); f != "" {
		faults = strings.Split(f, ",")
	}
	t.Run("fenced", func(t *testing.T) {
		res := chaos.Run(t, chaos.Config{Rounds: envInt(t, "CHAOS_ROUNDS", 20), Seed: seed, TTL: ttl, Faults: faults, Dir: keep(t, "fenced")})
		t.Logf("chaos figures:\n%s", res.Report())
		for _, f := range res.Failures {
			t.Errorf("%s", f)
		}
		if res.Writes == 0 {
			t.Errorf("no write committed")
		}
	})
	t.Run("direct", func(t *testing.T) {
		res := chaos.Run(t, chaos.Config{Rounds: envInt(t, "CHAOS_CONTROL_ROUNDS", 4), Seed: seed, TTL: ttl, Dir: keep(t, "direct"),
			Direct: true, Always: chaos.FreezeLong})
		t.Logf("chaos figures:\n%s", res.Report())
		n := history.Count(res.Violations)
		if n[history.StaleCommit] == 0 && n[history.Duplicate] == 0 {
			t.Errorf("negative control: the checker found no stale commit and no duplicate straight to PostgreSQL; it would not catch them through the proxy either")
		}
	})
}
