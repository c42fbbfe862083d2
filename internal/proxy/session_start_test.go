package proxy_test

import (
	"encoding/binary"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// testStartupGarbage: malformed first packets get a clear error (08P01)
// and a closed socket, or just a closed socket, never a hang or a crash,
// and the proxy goes on serving.
func testStartupGarbage(t *testing.T, s *suite) {
	_, p, _ := s.setup(t)
	length := func(n uint32, rest ...byte) []byte { return append(binary.BigEndian.AppendUint32(nil, n), rest...) }
	rnd := rand.New(rand.NewPCG(1, 2))
	random := make([]byte, 4096)
	for i := range random {
		random[i] = byte(rnd.Uint32())
	}
	tests := []struct {
		name string
		in   []byte
		// halfClose closes the client's sending side after in.
		halfClose bool
		// mustError: the proxy has read the whole packet, so its ErrorResponse
		// cannot be lost to a reset; it must arrive.
		mustError bool
		code      string
	}{
		{"http request", []byte("GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"), false, false, "08P01"},
		{"TLS client hello", []byte{0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03}, false, false, "08P01"},
		{"length 0", length(0), false, true, "08P01"},
		{"length below 8", length(7, 0, 3, 0), false, true, "08P01"},
		{"oversized length", length(1<<30, 0, 3, 0, 0), false, false, "08P01"},
		{"oversized packet", startupPacket(wire.ProtocolVersion30, "user", "postgres", "application_name", strings.Repeat("a", 20000)), false, false, "08P01"},
		{"truncated packet", length(100, 0, 3, 0, 0, 'u', 's'), true, false, "08P01"},
		{"truncated header", []byte{0, 0}, true, false, ""},
		{"nothing", nil, true, false, ""},
		{"protocol 2.0", startupPacket(2<<16, "user", "postgres"), false, true, "0A000"}, // as PostgreSQL answers
		{"protocol 4.0", startupPacket(4<<16, "user", "postgres"), false, true, "0A000"},
		{"no terminator", length(17, append([]byte{0, 3, 0, 0}, "user\x00alice"...)...), false, true, "08P01"},
		{"name without value", length(18, append([]byte{0, 3, 0, 0}, "user\x00alice\x00db\x00"...)...), false, true, "08P01"},
		{"SSLRequest with trailing bytes", length(12, 0x04, 0xd2, 0x16, 0x2f, 0, 0, 0, 0), false, true, "08P01"},
		{"short CancelRequest", length(12, 0x04, 0xd2, 0x16, 0x2e, 0, 0, 0, 1), false, true, "08P01"},
		{"SSLRequest with a startup pipelined", append(requestPacket(wire.SSLRequestCode), startupPacket(wire.ProtocolVersion30, "user", "postgres")...), false, true, "08P01"},
		{"random bytes", random, false, false, "08P01"},
	}
	t.Run("cases", func(t *testing.T) {
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				t.Parallel()
				r := dialRaw(t, proxyAddr(p))
				r.conn.SetDeadline(time.Now().Add(5 * time.Second)) //nolint:errcheck
				if len(tt.in) > 0 {
					r.conn.Write(tt.in) //nolint:errcheck // the proxy may close before reading it all
				}
				if tt.halfClose {
					r.conn.(interface{ CloseWrite() error }).CloseWrite() //nolint:errcheck
				}
				msgs, err := r.readAll()
				if !isClosed(err) {
					t.Fatalf("connection not closed within 5 s (%v), got %d messages", err, len(msgs))
				}
				e := errorOf(msgs)
				switch {
				case e == nil && tt.mustError:
					t.Fatalf("no ErrorResponse before the close (%v)", err)
				case e != nil && e.Code != tt.code:
					t.Fatalf("error %s %q, want %s", e.Code, e.Message, tt.code)
				case e != nil && e.Severity != "FATAL":
					t.Fatalf("severity %s", e.Severity)
				}
				if e != nil {
					t.Logf("%s: %s", e.Code, e.Message)
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
