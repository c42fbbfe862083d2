package fence_test

import (
	"errors"
	"fmt"
	"reflect"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

func TestFromStartup(t *testing.T) {
	known := []string{"billing", "payroll"}
	tests := []struct {
		name   string
		params []wire.Param
		want   fence.Credentials
		code   string
		rest   []wire.Param // parameters left for the server
	}{
		{"none", []wire.Param{{Name: "user", Value: "a"}}, fence.Credentials{}, "", []wire.Param{{Name: "user", Value: "a"}}},
		{"direct", []wire.Param{{Name: "user", Value: "a"}, {Name: "fence.resource", Value: "billing"}, {Name: "fence.token", Value: "34"}},
			fence.Credentials{Resource: "billing", Token: 34, Present: true}, "", []wire.Param{{Name: "user", Value: "a"}}},
		{"options", []wire.Param{{Name: "options", Value: "-c fence.resource=billing -c fence.token=34 -c work_mem=1MB"}},
			fence.Credentials{Resource: "billing", Token: 34, Present: true}, "", []wire.Param{{Name: "options", Value: "-c work_mem=1MB"}}},
		{"options only fence", []wire.Param{{Name: "options", Value: "--fence.resource=payroll --fence.token=2 --fence.session=abc"}},
			fence.Credentials{Resource: "payroll", Token: 2, Session: "abc", Present: true}, "", nil},
		{"same value twice", []wire.Param{{Name: "fence.token", Value: "3"}, {Name: "fence.resource", Value: "billing"}, {Name: "options", Value: "-c fence.token=3"}},
			fence.Credentials{Resource: "billing", Token: 3, Present: true}, "", nil},
		{"different values", []wire.Param{{Name: "fence.token", Value: "3"}, {Name: "fence.resource", Value: "billing"}, {Name: "options", Value: "-c fence.token=4"}}, fence.Credentials{}, fence.CodeMalformed, nil},
		{"no resource", []wire.Param{{Name: "fence.token", Value: "3"}}, fence.Credentials{}, fence.CodeMissing, nil},
		{"no token", []wire.Param{{Name: "fence.resource", Value: "billing"}}, fence.Credentials{}, fence.CodeMissing, nil},
		{"unknown", []wire.Param{{Name: "fence.resource", Value: "ledger"}, {Name: "fence.token", Value: "1"}}, fence.Credentials{}, fence.CodeUnknown, nil},
		{"bad name", []wire.Param{{Name: "fence.resource", Value: "Billing"}, {Name: "fence.token", Value: "1"}}, fence.Credentials{}, fence.CodeMalformed, nil},
		{"quote in name", []wire.Param{{Name: "fence.resource", Value: "b'x"}, {Name: "fence.token", Value: "1"}}, fence.Credentials{}, fence.CodeMalformed, nil},
		{"bad token", []wire.Param{{Name: "fence.resource", Value: "billing"}, {Name: "fence.token", Value: "1e3"}}, fence.Credentials{}, fence.CodeMalformed, nil},
		{"plus token", []wire.Param{{Name: "fence.resource", Value: "billing"}, {Name: "fence.token", Value: "+3"}}, fence.Credentials{}, fence.CodeMalformed, nil},
		{"unknown fence setting", []wire.Param{{Name: "options", Value: "-c fence.tokne=3"}}, fence.Credentials{}, fence.CodeMalformed, nil},
		// PostgreSQL folds setting names' case: Fence.Token sets fence.token. A review sent
		// these top-level and the proxy, comparing exactly, saw no token and let the session
		// run unfenced under --unfenced allow while the server set fence.token.
		{"mixed case", []wire.Param{{Name: "user", Value: "a"}, {Name: "Fence.Resource", Value: "billing"}, {Name: "FENCE.TOKEN", Value: "5"}},
			fence.Credentials{Resource: "billing", Token: 5, Present: true}, "", []wire.Param{{Name: "user", Value: "a"}}},
		{"mixed case twice, different values", []wire.Param{{Name: "fence.resource", Value: "billing"}, {Name: "fence.token", Value: "5"}, {Name: "Fence.Token", Value: "6"}},
			fence.Credentials{}, fence.CodeMalformed, nil},
		{"mixed case without resource", []wire.Param{{Name: "Fence.Token", Value: "5"}}, fence.Credentials{}, fence.CodeMissing, nil},
		{"unknown fence parameter", []wire.Param{{Name: "fence.tokne", Value: "3"}}, fence.Credentials{}, fence.CodeMalformed, nil},
		{"clustered switches", []wire.Param{{Name: "options", Value: "-ec fence.resource=billing -Pc fence.token=34"}},
			fence.Credentials{Resource: "billing", Token: 34, Present: true}, "", []wire.Param{{Name: "options", Value: "-e -P"}}},
		{"clustered unknown fence setting", []wire.Param{{Name: "options", Value: "-ec fence.bogus=1"}}, fence.Credentials{}, fence.CodeMalformed, nil},
		{"unknown fence parameter, upper case", []wire.Param{{Name: "FENCE.X", Value: "3"}}, fence.Credentials{}, fence.CodeMalformed, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			st := &wire.Startup{Kind: wire.KindStartup, Version: wire.ProtocolVersion30, Params: tt.params}
			got, err := fence.FromStartup(st, known)
			if tt.code != "" {
				fe, ok := fence.IsFencing(err)
				if !ok || fe.Code != tt.code {
					t.Fatalf("got %v, want SQLSTATE %s", err, tt.code)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got != tt.want {
				t.Fatalf("got %+v, want %+v", got, tt.want)
			}
			if !reflect.DeepEqual(st.Params, tt.rest) && !(len(st.Params) == 0 && len(tt.rest) == 0) {
				t.Fatalf("left for the server: %+v, want %+v", st.Params, tt.rest)
			}
		})
	}
}

func TestErrorsIs(t *testing.T) {
	err := fmt.Errorf("wrapped: %w", fence.Stale("billing", 3, 4))
	if !errors.Is(err, fence.ErrStale) || errors.Is(err, fence.ErrNotHeld) {
		t.Fatal("errors.Is by SQLSTATE")
	}
	fe, ok := fence.IsFencing(err)
	if !ok || fe.Admitted != 4 || fe.Token != 3 {
		t.Fatalf("IsFencing: %+v", fe)
	}
}

func TestRegistry(t *testing.T) {
	r := fence.NewRegistry()
	var stale []int64
	var blocked []*fence.Error
	sub := r.Subscribe("app", "billing", 5, fence.Handler{
		Stale:   func(a int64) { stale = append(stale, a) },
		Blocked: func(e *fence.Error) { blocked = append(blocked, e) },
	})
	r.Observe("app", "billing", 4)
	r.Observe("app", "billing", 5)
	if len(stale) != 0 {
		t.Fatal("not stale at equal or lower tokens")
	}
	r.Observe("app", "billing", 7)
	r.Observe("app", "billing", 8)
	if !reflect.DeepEqual(stale, []int64{7}) {
		t.Fatalf("stale called %v, want once with 7", stale)
	}
	if r.Highest("app", "billing") != 8 || r.Highest("app", "payroll") != 0 {
		t.Fatal("Highest")
	}
	nh := fence.NotHeld("billing", 8)
	r.Block("billing", nh)
	if r.Blocked("billing") != nh {
		t.Fatal("Blocked")
	}
	r.Block("billing", nh) // the same error again: nobody is told twice
	r.Block("billing", nil)
	if len(blocked) != 2 || blocked[0] != nh || blocked[1] != nil {
		t.Fatalf("blocked %v", blocked)
	}
	r.Reset("app", "billing", 2)
	if r.Highest("app", "billing") != 2 {
		t.Fatal("Reset")
	}
	if r.Sessions("billing") != 1 {
		t.Fatalf("Sessions = %d, want 1", r.Sessions("billing"))
	}
	sub.Close()
	sub.Close() // idempotent
	if r.Sessions("billing") != 0 {
		t.Fatal("Close")
	}
	var nilSub *fence.Subscription
	nilSub.Close() // a session that never subscribed
	// A late subscriber with an old token hears it at once.
	var late int64
	r.Observe("app", "payroll", 9)
	r.Subscribe("app", "payroll", 3, fence.Handler{Stale: func(a int64) { late = a }}).Close()
	if late != 9 {
		t.Fatalf("late subscriber: %d", late)
	}
	// And of a block at once.
	r.Block("payroll", nh)
	var lateBlocked *fence.Error
	r.Subscribe("app", "payroll", 9, fence.Handler{Blocked: func(e *fence.Error) { lateBlocked = e }}).Close()
	if lateBlocked != nh {
		t.Fatalf("late subscriber of a blocked resource: %v", lateBlocked)
	}
}

// TestRegistryDatabases: every database has its own fence schema, so a raise observed in one
// never makes a session of another stale; an observation for database "" (what Consul says)
// applies to every database.
func TestRegistryDatabases(t *testing.T) {
	type observation struct {
		database string
		token    int64
	}
	type session struct {
		database string
		token    int64
	}
	sessions := []session{{"a", 5}, {"b", 5}, {"c", 7}}
	tests := []struct {
		name    string
		observe []observation
		want    []int64          // per session: the token its Stale heard (0: not told)
		highest map[string]int64 // per database, afterwards
	}{
		{"raise in a", []observation{{"a", 6}},
			[]int64{6, 0, 0}, map[string]int64{"a": 6, "b": 0, "c": 0, "d": 0}},
		{"far higher raise in b", []observation{{"b", 1 << 40}},
			[]int64{0, 1 << 40, 0}, map[string]int64{"a": 0, "b": 1 << 40, "c": 0}},
		{"raises in every database but their own", []observation{{"b", 9}, {"c", 9}, {"d", 9}},
			[]int64{0, 9, 9}, map[string]int64{"a": 0, "b": 9, "c": 9, "d": 9}},
		{"lower and equal raises", []observation{{"a", 5}, {"b", 4}, {"c", 7}},
			[]int64{0, 0, 0}, map[string]int64{"a": 5, "b": 4, "c": 7}},
		{"every database", []observation{{"", 6}},
			[]int64{6, 6, 0}, map[string]int64{"a": 6, "b": 6, "c": 6, "d": 6}},
		{"every database, then higher in one", []observation{{"", 6}, {"c", 8}},
			[]int64{6, 6, 8}, map[string]int64{"a": 6, "b": 6, "c": 8, "d": 6}},
		{"one database, then lower for every database", []observation{{"a", 9}, {"", 8}},
			[]int64{9, 8, 8}, map[string]int64{"a": 9, "b": 8, "c": 8, "d": 8}},
		{"Stale is told once, with the first higher token", []observation{{"a", 6}, {"", 10}, {"a", 11}},
			[]int64{6, 10, 10}, map[string]int64{"a": 11, "b": 10, "c": 10}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := fence.NewRegistry()
			got := make([]int64, len(sessions))
			calls := make([]int, len(sessions))
			for i, s := range sessions {
				sub := r.Subscribe(s.database, "billing", s.token, fence.Handler{Stale: func(a int64) { got[i] = a; calls[i]++ }})
				defer sub.Close()
			}
			// A session of another resource in the same database is never told.
			r.Subscribe("a", "payroll", 1, fence.Handler{Stale: func(a int64) { t.Errorf("payroll session told %d", a) }}).Close()
			other := r.Subscribe("a", "payroll", 1, fence.Handler{Stale: func(a int64) { t.Errorf("payroll session told %d", a) }})
			defer other.Close()
			for _, o := range tt.observe {
				r.Observe(o.database, "billing", o.token)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("sessions heard %v, want %v", got, tt.want)
			}
			for i, n := range calls {
				if n > 1 {
					t.Errorf("session %d told %d times", i, n)
				}
			}
			for db, want := range tt.highest {
				if h := r.Highest(db, "billing"); h != want {
					t.Errorf("Highest(%q) = %d, want %d", db, h, want)
				}
			}
			if h := r.Highest("a", "payroll"); h != 0 {
				t.Errorf("payroll's Highest = %d", h)
			}
		})
	}

	t.Run("late subscribers", func(t *testing.T) {
		r := fence.NewRegistry()
		r.Observe("a", "billing", 10)
		r.Observe("", "billing", 6)
		for _, s := range []struct {
			database string
			token    int64
			want     int64
		}{
			{"a", 9, 10}, {"a", 10, 0},
			{"b", 5, 6}, {"b", 6, 0}, {"b", 9, 0},
		} {
			var heard int64
			r.Subscribe(s.database, "billing", s.token, fence.Handler{Stale: func(a int64) { heard = a }}).Close()
			if heard != s.want {
				t.Errorf("subscriber of %q with %d heard %d, want %d", s.database, s.token, heard, s.want)
			}
		}
	})

	t.Run("reset", func(t *testing.T) {
		r := fence.NewRegistry()
		r.Observe("a", "billing", 10)
		r.Observe("b", "billing", 20)
		r.Observe("", "billing", 15)
		// fence.reset in database a: a's token is set, even lower; b keeps its own; what
		// Consul said is forgotten (the operator's way out of a LockIndex regression).
		r.Reset("a", "billing", 3)
		for db, want := range map[string]int64{"a": 3, "b": 20, "c": 0} {
			if h := r.Highest(db, "billing"); h != want {
				t.Errorf("after Reset, Highest(%q) = %d, want %d", db, h, want)
			}
		}
		var heard int64
		r.Subscribe("a", "billing", 3, fence.Handler{Stale: func(a int64) { heard = a }}).Close()
		if heard != 0 {
			t.Errorf("a session with the reset token heard %d", heard)
		}
	})

	t.Run("concurrent", func(t *testing.T) {
		// For the race detector: sessions come and go while raises arrive for every database.
		r := fence.NewRegistry()
		var wg sync.WaitGroup
		var told atomic.Int64
		for w := range 4 {
			db := fmt.Sprintf("db%d", w%2)
			wg.Go(func() {
				for i := range 200 {
					sub := r.Subscribe(db, "billing", int64(i), fence.Handler{Stale: func(int64) { told.Add(1) }})
					r.Observe(db, "billing", int64(i+1))
					if i%50 == 0 {
						r.Observe("", "billing", int64(i))
					}
					_ = r.Highest(db, "billing")
					sub.Close()
				}
			})
		}
		wg.Wait()
		if told.Load() == 0 {
			t.Fatal("no session was told")
		}
		if h := r.Highest("db0", "billing"); h != 200 {
			t.Fatalf("Highest = %d, want 200", h)
		}
		if n := r.Sessions("billing"); n != 0 {
			t.Fatalf("%d sessions left", n)
		}
	})
}

func TestParsePayload(t *testing.T) {
	tests := []struct {
		in    string
		res   string
		tok   int64
		reset bool
		bad   bool
	}{
		{"billing 34", "billing", 34, false, false},
		{"billing 3 reset", "billing", 3, true, false},
		{"billing", "", 0, false, true},
		{"billing x", "", 0, false, true},
		{"Billing 3", "", 0, false, true},
		{"billing 3 other", "", 0, false, true},
	}
	for _, tt := range tests {
		res, tok, reset, err := fence.ParsePayload(tt.in)
		if (err != nil) != tt.bad || res != tt.res || tok != tt.tok || reset != tt.reset {
			t.Errorf("%q: %q %d %v %v", tt.in, res, tok, reset, err)
		}
	}
}

func ExampleFromStartup() {
	st := &wire.Startup{Kind: wire.KindStartup, Version: wire.ProtocolVersion30, Params: []wire.Param{
		{Name: "user", Value: "app"},
		{Name: "options", Value: "-c fence.resource=billing -c fence.token=34"},
	}}
	c, err := fence.FromStartup(st, []string{"billing"})
	fmt.Println(c.Resource, c.Token, err, len(st.Params))
	// Output: billing 34 <nil> 1
}

// TestRegistryLeaders: the leader is the highest token known in any database; learning the
// first is not a change, each move up is one (and is reported), a lower or equal token is
// none; the holder is kept for the leader's token only; sessions are counted by token.
func TestRegistryLeaders(t *testing.T) {
	r := fence.NewRegistry()
	var changes []fence.Change
	r.SetOnChange(func(c fence.Change) { changes = append(changes, c) })
	r.Observe("app", "billing", 3)
	r.SetHolder("billing", 3, "sess-a")
	r.Subscribe("app", "billing", 3, fence.Handler{})
	r.Subscribe("app", "billing", 3, fence.Handler{})
	r.Observe("other", "billing", 2) // not above the leader
	l := r.Leaders()
	if len(l) != 1 || l[0].Token != 3 || l[0].Changes != 0 || l[0].Holder != "sess-a" || l[0].Sessions[3] != 2 || l[0].Since.IsZero() {
		t.Fatalf("leaders %+v", l)
	}
	r.Observe("", "billing", 5)
	r.SetHolder("billing", 4, "sess-old") // not the leader's token
	r.Subscribe("app", "billing", 5, fence.Handler{})
	l = r.Leaders()
	if l[0].Token != 5 || l[0].Changes != 1 || l[0].Holder != "" || l[0].Sessions[3] != 2 || l[0].Sessions[5] != 1 {
		t.Fatalf("leaders after a raise %+v", l)
	}
	if len(changes) != 1 || changes[0] != (fence.Change{Resource: "billing", From: 3, To: 5, At: changes[0].At}) {
		t.Fatalf("changes %+v", changes)
	}
	r.Reset("app", "billing", 1)
	if l = r.Leaders(); l[0].Token != 2 || l[0].Changes != 1 {
		t.Fatalf("leaders after a reset %+v (want the other database's 2)", l)
	}
}
