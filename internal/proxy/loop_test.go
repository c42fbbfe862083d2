//go:build linux

package proxy_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// The event loop (loop_linux.go) gives a session back to the goroutine relay in the middle
// of a message: the rest of it must follow, byte for byte, and the session go on.
func TestLoopHandBackMidMessage(t *testing.T) {
	if runtime.GOMAXPROCS(0) < 2 {
		t.Skip("the event loop needs GOMAXPROCS 2 or more") // CI has 2
	}
	pg, _ := fencedDB(t)
	p := fencedProxy(t, pg, func(c *proxy.Config) { c.Unfenced = proxy.UnfencedAllow; c.ShutdownGrace = 20 * time.Second })
	handBacks := func(reason string) float64 {
		return testutil.ToFloat64(p.Metrics.HandBacks.WithLabelValues(reason))
	}
	for _, params := range [][]string{nil, {"fence.resource", "billing", "fence.token", "1"}} {
		t.Run(fmt.Sprintf("fenced=%v", params != nil), func(t *testing.T) {
			// Server to client: a 32 MB row the client does not read at first, so that
			// the loop's write finds the client's socket full mid-row ("full"); the
			// goroutine relay writes the rest of the row.
			full := handBacks("full")
			r := dialRaw(t, proxyAddr(p))
			r.startup(wire.ProtocolVersion30, append([]string{"user", "app", "database", "postgres"}, params...)...)
			const n = 32 << 20
			r.send(&pgproto3.Query{String: fmt.Sprintf("SELECT repeat('x', %d) || 'end'", n)})
			eventually(t, 20*time.Second, "the loop finds the client's socket full", func() error {
				if handBacks("full") == full {
					return errors.New("no hand-back for a full socket")
				}
				return nil
			})
			var row []byte
			for {
				m, err := r.fe.Receive()
				if err != nil {
					t.Fatal(err)
				}
				if d, ok := m.(*pgproto3.DataRow); ok {
					row = bytes.Clone(d.Values[0])
				}
				if _, ok := m.(*pgproto3.ReadyForQuery); ok {
					break
				}
			}
			if len(row) != n+3 || strings.Count(string(row), "x") != n || !bytes.HasSuffix(row, []byte("end")) {
				t.Fatalf("the row came back with %d bytes, want %d x and end", len(row), n)
			}
			r.send(&pgproto3.Query{String: "SELECT 1"})
			if out, err := r.readUntil(1, ""); err != nil || !strings.Contains(strings.Join(out, " "), "DataRow") {
				t.Fatalf("the session after the row: %v %v", out, err)
			}
		})
	}

	// Client to server: half of a 2 MB query is relayed by the loop, then a shutdown
	// recalls the session ("recall"); the rest of the query follows, it is answered, and
	// the session ends as idle sessions of a proxy that shuts down do.
	recall := handBacks("recall")
	r := dialRaw(t, proxyAddr(p))
	r.startup(wire.ProtocolVersion30, "user", "app", "database", "postgres")
	const n = 2 << 20
	sql := fmt.Sprintf("SELECT length('%s')", strings.Repeat("y", n))
	msg := append([]byte{'Q'}, binary.BigEndian.AppendUint32(nil, uint32(4+len(sql)+1))...)
	msg = append(append(msg, sql...), 0)
	r.writeRaw(msg[:len(msg)/2])
	time.Sleep(200 * time.Millisecond) // the loop relays the first half
	stopped := make(chan struct{})
	go func() { p.Stop(t); close(stopped) }()
	eventually(t, 20*time.Second, "the shutdown recalls the session from the loop", func() error {
		if handBacks("recall") == recall {
			return errors.New("no recall")
		}
		return nil
	})
	r.writeRaw(msg[len(msg)/2:])
	got, err := receiveAll(r)
	if !isClosed(err) {
		t.Fatalf("after the answers: %v, want the connection closed", err)
	}
	if want := []string{fmt.Sprintf("row %d", n), "ready", "error " + wire.CodeAdminShutdown}; strings.Join(got, ", ") != strings.Join(want, ", ") {
		t.Fatalf("got %q, want %q", got, want)
	}
	<-stopped
}

