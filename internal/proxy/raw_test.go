package proxy_test

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// This file holds the helpers of the transparency and failure suite: a raw
// protocol client (pgproto3.Frontend on a net.Conn) for what drivers never
// send, and small helpers around pgx and pg_stat_activity.

// plainProxy starts a proxy that lets sessions without a token through.
func plainProxy(t *testing.T, pg *testenv.Postgres, mod ...func(*proxy.Config)) *testenv.Proxy {
	t.Helper()
	cfg := proxy.Config{Unfenced: proxy.UnfencedAllow}
	for _, m := range mod {
		m(&cfg)
	}
	return testenv.StartProxy(t, pg, cfg)
}

func proxyAddr(p *testenv.Proxy) string {
	return net.JoinHostPort(p.Host, strconv.Itoa(p.Port))
}

func pgAddr(pg *testenv.Postgres) string {
	return net.JoinHostPort(pg.Host, strconv.Itoa(pg.Port))
}

// connectCfg connects with a config that mod may change first.
func connectCfg(t *testing.T, url string, mod func(*pgx.ConnConfig)) *pgx.Conn {
	return testenv.Connect(t, url, mod)
}

// backendGone waits until no backend with pid is left in pg_stat_activity
// and reports how long that took; it fails the test after within.
func backendGone(t *testing.T, admin querier, pid uint32, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	eventually(t, within, fmt.Sprintf("backend %d gone from pg_stat_activity", pid), func() error {
		if count(t, admin, "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", int32(pid)) > 0 {
			return errors.New("still listed")
		}
		return nil
	})
	return time.Since(start)
}

// rawConn is a protocol-level client.
type rawConn struct {
	t    *testing.T
	conn net.Conn
	fe   *pgproto3.Frontend
}

// dialRaw connects to addr. Every read and write of the connection must be
// done within 30 s.
func dialRaw(t *testing.T, addr string) *rawConn {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	conn.SetDeadline(time.Now().Add(30 * time.Second)) //nolint:errcheck
	return &rawConn{t: t, conn: conn, fe: pgproto3.NewFrontend(conn, conn)}
}

// writeRaw writes bytes as they are.
func (r *rawConn) writeRaw(b []byte) {
	r.t.Helper()
	if _, err := r.conn.Write(b); err != nil {
		r.t.Fatalf("write: %v", err)
	}
}

func (r *rawConn) send(msgs ...pgproto3.FrontendMessage) {
	r.t.Helper()
	for _, m := range msgs {
		r.fe.Send(m)
	}
	if err := r.fe.Flush(); err != nil {
		r.t.Fatalf("send: %v", err)
	}
}

// startup sends a StartupMessage of the given version with params (user
// and database first, in this order) and returns the normalised
// transcript up to ReadyForQuery or the first ErrorResponse.
func (r *rawConn) startup(version uint32, params ...string) []string {
	r.t.Helper()
	r.writeRaw(startupPacket(version, params...))
	var out []string
	for {
		m, err := r.fe.Receive()
		if err != nil {
			r.t.Fatalf("startup: %v (after %q)", err, out)
		}
		out = append(out, normalize(m))
		switch m.(type) {
		case *pgproto3.ReadyForQuery, *pgproto3.ErrorResponse:
			return out
		}
	}
}

// startupPID completes a startup that must succeed, and returns the backend's pid.
func (r *rawConn) startupPID(version uint32, params ...string) uint32 {
	r.t.Helper()
	r.writeRaw(startupPacket(version, params...))
	var pid uint32
	for {
		m, err := r.fe.Receive()
		if err != nil {
			r.t.Fatalf("startup: %v", err)
		}
		switch m := m.(type) {
		case *pgproto3.BackendKeyData:
			pid = m.ProcessID
		case *pgproto3.ErrorResponse:
			r.t.Fatalf("startup: %s %s: %s", m.Severity, m.Code, m.Message)
		case *pgproto3.ReadyForQuery:
			return pid
		}
	}
}

// startupPacket encodes a StartupMessage with params in order
// (name, value, name, value...).
func startupPacket(version uint32, params ...string) []byte {
	b := []byte{0, 0, 0, 0}
	b = binary.BigEndian.AppendUint32(b, version)
	for _, p := range params {
		b = append(b, p...)
		b = append(b, 0)
	}
	b = append(b, 0)
	binary.BigEndian.PutUint32(b, uint32(len(b)))
	return b
}

// requestPacket is an SSLRequest, GSSENCRequest or other 8-byte request.
func requestPacket(code uint32) []byte {
	b := binary.BigEndian.AppendUint32(nil, 8)
	return binary.BigEndian.AppendUint32(b, code)
}

// readUntil reads messages until n ReadyForQuery (n > 0), or until a
// message whose type name (e.g. "ParseComplete") is stop.
func (r *rawConn) readUntil(n int, stop string) ([]string, error) {
	var out []string
	for {
		m, err := r.fe.Receive()
		if err != nil {
			return out, err
		}
		out = append(out, normalize(m))
		name := reflect.TypeOf(m).Elem().Name()
		if stop != "" && name == stop {
			return out, nil
		}
		if _, ok := m.(*pgproto3.ReadyForQuery); ok && stop == "" {
			if n--; n == 0 {
				return out, nil
			}
		}
	}
}

// readAll reads messages until the connection ends and returns them with
// the error that ended it.
func (r *rawConn) readAll() ([]pgproto3.BackendMessage, error) {
	var out []pgproto3.BackendMessage
	for {
		m, err := r.fe.Receive()
		if err != nil {
			return out, err
		}
		// Receive reuses its messages: keep a decoded copy of errors only.
		if e, ok := m.(*pgproto3.ErrorResponse); ok {
			c := *e
			out = append(out, &c)
			continue
		}
		out = append(out, m)
	}
}

// normalize renders a message as its type name and JSON, with what
// legitimately differs between two sessions (process IDs, cancel keys,
// OIDs of temporary tables) blanked.
func normalize(m pgproto3.BackendMessage) string {
	var v any = m
	switch m := m.(type) {
	case *pgproto3.BackendKeyData:
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
	}
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprintf("%T (unencodable: %v)", m, err)
	}
	return reflect.TypeOf(m).Elem().Name() + " " + string(b)
}

// errorOf returns the first ErrorResponse among msgs.
func errorOf(msgs []pgproto3.BackendMessage) *pgproto3.ErrorResponse {
	for _, m := range msgs {
		if e, ok := m.(*pgproto3.ErrorResponse); ok {
			return e
		}
	}
	return nil
}

// isClosed reports whether err means the peer closed the connection (as
// opposed to a read timeout).
func isClosed(err error) bool {
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return false
	}
	return err != nil
}

// readByte reads the one-byte answer to an SSLRequest or GSSENCRequest.
func (r *rawConn) readByte() (byte, error) {
	var b [1]byte
	_, err := io.ReadFull(r.conn, b[:])
	return b[0], err
}

// diffLines describes where two transcripts first differ.
func diffLines(direct, proxied []string) string {
	var b strings.Builder
	for i := 0; i < len(direct) || i < len(proxied); i++ {
		var d, p string
		if i < len(direct) {
			d = direct[i]
		}
		if i < len(proxied) {
			p = proxied[i]
		}
		if d != p {
			fmt.Fprintf(&b, "first difference at message %d:\n  direct: %s\n  proxy:  %s\n", i, d, p)
			break
		}
	}
	fmt.Fprintf(&b, "direct (%d messages):\n  %s\nproxy (%d messages):\n  %s", len(direct), strings.Join(direct, "\n  "), len(proxied), strings.Join(proxied, "\n  "))
	return b.String()
}
