package proxy_test

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// testStartupGarbage: every first packet gets what PostgreSQL gives it,
// checked against the server itself: a FATAL ErrorResponse with the same
// SQLSTATE and a closed socket, or just a closed socket (PostgreSQL only
// logs a packet of impossible length, a Terminate for instance), never a
// hang or a crash; and the proxy goes on serving.
func testStartupGarbage(t *testing.T, s *suite) {
	pg, p, _ := s.setup(t)
	length := func(n uint32, rest ...byte) []byte { return append(binary.BigEndian.AppendUint32(nil, n), rest...) }
	rnd := rand.New(rand.NewPCG(1, 2))
	random := make([]byte, 4096)
	for i := range random {
		random[i] = byte(rnd.Uint32())
	}
	terminate := []byte{'X', 0, 0, 0, 4}
	ssl := requestPacket(wire.SSLRequestCode)
	startup := startupPacket(wire.ProtocolVersion30, "user", "postgres")
	tests := []struct {
		name string
		// in is sent first; each of then after reading the one-byte answer
		// to an SSLRequest.
		in   []byte
		then [][]byte
		// halfClose closes the client's sending side after the last write.
		halfClose bool
		// want is what PostgreSQL 15 answers (see firstPacketAnswer).
		want string
	}{
		{"Terminate", terminate, nil, false, ""}, // node-postgres: connect() then end()
		{"Terminate, half-closed", terminate, nil, true, ""},
		{"Terminate then a startup", append(terminate, startup...), nil, false, ""},
		{"SSLRequest then Terminate", ssl, [][]byte{terminate}, false, "N"},
		{"SSLRequest twice", ssl, [][]byte{ssl}, false, "N E:0A000"},
		{"SSLRequest with trailing bytes", length(12, 0x04, 0xd2, 0x16, 0x2f, 0, 0, 0, 0), nil, true, "N"},
		{"SSLRequest with a startup pipelined", append(ssl, startup...), nil, false, "N E:08P01"},
		{"protocol 1.0", startupPacket(1<<16, "user", "postgres"), nil, false, "E2:FATAL"},
		{"http request", []byte("GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"), nil, false, ""},
		{"TLS client hello", []byte{0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03}, nil, false, ""},
		{"length 0", length(0), nil, false, ""},
		{"length below 8", length(7, 0, 3, 0), nil, false, ""},
		{"oversized length", length(1<<30, 0, 3, 0, 0), nil, false, ""},
		{"oversized packet", startupPacket(wire.ProtocolVersion30, "user", "postgres", "application_name", strings.Repeat("a", 20000)), nil, false, ""},
		{"truncated packet", length(100, 0, 3, 0, 0, 'u', 's'), nil, true, ""},
		{"truncated header", []byte{0, 0}, nil, true, ""},
		{"nothing", nil, nil, true, ""},
		{"protocol 2.0", startupPacket(2<<16, "user", "postgres"), nil, false, "E2:FATAL"},
		{"protocol 4.0", startupPacket(4<<16, "user", "postgres"), nil, false, "E:0A000"},
		{"no terminator", length(17, append([]byte{0, 3, 0, 0}, "user\x00alice"...)...), nil, false, "E:08P01"},
		{"name without value", length(18, append([]byte{0, 3, 0, 0}, "user\x00alice\x00db\x00"...)...), nil, false, "E:08P01"},
		{"short CancelRequest", length(12, 0x04, 0xd2, 0x16, 0x2e, 0, 0, 0, 1), nil, false, ""},
		{"CancelRequest of no backend", length(16, 0x04, 0xd2, 0x16, 0x2e, 0, 0, 0, 1, 0, 0, 0, 1), nil, false, ""},
		{"random bytes", random, nil, false, ""},
	}
	t.Run("cases", func(t *testing.T) {
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				t.Parallel()
				answer := func(addr string) string {
					return firstPacketAnswer(t, addr, append([][]byte{tt.in}, tt.then...), tt.halfClose)
				}
				direct, proxied := answer(pgAddr(pg)), answer(proxyAddr(p))
				if direct != tt.want {
					t.Errorf("PostgreSQL answered %q, the test expects %q", direct, tt.want)
				}
				if proxied != direct {
					t.Fatalf("the proxy answered %q, PostgreSQL %q", proxied, direct)
				}
			})
		}
	})
	t.Run("still serving", func(t *testing.T) {
		// Runs after the parallel cases of "cases" are done.
		if c := count(t, connect(t, p.URL(testenv.AdminUser, "postgres")), "SELECT 1"); c != 1 {
			t.Fatal(c)
		}
	})
}

