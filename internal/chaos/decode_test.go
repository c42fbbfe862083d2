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
