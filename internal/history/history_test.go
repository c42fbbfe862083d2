package history_test

import (
	"fmt"
	"slices"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/history"
)

const db, res = "app", "billing"

func raise(token int64, pos uint64) history.Raise {
	return history.Raise{Database: db, Resource: res, Token: token, Pos: pos}
}

func write(unit string, token int64, pos uint64) history.Write {
	return history.Write{Database: db, Resource: res, Token: token, Unit: unit, Attempt: fmt.Sprintf("%s@%d", unit, pos), Pos: pos}
}

func ack(w history.Write) history.Outcome {
	return history.Outcome{Attempt: w.Attempt, Unit: w.Unit, Token: w.Token, Result: history.Acked}
}

func TestCheck(t *testing.T) {
	rolledBack := raise(9, 15)
	rolledBack.RolledBack = true
	otherDB := write("u2", 1, 30)
	otherDB.Database = "other"
	otherRes := write("u3", 1, 30)
	otherRes.Resource = "payroll"

	tests := []struct {
		name string
		h    history.History
		want []history.Violation // only Kind and Unit are compared
	}{
		{name: "empty"},
		{
			name: "each leader writes before the next raise",
			h: history.History{
				Raises:   []history.Raise{raise(1, 10), raise(2, 20), raise(3, 30)},
				Writes:   []history.Write{write("u1", 1, 11), write("u2", 1, 19), write("u3", 2, 21), write("u4", 3, 31)},
				Required: []string{"u1", "u2", "u3", "u4"},
			},
		},
		{
			name: "stale commit after a raise",
			h: history.History{
				Raises: []history.Raise{raise(1, 10), raise(2, 20)},
				Writes: []history.Write{write("u1", 1, 11), write("u2", 1, 25), write("u3", 2, 21)},
			},
			want: []history.Violation{{Kind: history.StaleCommit, Unit: "u2"}},
		},
		{
			name: "stale by more than one token",
			h: history.History{
				Raises: []history.Raise{raise(1, 10), raise(5, 20)},
				Writes: []history.Write{write("u1", 3, 21)},
			},
			want: []history.Violation{{Kind: history.StaleCommit, Unit: "u1"}},
		},
		{
			name: "input out of order is sorted by position",
			h: history.History{
				Raises: []history.Raise{raise(2, 20), raise(1, 10)},
				Writes: []history.Write{write("u2", 1, 25), write("u1", 1, 11)},
			},
			want: []history.Violation{{Kind: history.StaleCommit, Unit: "u2"}},
		},
		{
			name: "write at the raise's own position is not after it",
			h: history.History{
				Raises: []history.Raise{raise(1, 10), raise(2, 20)},
				Writes: []history.Write{write("u1", 1, 20)},
			},
		},
		{
			name: "write one position after the raise is",
			h: history.History{
				Raises: []history.Raise{raise(2, 20)},
				Writes: []history.Write{write("u1", 1, 21)},
			},
			want: []history.Violation{{Kind: history.StaleCommit, Unit: "u1"}},
		},
		{
			name: "a raise that rolled back admitted nothing",
			h: history.History{
				Raises: []history.Raise{raise(1, 10), rolledBack},
				Writes: []history.Write{write("u1", 1, 20)},
			},
		},
		{
			name: "an equal token is not stale",
			h: history.History{
				Raises: []history.Raise{raise(2, 10), raise(2, 20)},
				Writes: []history.Write{write("u1", 2, 30)},
			},
		},
		{
			name: "a write without a token after a raise is stale",
			h: history.History{
				Raises: []history.Raise{raise(1, 10)},
				Writes: []history.Write{write("u1", 0, 11)},
			},
			want: []history.Violation{{Kind: history.StaleCommit, Unit: "u1"}},
		},
		{
			name: "raises of another database or resource do not count",
			h: history.History{
				Raises: []history.Raise{raise(5, 10)},
				Writes: []history.Write{otherDB, otherRes},
			},
		},
		{
			name: "a unit done twice",
			h: history.History{
				Raises:   []history.Raise{raise(1, 10), raise(2, 20)},
				Writes:   []history.Write{write("u1", 1, 11), write("u1", 2, 21)},
				Required: []string{"u1"},
			},
			want: []history.Violation{{Kind: history.Duplicate, Unit: "u1"}},
		},
		{
			name: "a stale duplicate is both",
			h: history.History{
				Raises: []history.Raise{raise(1, 10), raise(2, 20)},
				Writes: []history.Write{write("u1", 2, 21), write("u1", 1, 22)},
			},
			want: []history.Violation{{Kind: history.StaleCommit, Unit: "u1"}, {Kind: history.Duplicate, Unit: "u1"}},
		},
		{
			name: "a required unit never done",
			h: history.History{
				Writes:   []history.Write{write("u1", 1, 11)},
				Required: []string{"u1", "u2", "u2"},
			},
			want: []history.Violation{{Kind: history.Missing, Unit: "u2"}},
		},
		{
			name: "an acknowledged write missing",
			h: history.History{
				Writes:   []history.Write{write("u1", 1, 11)},
				Outcomes: []history.Outcome{ack(write("u1", 1, 11)), ack(write("u2", 1, 12))},
			},
			want: []history.Violation{{Kind: history.LostAck, Unit: "u2"}},
		},
		{
			name: "unknown and failed outcomes decide nothing",
			h: history.History{
				Raises: []history.Raise{raise(1, 10), raise(2, 20)},
				// u1's COMMIT answer was lost but it committed before the raise; u2's
				// attempt failed and did not commit; u3's failed with ZF001 after its
				// COMMIT was sent, and committed before the raise anyway.
				Writes: []history.Write{write("u1", 1, 12), write("u3", 1, 13), write("u2", 2, 21)},
				Outcomes: []history.Outcome{
					{Attempt: "u1@12", Unit: "u1", Token: 1, Result: history.Unknown},
					{Attempt: "u2-first", Unit: "u2", Token: 1, Result: history.Failed, SQLState: "ZF001"},
					{Attempt: "u3@13", Unit: "u3", Token: 1, Result: history.Failed, SQLState: "ZF001"},
					ack(write("u2", 2, 21)),
				},
				Required: []string{"u1", "u2", "u3"},
			},
		},
		{
			name: "an unknown outcome that never committed leaves the unit missing",
			h: history.History{
				Outcomes: []history.Outcome{{Attempt: "a", Unit: "u1", Token: 1, Result: history.Unknown}},
				Required: []string{"u1"},
			},
			want: []history.Violation{{Kind: history.Missing, Unit: "u1"}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := history.Check(tt.h)
			type key struct {
				Kind history.Kind
				Unit string
			}
			var g, w []key
			for _, v := range got {
				g = append(g, key{v.Kind, v.Unit})
			}
			for _, v := range tt.want {
				w = append(w, key{v.Kind, v.Unit})
			}
			if !slices.Equal(g, w) {
				t.Errorf("Check: got %v, want %v", got, w)
			}
		})
	}
}