// firstPacketAnswer writes the first of writes to addr, and each next one
// after reading the one-byte answer to an SSLRequest, then reads until the
// server closes. It describes what came back: "N" or "S" for the one-byte
// answers, the type of each message, with its SQLSTATE for an
// ErrorResponse ("N E:08P01"); "" is a close without a word.
func firstPacketAnswer(t *testing.T, addr string, writes [][]byte, halfClose bool) string {
	t.Helper()
	r := dialRaw(t, addr)
	var got []byte
	for i, w := range writes {
		if i > 0 {
			b, err := r.readByte()
			if err != nil {
				return string(got) + " (closed before the next write)"
			}
			got = append(got, b)
		}
		if len(w) > 0 {
			r.conn.Write(w) //nolint:errcheck // the server may close before reading it all
		}
	}
	if halfClose {
		r.conn.(interface{ CloseWrite() error }).CloseWrite() //nolint:errcheck
	}
	rest, err := io.ReadAll(r.conn)
	if ne := net.Error(nil); errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("%s: connection not closed within 30 s, read %q", addr, append(got, rest...))
	}
	var out []string
	for _, b := range got {
		out = append(out, string(b))
	}
	// A one-byte answer is followed by nothing or by a message, whose
	// length starts with a zero byte; a message's type byte is not. An
	// error in protocol 2's format ('E', then text up to a NUL) is "E2:"
	// and its severity.
	for len(rest) > 0 && (len(rest) == 1 || rest[1] != 0) {
		if v2, ok := strings.CutPrefix(string(rest), "E"); ok && rest[0] == 'E' && strings.HasSuffix(v2, "\n\x00") {
			t.Logf("%s: %q", addr, v2)
			severity, _, _ := strings.Cut(v2, ":")
			out = append(out, "E2:"+severity)
			rest = nil
			break
		}
		out = append(out, string(rest[0]))
		rest = rest[1:]
	}
	for len(rest) >= 5 {
		typ, n := rest[0], int(binary.BigEndian.Uint32(rest[1:5]))
		if n < 4 || len(rest) < 1+n {
			break
		}
		body := rest[5 : 1+n]
		rest = rest[1+n:]
		if typ != 'E' {
			out = append(out, string(typ))
			continue
		}
		var e pgproto3.ErrorResponse
		if err := e.Decode(body); err != nil {
			t.Fatalf("%s: undecodable ErrorResponse: %v", addr, err)
		}
		if e.Severity != "FATAL" {
			t.Errorf("%s: severity %s", addr, e.Severity)
		}
		t.Logf("%s: %s %s", addr, e.Code, e.Message)
		out = append(out, "E:"+e.Code)
	}
	if len(rest) > 0 {
		out = append(out, fmt.Sprintf("%q", rest))
	}
	return strings.Join(out, " ")
}

