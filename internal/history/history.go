package history

import (
	"cmp"
	"fmt"
	"slices"
	"time"
)

// Raise is an attempt to admit Token for Resource in Database, at commit position Pos.
type Raise struct {
	Database   string
	Resource   string
	Token      int64
	Pos        uint64
	RolledBack bool // the raise's transaction aborted: it admitted nothing
}

// Write is a committed write of one unit of work under Token, at commit position Pos.
type Write struct {
	Database string
	Resource string
	Token    int64  // the token the writing session was bound to (0: none)
	Unit     string // the unit of work it does
	Attempt  string // the client's attempt that made it (links it to an Outcome)
	Pos      uint64
}

// Result is what a client saw of an attempt.
type Result int

// Results.
const (
	Unknown Result = iota // the answer was lost (connection ended, process killed)
	Acked                 // COMMIT answered success
	Failed                // an error with a SQLSTATE
)

func (r Result) String() string {
	switch r {
	case Acked:
		return "acknowledged"
	case Failed:
		return "error"
	default:
		return "unknown"
	}
}

// MarshalText writes the Result's name, for clients that record outcomes as JSON lines.
func (r Result) MarshalText() ([]byte, error) { return []byte(r.String()), nil }

// UnmarshalText reads a name MarshalText wrote.
func (r *Result) UnmarshalText(b []byte) error {
	switch string(b) {
	case "acknowledged":
		*r = Acked
	case "error":
		*r = Failed
	case "unknown":
		*r = Unknown
	default:
		return fmt.Errorf("history: result %q: want acknowledged, error or unknown", b)
	}
	return nil
}

// Outcome is a client's view of one attempt. The JSON form is what the chaos workload's
// replicas write, one object a line.
type Outcome struct {
	Attempt  string    `json:"attempt"`
	Unit     string    `json:"unit"`
	Token    int64     `json:"token"`
	Result   Result    `json:"result"`
	SQLState string    `json:"sqlstate,omitempty"` // with Failed
	At       time.Time `json:"at"`                 // when the client saw it (its own clock)
}

// History is a campaign's record. Required lists the units that must each be done exactly
// once; a unit written but not listed must still not be written twice.
type History struct {
	Raises   []Raise
	Writes   []Write
	Outcomes []Outcome
	Required []string
}

// Kind names a violation.
type Kind string

// Kinds of violation.
const (
	StaleCommit Kind = "stale-commit"
	Duplicate   Kind = "duplicate"
	Missing     Kind = "missing"
	LostAck     Kind = "lost-ack"
)

// Violation is one broken rule, with the records that show it.
type Violation struct {
	Kind   Kind
	Unit   string
	Writes []Write // the offending writes (StaleCommit: one; Duplicate: all of the unit's)
	Raise  *Raise  // StaleCommit: the earliest raise it came after
	Detail string
}

func (v Violation) String() string { return string(v.Kind) + ": " + v.Detail }

type scope struct{ database, resource string }

// Check returns every violation in h, in a stable order: stale commits by position, then
// duplicates, missing units and lost acknowledgements by unit.
func Check(h History) []Violation {
	var out []Violation

	// For each (database, resource), the committed raises by position, so that the first
	// raise to a higher token before a write is found by one walk.
	raises := map[scope][]Raise{}
	for _, r := range h.Raises {
		if r.RolledBack {
			continue
		}
		k := scope{r.Database, r.Resource}
		raises[k] = append(raises[k], r)
	}
	for _, rs := range raises {
		slices.SortStableFunc(rs, func(a, b Raise) int { return cmp.Compare(a.Pos, b.Pos) })
	}
	writes := slices.Clone(h.Writes)
	slices.SortStableFunc(writes, func(a, b Write) int { return cmp.Compare(a.Pos, b.Pos) })
	for _, w := range writes {
		for i := range raises[scope{w.Database, w.Resource}] {
			r := &raises[scope{w.Database, w.Resource}][i]
			if r.Pos >= w.Pos {
				break // same position: one transaction, not after
			}
			if r.Token > w.Token {
				rr := *r
				out = append(out, Violation{
					Kind: StaleCommit, Unit: w.Unit, Writes: []Write{w}, Raise: &rr,
					Detail: fmt.Sprintf("%s/%s: write of unit %s (attempt %s) under token %d committed at %d, after the raise to token %d committed at %d",
						w.Database, w.Resource, w.Unit, w.Attempt, w.Token, w.Pos, r.Token, r.Pos),
				})
				break
			}
		}
	}

	byUnit := map[string][]Write{}
	var units []string
	for _, w := range writes {
		if _, seen := byUnit[w.Unit]; !seen {
			units = append(units, w.Unit)
		}
		byUnit[w.Unit] = append(byUnit[w.Unit], w)
	}
	slices.Sort(units)
	for _, u := range units {
		if ws := byUnit[u]; len(ws) > 1 {
			out = append(out, Violation{Kind: Duplicate, Unit: u, Writes: ws,
				Detail: fmt.Sprintf("unit %s committed %d times (tokens %v)", u, len(ws), tokens(ws))})
		}
	}
	required := slices.Clone(h.Required)
	slices.Sort(required)
	for _, u := range slices.Compact(required) {
		if len(byUnit[u]) == 0 {
			out = append(out, Violation{Kind: Missing, Unit: u, Detail: fmt.Sprintf("unit %s was never committed", u)})
		}
	}

	committed := map[string]bool{}
	for _, w := range writes {
		committed[w.Attempt] = true
	}
	outcomes := slices.Clone(h.Outcomes)
	slices.SortStableFunc(outcomes, func(a, b Outcome) int {
		return cmp.Or(cmp.Compare(a.Unit, b.Unit), cmp.Compare(a.Attempt, b.Attempt))
	})
	for _, o := range outcomes {
		if o.Result == Acked && !committed[o.Attempt] {
			out = append(out, Violation{Kind: LostAck, Unit: o.Unit,
				Detail: fmt.Sprintf("attempt %s (unit %s, token %d) was acknowledged but no write of it committed", o.Attempt, o.Unit, o.Token)})
		}
	}
	return out
}

func tokens(ws []Write) []int64 {
	t := make([]int64, len(ws))
	for i, w := range ws {
		t[i] = w.Token
	}
	return t
}

// Count returns how many violations of each kind vs holds.
func Count(vs []Violation) map[Kind]int {
	n := map[Kind]int{}
	for _, v := range vs {
		n[v.Kind]++
	}
	return n
}
