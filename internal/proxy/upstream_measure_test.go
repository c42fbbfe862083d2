package proxy_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestMeasureSessionStartHosts measures a fenced session's start (connect through the proxy,
// bind under the current token, close) with one host and with two hosts, the primary first
// or the standby first, in interleaved rounds, and, for comparison, the start followed by
// the round trip a query-based primary check would add (pgx's and Odyssey's way:
// pg_is_in_recovery()); it prints the medians. Run it by hand (docs/failover.md):
//
//	FENCEPROXY_MEASURE=1 go test -run TestMeasureSessionStartHosts -count=1 -v ./internal/proxy/
func TestMeasureSessionStartHosts(t *testing.T) {
	rounds, perRound := measureRounds(t, 5), 20
	pg, sb := replicatedDB(t)
	type setup struct {
		name  string
		px    *testenv.Proxy
		query bool // one round trip more, as a query-based check
		d, q  []time.Duration
	}
	hosts := func(upstream string) *testenv.Proxy {
		return fencedProxy(t, pg, func(c *proxy.Config) { c.Upstream, c.ControlDatabase = upstream, controlURL(pg, sb.Postgres) })
	}
	one := fencedProxy(t, pg)
	setups := []*setup{
		{name: "one host, no control database", px: one},
		{name: "one host + a pg_is_in_recovery() round trip", px: one, query: true},
		{name: "one host, checked", px: hosts(hostsURL("", pg))},
		{name: "two hosts, primary first", px: hosts(hostsURL("", pg, sb.Postgres))},
		{name: "two hosts, standby first", px: hosts(hostsURL("", sb.Postgres, pg))},
	}
	start := func(s *setup) time.Duration {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		began := time.Now()
		conn, err := pgx.Connect(ctx, s.px.FenceURL("app", "postgres", "billing", 1))
		if err == nil && s.query {
			var standby bool
			asked := time.Now()
			err = conn.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&standby)
			s.q = append(s.q, time.Since(asked))
		}
		d := time.Since(began)
		if err != nil {
			t.Fatalf("%s: %v", s.name, err)
		}
		conn.Close(ctx)
		return d
	}
	for _, s := range setups {
		start(s) // warm up
	}
	for range rounds {
		for _, s := range setups {
			for range perRound {
				s.d = append(s.d, start(s))
			}
		}
	}
	for _, s := range setups {
		med, p90 := medianP90(s.d)
		fmt.Printf("%-46s median %v  p90 %v  (n=%d)\n", s.name, med, p90, len(s.d))
		if len(s.q) > 0 {
			med, _ := medianP90(s.q)
			fmt.Printf("%-46s median %v  (the query alone)\n", "", med)
		}
	}
}
