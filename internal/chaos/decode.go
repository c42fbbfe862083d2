package chaos

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/history"
)

// The history's commit order comes from PostgreSQL's own write-ahead log, through a logical
// decoding slot (test_decoding, shipped with PostgreSQL): every committed transaction comes
// out once, whole, in the order of its commit record, and the COMMIT line carries the end
// LSN of that record. That LSN is the commit position of every change in the transaction. A
// raise is a change of the resource's row in fence.tokens (written by fence.raise,
// fence.bind's raise or fence.reset); a write is a row of the workload's ledger, with the
// token its backend was bound to (stamped by a trigger from fence.bindings) or, unbound,
// the token the client labelled it with. Transactions that rolled back never reach the
// log's decoded stream, so neither do their raises.

const slotName = "chaos_history"

// eraShift places a primary's commit LSNs above those of the primaries before it (an LSN
// of a test cluster stays far below 2^48).
const eraShift = 48

// era is the primary (0: the first; one more at each failover) that committed at pos.
func era(pos uint64) uint64 { return pos >> eraShift }

// decoder turns the slot's changes into history records.
type decoder struct {
	database, resource string
	era                uint64
	seen               map[uint64]bool // positions already read: after a crash a slot may repeat
	raises             []history.Raise
	writes             []history.Write
	lost               []history.Write // committed on a primary after its switch point: lost with it
}

func newDecoder(database, resource string) *decoder {
	return &decoder{database: database, resource: resource, seen: map[uint64]bool{}}
}

// createSlot creates the slot in the database conn is connected to.
func createSlot(ctx context.Context, conn *pgx.Conn) error {
	_, err := conn.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'test_decoding')`, slotName)
	return err
}

// read consumes what the slot of the current era's primary holds.
func (d *decoder) read(ctx context.Context, conn *pgx.Conn) error {
	lines, err := slotChanges(ctx, conn)
	if err != nil {
		return err
	}
	return d.parse(lines)
}

// drain reads what is left in the slot of the current era's primary, which a failover
// replaced by a standby whose timeline switched at switchLSN, moves its writes after the
// switch point to the lost ones, and starts the next era (whose primary must have a new
// slot, made before any client commit there).
func (d *decoder) drain(ctx context.Context, conn *pgx.Conn, switchLSN uint64) error {
	if err := d.read(ctx, conn); err != nil {
		return err
	}
	d.endEra(switchLSN)
	return nil
}

// endEra moves the current era's writes after switchLSN to the lost ones and starts the
// next era.
func (d *decoder) endEra(switchLSN uint64) {
	cut := d.era<<eraShift | switchLSN
	d.writes = slices.DeleteFunc(d.writes, func(w history.Write) bool {
		if era(w.Pos) == d.era && w.Pos > cut {
			d.lost = append(d.lost, w)
			return true
		}
		return false
	})
	d.era++
}

func slotChanges(ctx context.Context, conn *pgx.Conn) ([][2]string, error) {
	rows, err := conn.Query(ctx, `SELECT lsn::text, data FROM pg_logical_slot_get_changes($1, NULL, NULL, 'skip-empty-xacts', '1')`, slotName)
	if err != nil {
		return nil, err
	}
	var lines [][2]string
	for rows.Next() {
		var lsn, data string
		if err := rows.Scan(&lsn, &data); err != nil {
			rows.Close()
			return nil, err
		}
		lines = append(lines, [2]string{lsn, data})
	}
	return lines, rows.Err()
}

// parse reads test_decoding's lines (LSN, data): BEGIN, table changes, COMMIT.
func (d *decoder) parse(lines [][2]string) error {
	var raises []history.Raise
	var writes []history.Write
	for _, l := range lines {
		data := l[1]
		switch {
		case data == "BEGIN" || strings.HasPrefix(data, "BEGIN "):
			raises, writes = nil, nil
		case data == "COMMIT" || strings.HasPrefix(data, "COMMIT "):
			lsn, err := pgLSN(l[0])
			if err != nil {
				return err
			}
			lsn |= d.era << eraShift
			if d.seen[lsn] {
				continue
			}
			d.seen[lsn] = true
			for _, r := range raises {
				r.Pos = lsn
				d.raises = append(d.raises, r)
			}
			for _, w := range writes {
				w.Pos = lsn
				d.writes = append(d.writes, w)
			}
			raises, writes = nil, nil
		case strings.HasPrefix(data, "table fence.tokens: INSERT: "), strings.HasPrefix(data, "table fence.tokens: UPDATE: "):
			cols := columns(data)
			if cols["resource"] != d.resource {
				continue
			}
			token, err := strconv.ParseInt(cols["token"], 10, 64)
			if err != nil {
				return fmt.Errorf("decode %q: token: %w", data, err)
			}
			raises = append(raises, history.Raise{Database: d.database, Resource: d.resource, Token: token})
		case strings.HasPrefix(data, "table public.ledger: INSERT: "):
			cols := columns(data)
			token, err := nullableInt(cols["bound_token"])
			if err == nil && token == 0 {
				token, err = nullableInt(cols["token"])
			}
			if err != nil {
				return fmt.Errorf("decode %q: %w", data, err)
			}
			writes = append(writes, history.Write{Database: d.database, Resource: d.resource, Token: token,
				Unit: cols["unit_id"], Attempt: cols["attempt"]})
		}
	}
	return nil
}

// column: name[type]:value, value a quoted literal (quotes doubled) or a bare word.
var column = regexp.MustCompile(`(\w+)\[[^\]]+\]:('(?:[^']|'')*'|\S+)`)

func columns(data string) map[string]string {
	out := map[string]string{}
	for _, m := range column.FindAllStringSubmatch(data, -1) {
		v := m[2]
		if len(v) >= 2 && strings.HasPrefix(v, "'") && strings.HasSuffix(v, "'") {
			v = strings.ReplaceAll(v[1:len(v)-1], "''", "'")
		}
		out[m[1]] = v
	}
	return out
}

func nullableInt(v string) (int64, error) {
	if v == "" || v == "null" {
		return 0, nil
	}
	return strconv.ParseInt(v, 10, 64)
}

// pgLSN parses PostgreSQL's X/Y form.
func pgLSN(s string) (uint64, error) {
	hi, lo, ok := strings.Cut(s, "/")
	if !ok {
		return 0, fmt.Errorf("lsn %q", s)
	}
	h, err1 := strconv.ParseUint(hi, 16, 32)
	l, err2 := strconv.ParseUint(lo, 16, 32)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("lsn %q", s)
	}
	return h<<32 | l, nil
}
