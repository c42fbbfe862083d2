package pglease_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/lease/leasetest"
	"github.com/fenceproxy/fenceproxy/internal/lease/pglease"
	"github.com/fenceproxy/fenceproxy/internal/standby"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestPostgresLeaseSurvivesFailover (issue 21, setup 2): with the failover standby named, an
// acquisition's generation is handed out only once the standby has flushed it, so after the
// primary's crash and the standby's promotion the next holder gets a higher generation, never
// the one the lost primary handed out.
func TestPostgresLeaseSurvivesFailover(t *testing.T) {
	pg, url := leasetest.LeaseDB(t)
	sb := testenv.StartStandby(t, pg, "s1")
	b := &pglease.Store{URL: url, TTL: time.Second, Holder: "b", Standbys: standby.Set{Names: []string{"s1"}}}
	lb := leasetest.Campaign(t, b, "billing")
	sb.CutReplication() // the generation is on s1 already: cut before anything else streams
	pg.Kill(t)
	sb.Promote(t)

	c := &pglease.Store{URL: sb.AdminURL(), TTL: time.Second, Holder: "c"}
	lc := leasetest.Campaign(t, c, "billing")
	if lc.Token() <= lb.Token() {
		t.Fatalf("after the failover c got generation %d, b held %d on the lost primary: issued twice", lc.Token(), lb.Token())
	}
}

// TestPostgresLeaseStandbyNotConfirming: with the standby cut off, an acquisition is released
// (its generation never handed out) and the campaign goes on until its context ends.
func TestPostgresLeaseStandbyNotConfirming(t *testing.T) {
	pg, url := leasetest.LeaseDB(t)
	sb := testenv.StartStandby(t, pg, "s1")
	sb.CutReplication()
	s := &pglease.Store{URL: url, TTL: 5 * time.Second, Holder: "b",
		Standbys: standby.Set{AllSlots: true}, FlushTimeout: 300 * time.Millisecond}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	l, err := s.Campaign(ctx, "billing")
	if err == nil {
		_ = l.Release(context.Background())
		t.Fatalf("Campaign handed out generation %d that the cut-off standby never flushed", l.Token())
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Campaign: %v, want the context's end", err)
	}
	conn := testenv.Connect(t, url)
	if r := readLease(t, conn, "billing"); r.holder != nil {
		t.Fatalf("the unconfirmed lease is still held by %q", *r.holder)
	}
}