func TestStaleCommitNamesTheRaise(t *testing.T) {
	vs := history.Check(history.History{
		Raises: []history.Raise{raise(2, 20), raise(3, 30)},
		Writes: []history.Write{write("u1", 1, 40)},
	})
	if len(vs) != 1 || vs[0].Raise == nil || vs[0].Raise.Token != 2 || vs[0].Raise.Pos != 20 {
		t.Fatalf("got %+v, want one stale commit naming the raise to 2 at 20", vs)
	}
	if n := history.Count(vs); n[history.StaleCommit] != 1 {
		t.Errorf("Count: %v", n)
	}
}

func ExampleCheck() {
	h := history.History{
		Raises: []history.Raise{{Database: "app", Resource: "billing", Token: 2, Pos: 200}},
		Writes: []history.Write{
			{Database: "app", Resource: "billing", Token: 2, Unit: "7", Attempt: "b-1", Pos: 210},
			{Database: "app", Resource: "billing", Token: 1, Unit: "7", Attempt: "a-1", Pos: 220},
		},
		Required: []string{"7"},
	}
	for _, v := range history.Check(h) {
		fmt.Println(v)
	}
	// Output:
	// stale-commit: app/billing: write of unit 7 (attempt a-1) under token 1 committed at 220, after the raise to token 2 committed at 200
	// duplicate: unit 7 committed 2 times (tokens [2 1])
}

func TestOutcomeJSON(t *testing.T) {
	for _, r := range []history.Result{history.Unknown, history.Acked, history.Failed} {
		b, err := r.MarshalText()
		if err != nil {
			t.Fatal(err)
		}
		var back history.Result
		if err := back.UnmarshalText(b); err != nil || back != r {
			t.Errorf("%v: round trip gave %v, %v", r, back, err)
		}
	}
	var r history.Result
	if err := r.UnmarshalText([]byte("maybe")); err == nil {
		t.Error("UnmarshalText accepted maybe")
	}
}
