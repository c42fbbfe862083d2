package proxy_test

import (
	"encoding/json"
	"fmt"
	"net"
	"reflect"
	"regexp"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/fence"
)

// ---------------------------------------------------------------------
// A raw protocol session with a background reader.

// wireMsg is a backend message, rendered at once (pgproto3 reuses its messages).
type wireMsg struct {
	Type   string                  // e.g. "ReadyForQuery"
	Text   string                  // type and JSON, normalised (see renderMsg)
	Err    *pgproto3.ErrorResponse // ErrorResponse only
	Status byte                    // ReadyForQuery only
	PID    uint32                  // BackendKeyData only
}

// wireSession is a protocol-level client whose reader goroutine queues every
// message, so that a test may send as much as it likes before reading.
type wireSession struct {
	conn net.Conn
	fe   *pgproto3.Frontend
	in   chan wireMsg
	end  error // why the reader stopped; written before in is closed
	PID  uint32
	got  []wireMsg                     // everything consumed since startup
	sent int                           // messages sent since startup
	gate atomic.Pointer[chan struct{}] // non-nil: the reader waits for it to close
}

// hold stops the reader before its next message, so that what the server
// sends backs up; release lets it go on.
func (s *wireSession) hold() {
	c := make(chan struct{})
	s.gate.Store(&c)
}

func (s *wireSession) release() {
	if c := s.gate.Swap(nil); c != nil {
		close(*c)
	}
}

// serverError is an ErrorResponse that refused a session at startup.
type serverError struct{ resp *pgproto3.ErrorResponse }

func (e *serverError) Error() string {
	return fmt.Sprintf("%s %s: %s", e.resp.Severity, e.resp.Code, e.resp.Message)
}

// dialSession connects to addr and completes startup with params (trust
// authentication): it returns at the first ReadyForQuery, or with the
// ErrorResponse that refused the session (*serverError).
func dialSession(addr string, params map[string]string) (*wireSession, error) {
	return dialSessionBuffer(addr, params, 0)
}

// dialSessionBuffer is dialSession with a receive buffer of rcvbuf bytes (0: the system's), set
// before the connection is made, as a client with a small buffer has it: set afterwards,
// below the window already advertised, Linux's sender can stall for seconds on loopback
// (a window smaller than its segment size).
func dialSessionBuffer(addr string, params map[string]string, rcvbuf int) (*wireSession, error) {
	d := net.Dialer{Timeout: 5 * time.Second}
	if rcvbuf > 0 {
		d.Control = func(_, _ string, c syscall.RawConn) error {
			var serr error
			if err := c.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, rcvbuf) }); err != nil {
				return err
			}
			return serr
		}
	}
	conn, err := d.Dial("tcp", addr)
	if err != nil {
		return nil, err
	}
	s := &wireSession{conn: conn, fe: pgproto3.NewFrontend(conn, conn), in: make(chan wireMsg, 1<<15)}
	go s.read()
	s.fe.Send(&pgproto3.StartupMessage{ProtocolVersion: pgproto3.ProtocolVersionNumber, Parameters: params})
	if err := s.flush(); err != nil {
		conn.Close()
		return nil, err
	}
	for {
		m, ok, err := s.next(30 * time.Second)
		if err != nil {
			conn.Close()
			return nil, fmt.Errorf("startup: %w", err)
		}
		if !ok {
			conn.Close()
			return nil, fmt.Errorf("startup: connection closed: %v", s.end)
		}
		switch m.Type {
		case "BackendKeyData":
			s.PID = m.PID
		case "ErrorResponse":
			conn.Close()
			return nil, &serverError{m.Err}
		case "ReadyForQuery":
			s.got = nil
			return s, nil
		}
	}
}

func (s *wireSession) read() {
	defer close(s.in)
	for {
		if c := s.gate.Load(); c != nil {
			<-*c
		}
		m, err := s.fe.Receive()
		if err != nil {
			s.end = err
			return
		}
		s.in <- renderMsg(m)
	}
}

func (s *wireSession) Close() { s.conn.Close() }

func (s *wireSession) flush() error {
	s.conn.SetWriteDeadline(time.Now().Add(10 * time.Second)) //nolint:errcheck
	return s.fe.Flush()
}

// send sends msgs and flushes.
func (s *wireSession) send(msgs ...pgproto3.FrontendMessage) error {
	for _, m := range msgs {
		s.fe.Send(m)
	}
	s.sent += len(msgs)
	return s.flush()
}

// next returns the next message; ok is false when the connection ended.
func (s *wireSession) next(d time.Duration) (m wireMsg, ok bool, err error) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case m, ok = <-s.in:
		if ok {
			s.got = append(s.got, m)
		}
		return m, ok, nil
	case <-t.C:
		return wireMsg{}, false, fmt.Errorf("no message within %v", d)
	}
}

// untilRFQ reads until n ReadyForQuery messages (n > 0) or, with n == 0,
// until a message of type stop.
func (s *wireSession) untilRFQ(n int, stop string, d time.Duration) ([]wireMsg, error) {
	var out []wireMsg
	deadline := time.Now().Add(d)
	for {
		m, ok, err := s.next(time.Until(deadline))
		if err != nil {
			return out, err
		}
		if !ok {
			return out, fmt.Errorf("connection ended: %v", s.end)
		}
		out = append(out, m)
		if n == 0 && m.Type == stop {
			return out, nil
		}
		if n > 0 && m.Type == "ReadyForQuery" {
			if n--; n == 0 {
				return out, nil
			}
		}
	}
}

