package main

import (
	"context"
	"slices"
	"testing"
)

// TestCompare: a test that passed directly differs when it failed or did not run through the
// proxy; one skipped there, or failing on both sides, does not; the fenced run's token-less
// and elsewhere connections are listed.
func TestCompare(t *testing.T) {
	rs := func(recs ...record) *results {
		r := &results{}
		for _, rec := range recs {
			r.add(rec)
		}
		return r
	}
	direct := rs(
		record{Test: "a", Outcome: "passed"},
		record{Test: "b", Outcome: "passed"},
		record{Test: "c", Outcome: "failed"},
		record{Test: "d", Outcome: "passed"},
		record{Test: "e", Outcome: "passed"},
	)
	// A node-postgres file's record: the reporter's connections, then the exit status.
	fenced := rs(
		record{Test: "a", Outcome: "passed", Conns: conns{Unfenced: 1}},
		record{Test: "b", Outcome: "failed", Message: "boom\n  at x"},
		record{Test: "c", Outcome: "failed"},
		record{Test: "d", Outcome: "skipped"},
		record{Test: "f", Outcome: "pending", Conns: conns{Fenced: 2, Elsewhere: 1}},
		record{Test: "f", Outcome: "passed"},
	)
	c := config{Modes: []string{"direct", "bare"}}
	v, err := compare(context.Background(), c, nil, nil, map[string]*results{"direct": direct, "bare": fenced}, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"bare: b (failed): boom at x", "bare: e (missing): "}
	if !slices.Equal(v.differences, want) {
		t.Errorf("differences %q, want %q", v.differences, want)
	}
	if want := []string{"a (0 with the token, 1 without, 0 elsewhere)"}; !slices.Equal(v.noToken["bare"], want) {
		t.Errorf("token-less %q, want %q", v.noToken, want)
	}
	if want := []string{"f (2 with the token, 0 without, 1 elsewhere)"}; !slices.Equal(v.elsewhere["bare"], want) {
		t.Errorf("elsewhere %q, want %q", v.elsewhere, want)
	}
}
