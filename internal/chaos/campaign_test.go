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
			Direct: true, Always: []string{chaos.FreezeLong}})
		t.Logf("chaos figures:\n%s", res.Report())
		n := history.Count(res.Violations)
		if n[history.StaleCommit] == 0 && n[history.Duplicate] == 0 {
			t.Errorf("negative control: the checker found no stale commit and no duplicate straight to PostgreSQL; it would not catch them through the proxy either")
		}
	})
}

// TestCampaignFailover runs the campaign with a streaming standby and the failover fault in
// every round (the primary killed, the standby promoted while the workload runs), through
// fenceproxy with an asynchronous standby the proxies wait for (--failover-standbys) and
// with a synchronous one: no violation, no failed round. Then its negative control: the
// replicas straight to PostgreSQL, an asynchronous standby whose replication is cut before
// the failover, a leader frozen beyond its lock, the failover after the next leader's raise,
// and the claim that no acknowledged write is lost: the checker must find the acknowledged
// writes the old primary took with it. $CHAOS_FAILOVER_ROUNDS (default 1),
// $CHAOS_FAILOVER_STANDBY (async, sync or both; default one of the two by the seed's
// parity, so that `make test` spends one setup on it and the seed replays the choice),
// $CHAOS_FAILOVER_CONTROL_ROUNDS (default 1), $CHAOS_SEED, $CHAOS_TTL and $CHAOS_DIR tune
// it; `make chaos` runs both variants long.
func TestCampaignFailover(t *testing.T) {
	seed := uint64(envInt(t, "CHAOS_SEED", int(time.Now().UnixNano()%(1<<31)+1)))
	ttl := envDuration(t, "CHAOS_TTL", time.Second)
	rounds := envInt(t, "CHAOS_FAILOVER_ROUNDS", 1)
	standbys := []string{chaos.StandbyAsync, chaos.StandbySync}
	switch v := os.Getenv("CHAOS_FAILOVER_STANDBY"); v {
	case "":
		standbys = standbys[seed%2 : seed%2+1]
	case chaos.StandbyAsync, chaos.StandbySync:
		standbys = []string{v}
	case "both":
	default:
		t.Fatalf("$CHAOS_FAILOVER_STANDBY=%q: want async, sync or both", v)
	}
	for _, standby := range standbys {
		t.Run(standby, func(t *testing.T) {
			res := chaos.Run(t, chaos.Config{Rounds: rounds, Seed: seed, TTL: ttl, Standby: standby, Always: []string{chaos.Failover},
				Dir: keep(t, "failover-"+standby)})
			t.Logf("chaos figures:\n%s", res.Report())
			for _, f := range res.Failures {
				t.Errorf("%s", f)
			}
			if res.Faults[chaos.Failover] == 0 {
				t.Errorf("no failover injected")
			}
		})
	}
	t.Run("control", func(t *testing.T) {
		res := chaos.Run(t, chaos.Config{Rounds: envInt(t, "CHAOS_FAILOVER_CONTROL_ROUNDS", 1), Seed: seed, TTL: ttl, Units: 64,
			Dir: keep(t, "failover-control"), Direct: true, Standby: chaos.StandbyAsync, ClaimNoLoss: true, FailoverAfterRaise: true,
			Always: []string{chaos.FreezeLong, chaos.Failover}, Faults: []string{chaos.FreezeLong}, MaxFaults: 1})
		t.Logf("chaos figures:\n%s", res.Report())
		if n := history.Count(res.Violations); res.LostAcked == 0 || n[history.LostAck] < res.LostAcked {
			t.Errorf("failover negative control: %d acknowledged writes lost with the old primary, %d lost-ack violations found (%d failovers): the checker must find each",
				res.LostAcked, n[history.LostAck], res.Faults[chaos.Failover])
		}
	})
}
