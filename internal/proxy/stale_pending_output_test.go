package proxy_test

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// TestStaleSessionMidResult: a stale session ended while the proxy has output for it that the client
// has not read: the stale leader is frozen (the case fencing exists for), or
// slow, or its result is one large message. When the client reads again, the
// stream must be well-formed up to the proxy's answer (ZF001 from a proxy that
// heard of the raise) and end, or the connection must just end (a closed
// connection is what a proxy that did not hear of the raise may give): within
// seconds, never a hang.
//
// A stale session whose client has not read its pending output (a frozen
// leader) must end, not hang: through the listening proxy the answer cannot
// reach a client that holds part of a message, so the connection closes
// (before the fix the proxy lingered for the client's next unit and the client
// waited for the rest of its message for staleLinger, 5 minutes). Through the
// proxy that did not hear of the raise, many rows end with the proxy's FATAL
// 08006; one row larger than the relay's buffer ends inside the row, then the
// connection closes.
func TestStaleSessionMidResult(t *testing.T) {
	t.Parallel()
	e := startStaleEnv(t, []string{"midresult"})
	ctx := ctxEnv(t)
	tok := int64(1)
	for _, tc := range []struct {
		name string
		sql  string
	}{
		{"one large row", "SELECT repeat('x', 64 << 20)"},
		{"many rows", "SELECT repeat('x', 1000) FROM generate_series(1, 100000)"},
	} {
		for _, listening := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/listening %t", tc.name, listening), func(t *testing.T) {
				px := e.a
				if listening {
					px = e.ah
				}
				s, err := dialSession(addrOf(px.Host, px.Port), fenceParams("postgres", "midresult", tok))
				if err != nil {
					t.Fatal(err)
				}
				defer s.Close()
				// The client stops reading: the backend blocks writing the result.
				s.hold()
				if err := s.send(queryMsg(tc.sql)); err != nil {
					t.Fatal(err)
				}
				eventually(t, 20*time.Second, "the backend blocks writing to the proxy", func() error {
					var ev *string
					if err := e.admin.QueryRow(ctx, `SELECT wait_event FROM pg_stat_activity WHERE pid = $1`, int32(s.PID)).Scan(&ev); err != nil {
						t.Fatal(err)
					}
					if ev == nil || *ev != "ClientWrite" {
						return fmt.Errorf("wait_event %v", ev)
					}
					return nil
				})
				tok++
				if err := e.raise(ctx, "postgres", "midresult", tok); err != nil {
					t.Fatal(err)
				}
				time.Sleep(1500 * time.Millisecond) // frozen a while longer
				// The client wakes up: it reads, and sends its next unit after
				// the first ReadyForQuery.
				s.release()
				var msgs []wireMsg
				answered, probed := false, false
				deadline := time.Now().Add(15 * time.Second)
				for {
					m, ok, err := s.next(time.Until(deadline))
					if err != nil {
						t.Fatalf("the stale client hangs: %v after %d messages (last: %s)", err, len(msgs), lastText(msgs))
					}
					if !ok {
						break
					}
					msgs = append(msgs, m)
					if answered && m.Type != "ErrorResponse" && m.Type != "ReadyForQuery" {
						t.Fatalf("server message %s after the proxy's answer (message %d)", shortText(m.Text), len(msgs)-1)
					}
					if m.Type == "ErrorResponse" {
						if m.Err.Code != fence.CodeStale && (listening || (m.Err.Code != "57P01" && m.Err.Code != "08006")) {
							t.Fatalf("error %s", shortText(m.Text))
						}
						answered = true
					}
					if m.Type == "ReadyForQuery" && !probed {
						probed = true
						s.send(probeMsgs()...) //nolint:errcheck
					}
				}
				t.Logf("%d messages, answered %t, then the end (%v); last: %s", len(msgs), answered, s.end, lastText(msgs))
			})
		}
	}
}

