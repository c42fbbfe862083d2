package fence_test

import (
	"errors"
	"fmt"
	"reflect"
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
	sub := r.Subscribe("billing", 5, fence.Handler{
		Stale:   func(a int64) { stale = append(stale, a) },
		Blocked: func(e *fence.Error) { blocked = append(blocked, e) },
	})
	r.Observe("billing", 4)
	r.Observe("billing", 5)
	if len(stale) != 0 {
		t.Fatal("not stale at equal or lower tokens")
	}
	r.Observe("billing", 7)
	r.Observe("billing", 8)
	if !reflect.DeepEqual(stale, []int64{7}) {
		t.Fatalf("stale called %v, want once with 7", stale)
	}
	if r.Highest("billing") != 8 || r.Highest("payroll") != 0 {
		t.Fatal("Highest")
	}
	nh := fence.NotHeld("billing", 8)
	r.Block("billing", nh)
	r.Block("billing", nil)
	if len(blocked) != 2 || blocked[0] != nh || blocked[1] != nil {
		t.Fatalf("blocked %v", blocked)
	}
	r.Reset("billing", 2)
	if r.Highest("billing") != 2 {
		t.Fatal("Reset")
	}
	sub.Close()
	if r.Sessions("billing") != 0 {
		t.Fatal("Close")
	}
	// A late subscriber with an old token hears it at once.
	var late int64
	r.Observe("payroll", 9)
	r.Subscribe("payroll", 3, fence.Handler{Stale: func(a int64) { late = a }}).Close()
	if late != 9 {
		t.Fatalf("late subscriber: %d", late)
	}
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