// testStartupRelayed: what the server decides at startup reaches the
// client as the server said it: protocol negotiation, options, unknown
// users and databases. Each case runs directly and through the proxy and
// the transcripts must be identical.
func testStartupRelayed(t *testing.T, s *suite) {
	pg, p, _ := s.setup(t)
	tests := []struct {
		name    string
		version uint32
		params  []string
		query   string
		want    string
	}{
		{"protocol 3.0", 3 << 16, nil, "SELECT 1", `"ReadyForQuery"`},
		{"protocol 3.2", 3<<16 | 2, nil, "SELECT 1", `NegotiateProtocolVersion {"Type":"NegotiateProtocolVersion","NewestMinorProtocol":196608,"UnrecognizedOptions":[]}`},
		{"protocol 3.2 with a _pq_ option", 3<<16 | 2, []string{"_pq_.some_extension", "on"}, "SELECT 1", `"UnrecognizedOptions":["_pq_.some_extension"]`},
		{"protocol 3.9999", 3<<16 | 9999, nil, "SELECT 1", `"NewestMinorProtocol":196608`},
		{"options with escapes", 3 << 16, []string{"options", `-c application_name=my\ app\\x  --work-mem=12MB -csearch_path=pg_catalog`}, "SHOW search_path; SHOW application_name; SHOW work_mem", `"my app\\x"`},
		{"run-time parameters", 3 << 16, []string{"application_name", "app é", "DateStyle", "German", "client_encoding", "LATIN1"}, "SELECT 'é'", `"German, DMY"`},
		{"unknown parameter", 3 << 16, []string{"no_such_setting", "1"}, "", `"42704"`},
		{"unknown database", 3 << 16, []string{"database", "nosuchdb"}, "", `"3D000"`},
		{"unknown user", 3 << 16, []string{"user", "nosuchuser"}, "", `"28000"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			params := []string{"user", testenv.AdminUser, "database", "postgres"}
			for i := 0; i < len(tt.params); i += 2 {
				replaced := false
				for j := 0; j < len(params); j += 2 {
					if params[j] == tt.params[i] {
						params[j+1], replaced = tt.params[i+1], true
					}
				}
				if !replaced {
					params = append(params, tt.params[i], tt.params[i+1])
				}
			}
			run := func(addr string) []string {
				r := dialRaw(t, addr)
				out := r.startup(tt.version, params...)
				if tt.query != "" {
					r.send(&pgproto3.Query{String: tt.query})
					more, err := r.readUntil(1, "")
					if err != nil {
						t.Fatalf("%s: %v", addr, err)
					}
					out = append(out, more...)
				}
				return out
			}
			direct, proxied := run(pgAddr(pg)), run(proxyAddr(p))
			if d, q := strings.Join(direct, "\n"), strings.Join(proxied, "\n"); d != q {
				t.Fatalf("transcripts differ\n%s", diffLines(direct, proxied))
			}
			if all := strings.Join(direct, "\n"); !strings.Contains(all, tt.want) {
				t.Fatalf("transcript lacks %s:\n%s", tt.want, all)
			}
		})
	}
	t.Run("pgx with max_protocol_version=3.2", func(t *testing.T) {
		t.Parallel()
		conn := connect(t, p.URL(testenv.AdminUser, "postgres", "max_protocol_version=3.2"))
		if c := count(t, conn, "SELECT 32"); c != 32 {
			t.Fatal(c)
		}
	})
}

// testCancelRequestRaw: a CancelRequest from a new connection reaches the
// backend whose key it carries; the proxy closes the cancel connection
// without answering, as the server does; a wrong key cancels nothing.
func testCancelRequestRaw(t *testing.T, s *suite) {
	_, p, admin := s.setup(t)
	r := dialRaw(t, proxyAddr(p))
	r.writeRaw(startupPacket(wire.ProtocolVersion30, "user", testenv.AdminUser, "database", "postgres"))
	var pid uint32
	var key []byte
	for {
		m, err := r.fe.Receive()
		if err != nil {
			t.Fatal(err)
		}
		if k, ok := m.(*pgproto3.BackendKeyData); ok {
			pid, key = k.ProcessID, append([]byte(nil), k.SecretKey...)
		}
		if _, ok := m.(*pgproto3.ReadyForQuery); ok {
			break
		}
	}
	r.send(&pgproto3.Query{String: "SELECT pg_sleep(30)"})
	waitActive(t, admin, pid, "pg_sleep")
	cancel := func(key []byte) {
		c := dialRaw(t, proxyAddr(p))
		req := binary.BigEndian.AppendUint32(nil, uint32(12+len(key)))
		req = binary.BigEndian.AppendUint32(req, wire.CancelRequestCode)
		req = binary.BigEndian.AppendUint32(req, pid)
		c.writeRaw(append(req, key...))
		msgs, err := c.readAll()
		if len(msgs) != 0 || !isClosed(err) {
			t.Fatalf("cancel connection: %d messages, %v", len(msgs), err)
		}
	}
	wrong := append([]byte(nil), key...)
	wrong[0] ^= 0xff
	cancel(wrong)
	time.Sleep(200 * time.Millisecond)
	if count(t, admin, "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND state = 'active'", int32(pid)) != 1 {
		t.Fatal("a CancelRequest with a wrong key cancelled the query")
	}
	start := time.Now()
	cancel(key)
	got, err := r.readUntil(1, "")
	if err != nil {
		t.Fatal(err)
	}
	if all := strings.Join(got, "\n"); !strings.Contains(all, `"57014"`) {
		t.Fatalf("want 57014, got %s", all)
	}
	t.Logf("cancelled %v after the CancelRequest", time.Since(start))
}

// TestReplicationConnectionBindRefusal: a fenced session asking for a replication connection
// (replication=database) cannot be bound (a walsender takes no extended query); it is
// refused with ZF007 in the server's words, not with a hint about the fence schema or
// fence.bind's privilege, which a review found misleading.
func TestReplicationConnectionBindRefusal(t *testing.T) {
	pg, _ := fencedDB(t)
	p := fencedProxy(t, pg)
	err := connectErr(p.FenceURL(testenv.AdminUser, "postgres", "billing", 1, "replication=database"))
	wantCode(t, err, fence.CodeUnavailable)
	if msg := err.Error(); strings.Contains(msg, "fenceproxy migrate") || !strings.Contains(msg, "replication") {
		t.Errorf("refusal %q: want the server's words (replication connection), without the schema hint", msg)
	}
}

// TestDuplicateStartupParameters (F11): PostgreSQL takes the last value of a
// startup parameter given twice. The proxy must prove its bind for the same
// database: a startup with database "nosuchdb" then "postgres" binds and
// works. (A fence parameter given twice with different values is refused.)
func TestDuplicateStartupParameters(t *testing.T) {
	t.Parallel()
	pg, admin := fencedDB(t)
	p := fencedProxy(t, pg)

	t.Run("database twice", func(t *testing.T) {
		r := dialRaw(t, proxyAddr(p))
		pid := r.startupPID(196608, "user", "app", "database", "nosuchdb", "database", "postgres",
			"fence.resource", "billing", "fence.token", "5")
		r.send(&pgproto3.Query{String: "INSERT INTO items(tag, token) VALUES ('f11', 5) RETURNING current_database()"})
		var db string
		for done := false; !done; {
			m, err := r.fe.Receive()
			if err != nil {
				t.Fatal(err)
			}
			switch m := m.(type) {
			case *pgproto3.DataRow:
				db = string(m.Values[0])
			case *pgproto3.ErrorResponse:
				t.Fatalf("query: %s: %s", m.Code, m.Message)
			case *pgproto3.ReadyForQuery:
				done = true
			}
		}
		if db != "postgres" {
			t.Fatalf("current_database() %q, want postgres (the last value)", db)
		}
		if n := count(t, admin, `SELECT count(*) FROM fence.bindings WHERE pid = $1 AND resource = 'billing' AND token = 5`, int32(pid)); n != 1 {
			t.Fatalf("%d bindings of backend %d to billing 5, want 1", n, pid)
		}
	})

	t.Run("fence.token twice", func(t *testing.T) {
		r := dialRaw(t, proxyAddr(p))
		tr := r.startup(196608, "user", "app", "database", "postgres",
			"fence.resource", "billing", "fence.token", "5", "fence.token", "6")
		end := tr[len(tr)-1]
		if !strings.HasPrefix(end, "ErrorResponse") || !strings.Contains(end, `"Code":"`+fence.CodeMalformed+`"`) || !strings.Contains(end, "more than once") {
			t.Fatalf("fence.token given twice with different values: want ZF004, got %s", end)
		}
	})
}