// TestSilentServerEndOfStaleSessionIsAnError (F7): a fenced session through
// proxy B (no control database, so it never hears of a raise) whose server
// connection closes without a word must end with an ErrorResponse (08006
// from the proxy, with its hint, or the server's 57P01, or ZF001), never with
// a bare end of the connection.
//
//   - "blocked sending rows", the finding's case: the session runs a query of
//     many MB of rows and its client stops reading; a raise through proxy A
//     ends the backend, blocked sending, and PostgreSQL sends no FATAL then
//     (it would block again, and it may be in the middle of a message:
//     ProcessClientWriteInterrupt). The client then reads everything.
//   - "idle at a message boundary": the session's backend, idle, dies without
//     a word (SIGKILL); the client's next query must get the error.
func TestSilentServerEndOfStaleSessionIsAnError(t *testing.T) {
	t.Parallel()
	pg, admin := fencedDB(t)
	a := fencedProxy(t, pg)
	b := fencedProxy(t, pg, func(c *proxy.Config) { c.StaleWait = 100 * time.Millisecond })

	// fenced opens a raw session of billing tok through B and returns it with
	// its backend's pid.
	fenced := func(t *testing.T, tok int64) (*rawConn, uint32) {
		r := dialRaw(t, proxyAddr(b))
		return r, r.startupPID(196608, "user", "app", "database", "postgres", "fence.resource", "billing", "fence.token", fmt.Sprint(tok))
	}
	// readToEnd reads until the connection ends and judges the end. It frames
	// the messages itself, to tell an end between two messages from one in
	// the middle of a message.
	readToEnd := func(t *testing.T, r *rawConn) {
		r.conn.SetReadDeadline(time.Now().Add(60 * time.Second)) //nolint:errcheck
		br := bufio.NewReaderSize(r.conn, 1<<16)
		var rows int
		var last *pgproto3.ErrorResponse
		var err error
		cut := false
		for {
			var hdr [5]byte
			if _, err = io.ReadFull(br, hdr[:]); err != nil {
				cut = errors.Is(err, io.ErrUnexpectedEOF)
				break
			}
			body := make([]byte, binary.BigEndian.Uint32(hdr[1:])-4)
			if _, err = io.ReadFull(br, body); err != nil {
				cut = true
				break
			}
			switch hdr[0] {
			case 'D':
				rows++
			case 'E':
				last = &pgproto3.ErrorResponse{}
				if err := last.Decode(body); err != nil {
					t.Fatal(err)
				}
			}
		}
		if !isClosed(err) {
			t.Fatalf("reading the stale session: %v", err)
		}
		if cut {
			t.Fatalf("the stale session ended in the middle of a message after %d rows (last error: %v): the client cannot read an error after it", rows, last)
		}
		if last == nil {
			t.Fatalf("the stale session ended with a bare end of the connection (%v) after %d rows: no error", err, rows)
		}
		switch last.Code {
		case wire.CodeConnectionFailure, wire.CodeAdminShutdown, fence.CodeStale:
		default:
			t.Fatalf("the stale session ended with %s %s: %s; want 08006, 57P01 or ZF001", last.Severity, last.Code, last.Message)
		}
		if last.Severity != wire.SeverityFatal || !strings.Contains(last.Hint, "fenceproxy") && last.Code != fence.CodeStale {
			t.Fatalf("want a FATAL with the proxy's hint, got %s %s: %s (hint %q)", last.Severity, last.Code, last.Message, last.Hint)
		}
		t.Logf("after %d rows: %s %s: %s", rows, last.Severity, last.Code, last.Message)
	}

	t.Run("blocked sending rows", func(t *testing.T) {
		r, _ := fenced(t, 5)
		const query = "SELECT repeat('x', 1000) FROM generate_series(1, 200000)" // 200 MB
		r.send(&pgproto3.Query{String: query})
		// Its backend blocks sending: the client reads nothing.
		eventually(t, 20*time.Second, "the query's backend blocks in ClientWrite", func() error {
			if count(t, admin, `SELECT count(*) FROM pg_stat_activity WHERE usename = 'app' AND query = $1 AND wait_event = 'ClientWrite'`, query) == 0 {
				return errors.New("not blocked")
			}
			return nil
		})
		connect(t, a.FenceURL("app", "postgres", "billing", 6)) // ends the backend before it commits
		readToEnd(t, r)
	})

	t.Run("idle at a message boundary", func(t *testing.T) {
		r, pid := fenced(t, 7)
		if err := syscall.Kill(int(pid), syscall.SIGKILL); err != nil {
			t.Fatalf("kill backend %d: %v", pid, err)
		}
		// PostgreSQL restarts after the crash of a backend: wait for it.
		eventually(t, 15*time.Second, "PostgreSQL accepting connections after the crash", func() error {
			return connectErr(pg.AdminURL())
		})
		// The proxy's wait for news of a raise (Config.StaleWait) runs out
		// and the session ends: the client's query comes after that.
		eventually(t, 15*time.Second, "proxy B's session ended", func() error {
			if n := testutil.ToFloat64(b.Metrics.Sessions); n != 0 {
				return fmt.Errorf("%v sessions open", n)
			}
			return nil
		})
		r.send(&pgproto3.Query{String: "SELECT 1"})
		readToEnd(t, r)
	})
}

