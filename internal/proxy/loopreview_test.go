package proxy_test

import (
	"encoding/binary"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

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

// The review of the event loop (finding 2): when the shutdown grace ran out, a client whose
// statement was running was told 57P01 "terminating connection", and its INSERT committed
// 6 s later (closing the server connection does not stop a running statement); a client
// that retries on 57P01 writes twice. Now the statement is cancelled, and the client gets
// the cancel's answer before the end, or is told that its outcome is unknown (08007).
func TestShutdownCancelsTheStatementInFlight(t *testing.T) {
	pg, admin := fencedDB(t)
	for _, relay := range []string{"loop", "goroutines"} {
		t.Run(relay, func(t *testing.T) {
			p := fencedProxy(t, pg, func(c *proxy.Config) {
				c.Unfenced, c.Relay, c.ShutdownGrace = proxy.UnfencedAllow, relay, 300*time.Millisecond
			})
			tag := "shutdown " + relay
			r := dialRaw(t, proxyAddr(p))
			r.startup(wire.ProtocolVersion30, "user", "app", "database", "postgres", "fence.resource", "billing", "fence.token", "1")
			r.send(&pgproto3.Query{String: fmt.Sprintf("INSERT INTO items (tag) SELECT '%s' FROM pg_sleep(5)", tag)})
			time.Sleep(300 * time.Millisecond) // running
			stopped := make(chan struct{})
			go func() { p.Stop(t); close(stopped) }()
			defer func() { <-stopped }()
			got, err := receiveAll(r)
			if !isClosed(err) {
				t.Fatalf("after the error: %v, want the connection closed", err)
			}
			// The cancel's own answer, then the end of an idle session; or, when the
			// answer does not come in time, the unknown outcome.
			cancelled := "error " + wire.CodeQueryCanceled + ", ready, error " + wire.CodeAdminShutdown
			if g := strings.Join(got, ", "); g != cancelled && g != "error "+wire.CodeResolutionUnknown {
				t.Fatalf("got %q, want %s or %s", got, cancelled, wire.CodeResolutionUnknown)
			}
			deadline := time.Now().Add(15 * time.Second)
			for count(t, admin, `SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'INSERT INTO items%'`) > 0 {
				if time.Now().After(deadline) {
					t.Fatal("the statement still runs 15 s after the proxy's end")
				}
				time.Sleep(50 * time.Millisecond)
			}
			if n := count(t, admin, `SELECT count(*) FROM items WHERE tag = $1`, tag); n != 0 {
				t.Fatalf("the cancelled INSERT committed %d rows", n)
			}
		})
	}
}
