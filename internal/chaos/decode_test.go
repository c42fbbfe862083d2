package chaos

import (
	"slices"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/history"
)

func TestDecoderParse(t *testing.T) {
	lines := [][2]string{
		{"0/100", "BEGIN"},
		{"0/110", "table fence.tokens: INSERT: resource[text]:'ledger' token[bigint]:0 updated_at[timestamp with time zone]:'2026-12-02 01:00:00+00'"},
		{"0/120", "table fence.tokens: UPDATE: resource[text]:'ledger' token[bigint]:4 updated_at[timestamp with time zone]:'2026-12-02 01:00:00+00'"},
		{"0/130", "COMMIT"},
		{"0/140", "BEGIN"},
		{"0/150", "table fence.tokens: UPDATE: resource[text]:'other' token[bigint]:9 updated_at[timestamp with time zone]:'x'"},
		{"0/160", "table public.ledger: INSERT: id[bigint]:1 unit_id[bigint]:7 token[bigint]:3 bound_token[bigint]:4 attempt[text]:'r1-1-1' replica[text]:'r1'"},
		{"0/170", "table public.units: UPDATE: id[bigint]:7 round[integer]:1 done[boolean]:true"},
		{"1/A0", "COMMIT"},
		{"1/B0", "BEGIN"},
		{"1/C0", "table public.ledger: INSERT: id[bigint]:2 unit_id[bigint]:8 token[bigint]:3 bound_token[bigint]:null attempt[text]:'it''s' replica[text]:'r2'"},
		{"1/D0", "COMMIT"},
		// Repeated after a crash: read once.
		{"1/B0", "BEGIN"},
		{"1/C0", "table public.ledger: INSERT: id[bigint]:2 unit_id[bigint]:8 token[bigint]:3 bound_token[bigint]:null attempt[text]:'it''s' replica[text]:'r2'"},
		{"1/D0", "COMMIT"},
	}
	d := newDecoder("ledger", "ledger")
	if err := d.parse(lines); err != nil {
		t.Fatal(err)
	}
	wantRaises := []history.Raise{
		{Database: "ledger", Resource: "ledger", Token: 0, Pos: 0x130},
		{Database: "ledger", Resource: "ledger", Token: 4, Pos: 0x130},
	}
	wantWrites := []history.Write{
		{Database: "ledger", Resource: "ledger", Token: 4, Unit: "7", Attempt: "r1-1-1", Pos: 1<<32 | 0xA0},
		{Database: "ledger", Resource: "ledger", Token: 3, Unit: "8", Attempt: "it's", Pos: 1<<32 | 0xD0},
	}
	if !slices.Equal(d.raises, wantRaises) {
		t.Errorf("raises: got %+v, want %+v", d.raises, wantRaises)
	}
	if !slices.Equal(d.writes, wantWrites) {
		t.Errorf("writes: got %+v, want %+v", d.writes, wantWrites)
	}
}

// FuzzDecoderParse: whatever test_decoding prints, the parser returns an error or records,
// never panics, and records only committed transactions' changes.
func FuzzDecoderParse(f *testing.F) {
	f.Add("0/10", "table public.ledger: INSERT: id[bigint]:1 unit_id[bigint]:7 token[bigint]:3 bound_token[bigint]:null attempt[text]:'a''b' replica[text]:'r1'")
	f.Add("0/10", "table fence.tokens: UPDATE: resource[text]:'ledger' token[bigint]:4")
	f.Add("1/FFFFFFFF", "table fence.tokens: INSERT: resource[text]:'ledger' token[bigint]:x")
	f.Fuzz(func(t *testing.T, lsn, data string) {
		d := newDecoder("ledger", "ledger")
		_ = d.parse([][2]string{{"0/1", "BEGIN"}, {lsn, data}})
		if len(d.raises) != 0 || len(d.writes) != 0 {
			t.Fatalf("records without a COMMIT: %+v %+v", d.raises, d.writes)
		}
		_ = d.parse([][2]string{{"0/1", "BEGIN"}, {"0/2", data}, {lsn, "COMMIT"}})
	})
}

// TestDecoderAcrossFailover: the old primary's commits after the new timeline's switch
// point are lost (a lost write is no write; a lost raise still counts), and the checker
// finds what a failover lets through: a write under a lower token on the new primary after
// a raise the old primary committed and lost, and an acknowledged attempt whose write was
// lost. Redoing a lost write's unit is no duplicate.
func TestDecoderAcrossFailover(t *testing.T) {
	write := func(lsn, unit, token, attempt string) [][2]string {
		return [][2]string{{lsn, "BEGIN"},
			{lsn, "table public.ledger: INSERT: id[bigint]:1 unit_id[bigint]:" + unit + " token[bigint]:" + token + " bound_token[bigint]:null attempt[text]:'" + attempt + "' replica[text]:'r1'"},
			{lsn, "COMMIT"}}
	}
	raise := func(lsn, token string) [][2]string {
		return [][2]string{{lsn, "BEGIN"}, {lsn, "table fence.tokens: UPDATE: resource[text]:'ledger' token[bigint]:" + token}, {lsn, "COMMIT"}}
	}
	d := newDecoder("ledger", "ledger")
	// The old primary: raise 5, unit 1 (replicated); raise 6 and unit 2 under 6 after the
	// switch point 0/250 (lost).
	if err := d.parse(slices.Concat(raise("0/100", "5"), write("0/200", "1", "5", "a1"), raise("0/300", "6"), write("0/400", "2", "6", "a2"))); err != nil {
		t.Fatal(err)
	}
	d.endEra(0x250)
	// The new primary (its positions start at the switch point): unit 3 under 5, the stale
	// leader; unit 2 again under 6, the leader's retry.
	if err := d.parse(slices.Concat(write("0/260", "3", "5", "a3"), raise("0/270", "6"), write("0/280", "2", "6", "a4"))); err != nil {
		t.Fatal(err)
	}
	if len(d.lost) != 1 || d.lost[0].Attempt != "a2" {
		t.Fatalf("lost writes: got %+v, want a2's", d.lost)
	}
	acked := func(attempt, unit string, token int64) history.Outcome {
		return history.Outcome{Attempt: attempt, Unit: unit, Token: token, Result: history.Acked}
	}
	vs := history.Check(history.History{Raises: d.raises, Writes: d.writes, Required: []string{"1", "2", "3"},
		Outcomes: []history.Outcome{acked("a1", "1", 5), acked("a2", "2", 6), acked("a3", "3", 5), acked("a4", "2", 6)}})
	n := history.Count(vs)
	if len(vs) != 2 || n[history.StaleCommit] != 1 || n[history.LostAck] != 1 {
		t.Fatalf("violations: got %v, want one stale commit (unit 3) and one lost acknowledgement (a2)", vs)
	}
	for _, v := range vs {
		if v.Kind == history.StaleCommit && (v.Unit != "3" || era(v.Raise.Pos) != 0 || era(v.Writes[0].Pos) != 1) {
			t.Errorf("stale commit: got %v (raise era %d, write era %d), want unit 3's after the lost raise", v, era(v.Raise.Pos), era(v.Writes[0].Pos))
		}
	}
}