// TestFrozenClientGetsEveryAnswerBeforeTheError (second review, finding 01):
// a stale leader's client pipelines a SELECT of 6 MB and an INSERT and stops
// reading; the backend sends everything (most of it backs up between the
// server and the proxy), commits the INSERT and goes idle; a new leader's
// raise ends it; the client wakes up 1.5 s later. Through the proxy that
// hears of the raise, the client must still read every answer the server gave
// (the rows whole, the SELECT's and the INSERT's CommandComplete and
// ReadyForQuery) and only then the proxy's ZF001: before the fix the proxy
// closed the server connection when it heard of the raise, dropped what was
// still buffered and cut the client off inside a row, after 1 s, with no
// error, so the client never learned that its INSERT committed. Through the
// proxy that does not hear of it, the same answers, then the server's end.
func TestFrozenClientGetsEveryAnswerBeforeTheError(t *testing.T) {
	t.Parallel()
	e := startStaleEnv(t, []string{"frozen"})
	ctx := ctxEnv(t)
	for i, listening := range []bool{true, false} {
		t.Run(fmt.Sprintf("listening %t", listening), func(t *testing.T) {
			px, tok := e.a, int64(2*i+1)
			if listening {
				px = e.ah
			}
			// A small receive buffer: most of the result stays on the
			// proxy's side of the client connection and before it.
			s, err := dialSessionBuffer(addrOf(px.Host, px.Port), fenceParams("postgres", "frozen", tok), 16<<10)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			s.hold()
			tag := fmt.Sprintf("frozen-%t", listening)
			if err := s.send(queryMsg("SELECT repeat('x', 1000) FROM generate_series(1, 6000)"),
				queryMsg(fmt.Sprintf("INSERT INTO public.v2_rows (resource, token, tag) VALUES ('frozen', %d, '%s')", tok, tag))); err != nil {
				t.Fatal(err)
			}
			eventually(t, 20*time.Second, "the INSERT commits (the result fits between the server and the client)", func() error {
				var n int
				if err := e.admin.QueryRow(ctx, `SELECT count(*) FROM public.v2_rows WHERE tag = $1`, tag).Scan(&n); err != nil {
					t.Fatal(err)
				}
				if n != 1 {
					return fmt.Errorf("%d rows", n)
				}
				return nil
			})
			if err := e.raise(ctx, "postgres", "frozen", tok+1); err != nil {
				t.Fatal(err)
			}
			time.Sleep(1500 * time.Millisecond) // frozen a while longer
			s.release()
			msgs, err := s.untilRFQ(0, "ErrorResponse", 30*time.Second)
			if err != nil {
				t.Fatalf("%v after %d messages (last: %s)", err, len(msgs), lastText(msgs))
			}
			// The client's next unit gets the error again (or finds the
			// connection closed), and the connection ends.
			s.send(probeMsgs()...) //nolint:errcheck // closed, maybe
			if rest, err := s.drain(10 * time.Second); err != nil {
				t.Fatalf("after the error: %v (%d more messages)", err, len(rest))
			}
			var rows int
			var tags []string
			var fenceErr *pgproto3.ErrorResponse
			for _, m := range msgs {
				switch {
				case m.Type == "DataRow":
					rows++
					if fenceErr != nil {
						t.Fatalf("a DataRow after the error %s", fenceErr.Code)
					}
				case m.Type == "CommandComplete":
					tags = append(tags, m.Text)
				case m.Type == "ErrorResponse" && fenceErr == nil:
					fenceErr = m.Err
				}
			}
			if rows != 6000 || len(tags) != 2 || !strings.Contains(tags[1], "INSERT 0 1") {
				t.Fatalf("the client read %d of 6000 rows and CommandCompletes %q (want the SELECT's and INSERT 0 1); end: %v; last: %s", rows, tags, s.end, lastText(msgs))
			}
			switch {
			case fenceErr == nil:
				t.Fatalf("no error after the answers: the session ended silently (%v)", s.end)
			case listening && fenceErr.Code != fence.CodeStale:
				t.Fatalf("the listening proxy said %s %s, want ZF001", fenceErr.Code, fenceErr.Message)
			case !listening && fenceErr.Code != fence.CodeStale && fenceErr.Code != wire.CodeAdminShutdown && fenceErr.Code != wire.CodeConnectionFailure:
				t.Fatalf("the proxy said %s %s, want ZF001, 57P01 or 08006", fenceErr.Code, fenceErr.Message)
			}
		})
	}
}