// drain reads until the connection ends.
func (s *wireSession) drain(d time.Duration) ([]wireMsg, error) {
	var out []wireMsg
	deadline := time.Now().Add(d)
	for {
		m, ok, err := s.next(time.Until(deadline))
		if err != nil {
			return out, fmt.Errorf("the connection did not end: %w", err)
		}
		if !ok {
			return out, nil
		}
		out = append(out, m)
	}
}

// finish reads until the connection ends, as a client that goes on: after
// each ReadyForQuery that follows a ZF001 ERROR (the proxy's answer to a unit
// of an ended session, which keeps the connection for the next one) it sends
// its next unit, at most probes times.
func (s *wireSession) finish(d time.Duration, probes int) ([]wireMsg, error) {
	var out []wireMsg
	deadline := time.Now().Add(d)
	for {
		m, ok, err := s.next(time.Until(deadline))
		if err != nil {
			return out, fmt.Errorf("the connection did not end: %w", err)
		}
		if !ok {
			return out, nil
		}
		if m.Type == "ReadyForQuery" && len(out) > 0 && probes > 0 {
			if p := out[len(out)-1]; p.Type == "ErrorResponse" && p.Err.Code == fence.CodeStale {
				probes--
				s.send(probeMsgs()...) //nolint:errcheck // closed, maybe
			}
		}
		out = append(out, m)
	}
}

// transcript is everything consumed, one message a line.
func (s *wireSession) transcript() string {
	var b strings.Builder
	for _, m := range s.got {
		b.WriteString("\n    ")
		b.WriteString(shortText(m.Text))
	}
	return b.String()
}

func shortText(s string) string {
	if len(s) > 300 {
		return s[:300] + "..."
	}
	return s
}

var tuplePos = regexp.MustCompile(`tuple \(\d+,\d+\)`)

// renderMsg renders m as its type name and JSON, with what legitimately
// differs between two sessions blanked: process IDs and cancel keys, table
// OIDs, and tuple positions in error contexts (they depend on when other
// sessions' snapshots let a page be pruned).
func renderMsg(m pgproto3.BackendMessage) wireMsg {
	name := reflect.TypeOf(m).Elem().Name()
	out := wireMsg{Type: name}
	var v any = m
	switch m := m.(type) {
	case *pgproto3.BackendKeyData:
		out.PID = m.ProcessID
		v = map[string]int{"KeyLen": len(m.SecretKey)}
	case *pgproto3.RowDescription:
		c := pgproto3.RowDescription{Fields: append([]pgproto3.FieldDescription(nil), m.Fields...)}
		for i := range c.Fields {
			c.Fields[i].TableOID = 0
		}
		v = &c
	case *pgproto3.NotificationResponse:
		c := *m
		c.PID = 0
		v = &c
	case *pgproto3.ErrorResponse:
		c := *m
		out.Err = &c
		n := c
		n.Where = tuplePos.ReplaceAllString(n.Where, "tuple (?)")
		v = &n
	case *pgproto3.NoticeResponse:
		n := *m
		n.Where = tuplePos.ReplaceAllString(n.Where, "tuple (?)")
		v = &n
	case *pgproto3.ReadyForQuery:
		out.Status = m.TxStatus
	}
	b, err := json.Marshal(v)
	if err != nil {
		b = []byte(fmt.Sprintf("(unencodable: %v)", err))
	}
	out.Text = name + " " + string(b)
	return out
}

// Message builders.

func queryMsg(sql string) *pgproto3.Query { return &pgproto3.Query{String: sql} }

// parseBindExecute is Parse, Bind and Execute of sql as statement name and portal.
func parseBindExecute(name, portal, sql string) []pgproto3.FrontendMessage {
	return []pgproto3.FrontendMessage{
		&pgproto3.Parse{Name: name, Query: sql},
		&pgproto3.Bind{DestinationPortal: portal, PreparedStatement: name},
		&pgproto3.Execute{Portal: portal},
	}
}

func frontendMsgs(parts ...any) []pgproto3.FrontendMessage {
	var out []pgproto3.FrontendMessage
	for _, p := range parts {
		switch p := p.(type) {
		case pgproto3.FrontendMessage:
			out = append(out, p)
		case []pgproto3.FrontendMessage:
			out = append(out, p...)
		default:
			panic(fmt.Sprintf("frontendMsgs: %T", p))
		}
	}
	return out
}

// terminatorMsgs ends any sequence: out of COPY, to an idle session, then a
// marker whose answer is unmistakable.
func terminatorMsgs(nonce string) []pgproto3.FrontendMessage {
	return frontendMsgs(&pgproto3.CopyFail{Message: "v2 end"}, &pgproto3.Sync{}, queryMsg("ROLLBACK"), queryMsg("SELECT '"+nonce+"'"))
}

// sessionTranscript sends msgs and the terminator and returns every message read
// up to the terminator's ReadyForQuery ("EOF" last if the connection ended).
func sessionTranscript(s *wireSession, msgs []pgproto3.FrontendMessage, nonce string, d time.Duration) ([]string, error) {
	if err := s.send(append(append([]pgproto3.FrontendMessage(nil), msgs...), terminatorMsgs(nonce)...)...); err != nil {
		return nil, err
	}
	var out []string
	seen := false
	deadline := time.Now().Add(d)
	for {
		m, ok, err := s.next(time.Until(deadline))
		if err != nil {
			return out, err
		}
		if !ok {
			return append(out, "EOF"), nil
		}
		out = append(out, m.Text)
		if m.Type == "DataRow" && strings.Contains(m.Text, nonce) {
			seen = true
		}
		if seen && m.Type == "ReadyForQuery" {
			return out, nil
		}
	}
}

func lastText(msgs []wireMsg) string {
	if len(msgs) == 0 {
		return "none"
	}
	return shortText(msgs[len(msgs)-1].Text)
}
