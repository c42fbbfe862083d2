package proxy_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestMeasureSessionStartStandbys measures a fenced session's start (connect through the
// proxy, bind, close) without standbys, with an asynchronous standby that --failover-standbys
// names, and with a synchronous one (synchronous_standby_names, synchronous_commit on), in
// interleaved rounds, for sessions that raise the token and sessions that bind the current
// one; it prints the medians. Run it by hand (docs/failover.md):
//
//	FENCEPROXY_MEASURE=1 go test -run TestMeasureSessionStartStandbys -count=1 -v ./internal/proxy/
func TestMeasureSessionStartStandbys(t *testing.T) {
	rounds, perRound := measureRounds(t, 7), 40
	type setup struct {
		name string
		px   *testenv.Proxy
		tok  int64
		d    map[string][]time.Duration
	}
	var setups []*setup
	{
		pg, _ := fencedDB(t)
		setups = append(setups, &setup{name: "no standby wait", px: fencedProxy(t, pg)})
	}
	{
		pg, _ := fencedDB(t)
		testenv.StartStandby(t, pg, "s1")
		setups = append(setups, &setup{name: "async standby, --failover-standbys=s1", px: failoverProxy(t, pg, "s1")})
	}
	{
		pg, _ := fencedDB(t, testenv.WithConf("synchronous_commit", "on"))
		testenv.StartStandby(t, pg, "s1")
		makeSynchronous(t, pg, "s1")
		setups = append(setups, &setup{name: "sync standby, --failover-standbys=s1", px: failoverProxy(t, pg, "s1")})
	}
	start := func(s *setup, tok int64) time.Duration {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		began := time.Now()
		conn, err := pgx.Connect(ctx, s.px.FenceURL("app", "postgres", "billing", tok))
		d := time.Since(began)
		if err != nil {
			t.Fatalf("%s: %v", s.name, err)
		}
		conn.Close(ctx)
		return d
	}
	for _, s := range setups {
		s.d = map[string][]time.Duration{}
		s.tok = 1
		start(s, s.tok) // warm up
	}
	for range rounds {
		for _, s := range setups {
			for range perRound / 2 {
				s.tok++
				s.d["raise"] = append(s.d["raise"], start(s, s.tok))
				s.d["current token"] = append(s.d["current token"], start(s, s.tok))
			}
		}
	}
	for _, s := range setups {
		for _, kind := range []string{"raise", "current token"} {
			med, p90 := medianP90(s.d[kind])
			fmt.Printf("%-40s %-14s median %v  p90 %v  (n=%d)\n", s.name, kind, med, p90, len(s.d[kind]))
		}
	}
}

// measureRounds skips t unless FENCEPROXY_MEASURE is set (a measurement, not a test), and
// returns how many rounds to run: FENCEPROXY_MEASURE_ROUNDS, else def.
func measureRounds(t *testing.T, def int) int {
	t.Helper()
	if os.Getenv("FENCEPROXY_MEASURE") == "" {
		t.Skip("a measurement, not a test: set FENCEPROXY_MEASURE=1")
	}
	if n, err := strconv.Atoi(os.Getenv("FENCEPROXY_MEASURE_ROUNDS")); err == nil && n > 0 {
		return n
	}
	return def
}

// medianP90 sorts d and returns its median and 90th percentile, rounded to 10 µs.
func medianP90(d []time.Duration) (median, p90 time.Duration) {
	slices.Sort(d)
	return d[len(d)/2].Round(10 * time.Microsecond), d[len(d)*9/10].Round(10 * time.Microsecond)
}

// makeSynchronous names standby in the primary's synchronous_standby_names (ALTER SYSTEM,
// reload): commits that run with synchronous_commit on wait for it from now on.
func makeSynchronous(t *testing.T, pg *testenv.Postgres, standby string) {
	t.Helper()
	pg.Exec(t, "ALTER SYSTEM SET synchronous_standby_names = '"+standby+"'")
	pg.Exec(t, "SELECT pg_reload_conf()")
	conn := connect(t, pg.AdminURL())
	eventually(t, 10*time.Second, "standby "+standby+" sync in pg_stat_replication", func() error {
		var state string
		err := conn.QueryRow(ctxT(t), "SELECT coalesce((SELECT sync_state FROM pg_stat_replication WHERE application_name = $1), '')", standby).Scan(&state)
		if err != nil {
			t.Fatal(err)
		}
		if state != "sync" {
			return fmt.Errorf("%q, want sync", state)
		}
		return nil
	})
}
