package proxy_test

import (
	"fmt"
	"net"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// TestClientDoneAnswersFirst: a client that sends its last message (a query, then Terminate
// in the same write, or a query and then a shutdown of its side of the connection) gets the
// server's answers, as from PostgreSQL directly, and the write commits once, answered. A
// review saw the proxy drop the answers (0 of 10) while the writes committed (10 of 10).
// And a message the proxy refuses (too large) while a transaction runs is refused after the
// answers to what came before it: the review saw the FATAL arrive before the COMMIT's answer.
func TestClientDoneAnswersFirst(t *testing.T) {
	pg, admin := fencedDB(t)
	const limit = 1 << 20
	p := fencedProxy(t, pg, func(c *proxy.Config) { c.Unfenced = proxy.UnfencedAllow; c.MaxMessageSize = limit })
	targets := []struct {
		name   string
		addr   string
		params []string
	}{
		{"direct", pgAddr(pg), nil},
		{"proxy unfenced", proxyAddr(p), nil},
		{"proxy fenced", proxyAddr(p), []string{"fence.resource", "billing", "fence.token", "1"}},
	}
	types := func(msgs []pgproto3.BackendMessage) []string {
		var out []string
		for _, m := range msgs {
			out = append(out, reflect.TypeOf(m).Elem().Name())
		}
		return out
	}
	ends := []struct {
		name string
		end  func(r *rawConn)
	}{
		{"query then Terminate in one write", func(r *rawConn) {
			r.fe.Send(&pgproto3.Terminate{})
			if err := r.fe.Flush(); err != nil {
				t.Fatal(err)
			}
		}},
		{"query then a half-close", func(r *rawConn) {
			if err := r.fe.Flush(); err != nil {
				t.Fatal(err)
			}
			if err := r.conn.(*net.TCPConn).CloseWrite(); err != nil {
				t.Fatal(err)
			}
		}},
	}
	var want []string
	for _, e := range ends {
		for _, tg := range targets {
			t.Run(e.name+"/"+tg.name, func(t *testing.T) {
				tag := fmt.Sprintf("done %s %s", e.name, tg.name)
				r := dialRaw(t, tg.addr)
				r.startup(wire.ProtocolVersion30, append([]string{"user", "app", "database", "postgres"}, tg.params...)...)
				r.fe.Send(&pgproto3.Query{String: fmt.Sprintf("INSERT INTO items (tag) VALUES ('%s'); SELECT pg_sleep(0.2)", tag)})
				e.end(r)
				msgs, err := r.readAll()
				if !isClosed(err) {
					t.Fatalf("after the answers: %v, want the connection closed", err)
				}
				got := types(msgs)
				if tg.name == "direct" {
					want = got
				} else if !reflect.DeepEqual(got, want) {
					t.Errorf("answers %v, want PostgreSQL's own %v", got, want)
				}
				if len(got) == 0 || got[len(got)-1] != "ReadyForQuery" {
					t.Errorf("answers %v: want the query's, up to its ReadyForQuery", got)
				}
				if n := count(t, admin, "SELECT count(*)::int FROM items WHERE tag = $1", tag); n != 1 {
					t.Errorf("%d rows committed, want 1", n)
				}
			})
		}
	}

	for _, tg := range targets[1:] {
		t.Run("too large while a transaction runs/"+tg.name, func(t *testing.T) {
			tag := "too large " + tg.name
			r := dialRaw(t, tg.addr)
			r.startup(wire.ProtocolVersion30, append([]string{"user", "app", "database", "postgres"}, tg.params...)...)
			r.send(&pgproto3.Query{String: fmt.Sprintf("BEGIN; INSERT INTO items (tag) VALUES ('%s'); SELECT pg_sleep(0.3); COMMIT", tag)})
			time.Sleep(50 * time.Millisecond)                                // the transaction runs
			r.writeRaw(append([]byte{'Q', 0x01, 0x40, 0, 0}, "SELECT 1"...)) // 20 MiB announced
			msgs, err := r.readAll()
			if !isClosed(err) {
				t.Fatalf("after the error: %v, want the connection closed", err)
			}
			got := types(msgs)
			i := strings.Index(strings.Join(got, " "), "ErrorResponse")
			if i < 0 || got[len(got)-1] != "ErrorResponse" || len(got) < 2 || got[len(got)-2] != "ReadyForQuery" {
				t.Fatalf("answers %v: want the transaction's, up to its ReadyForQuery, then the error", got)
			}
			if e := errorOf(msgs); e.Code != wire.CodeProgramLimitExceeded || !strings.Contains(e.Message, fmt.Sprint(limit)) {
				t.Errorf("error %+v, want 54000 naming the limit", e)
			}
			if n := count(t, admin, "SELECT count(*)::int FROM items WHERE tag = $1", tag); n != 1 {
				t.Errorf("%d rows committed, want 1 (the answer said COMMIT)", n)
			}
		})
	}
}