// What a client sends with its startup, before it reads a byte (a pipelining driver), is
// relayed in order when the loop takes the session over, fenced (after the bind) or not.
func TestLoopPipelinedAfterStartup(t *testing.T) {
	pg, _ := fencedDB(t)
	p := fencedProxy(t, pg, func(c *proxy.Config) { c.Unfenced = proxy.UnfencedAllow })
	for _, params := range [][]string{nil, {"fence.resource", "billing", "fence.token", "1"}} {
		t.Run(fmt.Sprintf("fenced=%v", params != nil), func(t *testing.T) {
			r := dialRaw(t, proxyAddr(p))
			b := startupPacket(wire.ProtocolVersion30, append([]string{"user", "app", "database", "postgres"}, params...)...)
			for i := range 20 {
				b, _ = (&pgproto3.Query{String: fmt.Sprintf("SELECT %d", i)}).Encode(b)
			}
			b, _ = (&pgproto3.Terminate{}).Encode(b)
			r.writeRaw(b)
			got, err := receiveAll(r)
			if !isClosed(err) {
				t.Fatalf("after the answers: %v, want the connection closed", err)
			}
			want := []string{"ready"} // the startup's
			for i := range 20 {
				want = append(want, fmt.Sprintf("row %d", i), "ready")
			}
			if strings.Join(got, ", ") != strings.Join(want, ", ") {
				t.Fatalf("got %q, want %q", got, want)
			}
		})
	}
}

// receiveAll reads until the connection ends, and returns rows (their first value), errors
// (their SQLSTATE) and ReadyForQuery, in order.
func receiveAll(r *rawConn) ([]string, error) {
	var got []string
	for {
		m, err := r.fe.Receive()
		if err != nil {
			return got, err
		}
		switch m := m.(type) {
		case *pgproto3.DataRow:
			got = append(got, "row "+string(m.Values[0]))
		case *pgproto3.ErrorResponse:
			got = append(got, "error "+m.Code)
		case *pgproto3.ReadyForQuery:
			got = append(got, "ready")
		}
	}
}

// The review of the event loop (finding 1): a client wrote a complete query and the first
// bytes of its next message at once; the goroutine relay kept the query in its writer until
// the rest of the next message came, so the client never got its answer (16 of 16 with
// --relay goroutines, and with the loop after a hand-back). And queries written before a
// message the proxy refuses were never sent: the client got only the FATAL. PostgreSQL
// answers both at once. Both relays, fenced and not.
func TestPartialNextMessageDoesNotHoldTheQuery(t *testing.T) {
	pg, admin := fencedDB(t)
	const limit = 1 << 20
	for _, relay := range []string{"loop", "goroutines"} {
		p := fencedProxy(t, pg, func(c *proxy.Config) {
			c.Unfenced, c.Relay, c.MaxMessageSize = proxy.UnfencedAllow, relay, limit
		})
		for _, params := range [][]string{nil, {"fence.resource", "billing", "fence.token", "1"}} {
			t.Run(fmt.Sprintf("%s/fenced=%v", relay, params != nil), func(t *testing.T) {
				next, _ := (&pgproto3.Query{String: "SELECT 2"}).Encode(nil)
				for cut := 1; cut < len(next); cut++ {
					r := dialRaw(t, proxyAddr(p))
					r.startup(wire.ProtocolVersion30, append([]string{"user", "app", "database", "postgres"}, params...)...)
					b, _ := (&pgproto3.Query{String: "SELECT 1"}).Encode(nil)
					r.conn.SetDeadline(time.Now().Add(5 * time.Second)) //nolint:errcheck
					r.writeRaw(append(b, next[:cut]...))
					if out, err := r.readUntil(1, ""); err != nil {
						t.Fatalf("cut %d: no answer to the whole query: %v (after %q)", cut, err, out)
					}
					r.conn.SetDeadline(time.Now().Add(5 * time.Second)) //nolint:errcheck
					r.writeRaw(next[cut:])
					if out, err := r.readUntil(1, ""); err != nil || !strings.Contains(strings.Join(out, " "), `"2"`) {
						t.Fatalf("cut %d: the second query: %q %v", cut, out, err)
					}
					r.conn.Close()
				}

				// Two INSERTs and a message above the limit in one write: the INSERTs are
				// answered (and committed), then the FATAL.
				tag := fmt.Sprintf("refused %s %v", relay, params != nil)
				var b []byte
				for range 2 {
					b, _ = (&pgproto3.Query{String: fmt.Sprintf("INSERT INTO items (tag) VALUES ('%s')", tag)}).Encode(b)
				}
				b = append(b, 'Q')
				b = binary.BigEndian.AppendUint32(b, limit+100)
				r := dialRaw(t, proxyAddr(p))
				r.startup(wire.ProtocolVersion30, append([]string{"user", "app", "database", "postgres"}, params...)...)
				r.writeRaw(b)
				got, err := receiveAll(r)
				if !isClosed(err) {
					t.Fatalf("after the answers: %v, want the connection closed", err)
				}
				if want := "ready, ready, error " + wire.CodeProgramLimitExceeded; strings.Join(got, ", ") != want {
					t.Fatalf("got %q, want %s", got, want)
				}
				if n := count(t, admin, `SELECT count(*) FROM items WHERE tag = $1`, tag); n != 2 {
					t.Fatalf("%d rows committed, want 2", n)
				}
			})
		}
	}
}
