package wire_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"reflect"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/wire"
)

func packet(code uint32, rest ...byte) []byte {
	b := binary.BigEndian.AppendUint32(nil, uint32(8+len(rest)))
	b = binary.BigEndian.AppendUint32(b, code)
	return append(b, rest...)
}

func TestReadStartup(t *testing.T) {
	params := []byte("user\x00alice\x00database\x00app\x00options\x00-c fence.token=3\x00\x00")
	tests := []struct {
		name    string
		in      []byte
		want    *wire.Startup
		wantErr bool
		framing bool // the error wraps ErrStartupLength
	}{
		{"ssl", packet(wire.SSLRequestCode), &wire.Startup{Kind: wire.KindSSLRequest}, false, false},
		{"gss", packet(wire.GSSENCRequestCode), &wire.Startup{Kind: wire.KindGSSENCRequest}, false, false},
		{"cancel", packet(wire.CancelRequestCode, 0, 0, 0, 7, 1, 2, 3, 4), &wire.Startup{Kind: wire.KindCancelRequest, ProcessID: 7, SecretKey: []byte{1, 2, 3, 4}}, false, false},
		{"cancel 3.2 long key", packet(wire.CancelRequestCode, append([]byte{0, 0, 0, 9}, bytes.Repeat([]byte{5}, 32)...)...), &wire.Startup{Kind: wire.KindCancelRequest, ProcessID: 9, SecretKey: bytes.Repeat([]byte{5}, 32)}, false, false},
		{"startup 3.0", packet(wire.ProtocolVersion30, params...), &wire.Startup{Kind: wire.KindStartup, Version: wire.ProtocolVersion30, Params: []wire.Param{{"user", "alice"}, {"database", "app"}, {"options", "-c fence.token=3"}}}, false, false},
		{"startup 3.2", packet(3<<16|2, params...), &wire.Startup{Kind: wire.KindStartup, Version: 3<<16 | 2, Params: []wire.Param{{"user", "alice"}, {"database", "app"}, {"options", "-c fence.token=3"}}}, false, false},
		{"startup no params", packet(wire.ProtocolVersion30, 0), &wire.Startup{Kind: wire.KindStartup, Version: wire.ProtocolVersion30}, false, false},
		{"protocol 2", packet(2<<16, 0), nil, true, false},
		{"no terminator", packet(wire.ProtocolVersion30, []byte("user\x00x")...), nil, true, false},
		{"missing value", packet(wire.ProtocolVersion30, []byte("user\x00\x00")...), nil, true, false},
		{"empty value", packet(wire.ProtocolVersion30, []byte("user\x00\x00\x00")...), &wire.Startup{Kind: wire.KindStartup, Version: wire.ProtocolVersion30, Params: []wire.Param{{"user", ""}}}, false, false},
		{"name without value", packet(wire.ProtocolVersion30, []byte("user\x00alice\x00db\x00")...), nil, true, false},
		{"ssl with trailing", packet(wire.SSLRequestCode, 1), &wire.Startup{Kind: wire.KindSSLRequest}, false, false},
		{"short cancel", packet(wire.CancelRequestCode, 0, 0, 0, 1), nil, true, true},
		{"too short", []byte{0, 0, 0, 4}, nil, true, true},
		{"too long", binary.BigEndian.AppendUint32(nil, 20000), nil, true, true},
		{"http", []byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"), nil, true, true},
		{"truncated", []byte{0, 0, 0, 100, 0, 3, 0, 0}, nil, true, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := wire.ReadStartup(bytes.NewReader(tt.in))
			if tt.wantErr {
				if err == nil {
					t.Fatalf("want error, got %v", got)
				}
				if !errors.Is(err, wire.ErrStartup) {
					t.Fatalf("error %v does not wrap ErrStartup", err)
				}
				if errors.Is(err, wire.ErrStartupLength) != tt.framing {
					t.Fatalf("error %v: wraps ErrStartupLength %v, want %v", err, !tt.framing, tt.framing)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("got %+v, want %+v", got, tt.want)
			}
			// Round trip.
			again, err := wire.ReadStartup(bytes.NewReader(got.Encode(nil)))
			if err != nil || !reflect.DeepEqual(again, got) {
				t.Fatalf("round trip: %+v, %v", again, err)
			}
		})
	}
}

func TestOptions(t *testing.T) {
	tests := []struct {
		in       string
		args     []string
		settings []wire.Setting
		rest     []string
	}{
		{`-c fence.token=34`, []string{"-c", "fence.token=34"}, []wire.Setting{{"fence.token", "34"}}, nil},
		{`-cfence.resource=billing  -c fence.token=1`, []string{"-cfence.resource=billing", "-c", "fence.token=1"}, []wire.Setting{{"fence.resource", "billing"}, {"fence.token", "1"}}, nil},
		{`--fence.token=7 -c search_path=a\ b`, []string{"--fence.token=7", "-c", "search_path=a b"}, []wire.Setting{{"fence.token", "7"}}, []string{"-c", "search_path=a b"}},
		{`-c Fence.Token=9 --statement-timeout=5`, []string{"-c", "Fence.Token=9", "--statement-timeout=5"}, []wire.Setting{{"fence.token", "9"}}, []string{"--statement-timeout=5"}},
		{`-c x=a\\b`, []string{"-c", `x=a\b`}, nil, []string{"-c", `x=a\b`}},
		{"", nil, nil, nil},
		{`  -B 10  `, []string{"-B", "10"}, nil, []string{"-B", "10"}},
		// Switches clustered as getopt reads them: -ec x is -e -c x, and -e-x is -e --x. A
		// review's -ec fence.token=1 was set by the server while the proxy saw no token.
		{`-ec fence.token=1`, []string{"-ec", "fence.token=1"}, []wire.Setting{{"fence.token", "1"}}, []string{"-e"}},
		{`-Pcfence.token=5`, []string{"-Pcfence.token=5"}, []wire.Setting{{"fence.token", "5"}}, []string{"-P"}},
		{`-e-fence.token=2`, []string{"-e-fence.token=2"}, []wire.Setting{{"fence.token", "2"}}, []string{"-e"}},
		{`-nc x=1`, []string{"-nc", "x=1"}, nil, []string{"-nc", "x=1"}},
		// -B takes the next argument, "-c", as its own: no setting (the server then refuses
		// the stray argument).
		{`-B -c fence.token=3`, []string{"-B", "-c", "fence.token=3"}, nil, []string{"-B", "-c", "fence.token=3"}},
		{`-Bc -c fence.token=4`, []string{"-Bc", "-c", "fence.token=4"}, []wire.Setting{{"fence.token", "4"}}, []string{"-Bc"}},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			args := wire.SplitOptions(tt.in)
			if !reflect.DeepEqual(args, tt.args) {
				t.Fatalf("split %q = %q, want %q", tt.in, args, tt.args)
			}
			if got := wire.SplitOptions(wire.JoinOptions(args)); !reflect.DeepEqual(got, args) && len(args) > 0 {
				t.Fatalf("join/split round trip: %q", got)
			}
			found, rest, err := wire.ExtractSettings(args, func(n string) bool { return len(n) > 6 && n[:6] == "fence." })
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(found, tt.settings) || !reflect.DeepEqual(rest, tt.rest) {
				t.Fatalf("extract: %q %q, want %q %q", found, rest, tt.settings, tt.rest)
			}
		})
	}
	for _, args := range [][]string{{"-c"}, {"-ec"}, {"-B"}} {
		if _, _, err := wire.ExtractSettings(args, func(string) bool { return true }); err == nil {
			t.Fatalf("%q without argument: want error", args)
		}
	}
}

func FuzzParseStartup(f *testing.F) {
	f.Add(packet(wire.ProtocolVersion30, []byte("user\x00alice\x00\x00")...)[4:])
	f.Add(packet(wire.SSLRequestCode)[4:])
	f.Add(packet(wire.CancelRequestCode, 0, 0, 0, 7, 1, 2, 3, 4)[4:])
	f.Add([]byte{0, 3, 0, 2, 0})
	f.Fuzz(func(t *testing.T, body []byte) {
		s, err := wire.ParseStartup(body)
		if err != nil {
			if !errors.Is(err, wire.ErrStartup) {
				t.Fatalf("error %v does not wrap ErrStartup", err)
			}
			return
		}
		enc := s.Encode(nil)
		again, err := wire.ReadStartup(bytes.NewReader(enc))
		if err != nil && len(enc) <= wire.MaxStartupPacketLen {
			t.Fatalf("re-read of encoded %+v: %v", s, err)
		}
		if err == nil && !reflect.DeepEqual(again, s) {
			t.Fatalf("round trip %+v != %+v", again, s)
		}
	})
}

func FuzzOptions(f *testing.F) {
	f.Add(`-c fence.token=34 -c fence.resource=billing`)
	f.Add(`--fence-token=1 -c a=b\ c\\`)
	f.Fuzz(func(t *testing.T, s string) {
		args := wire.SplitOptions(s)
		for _, a := range args {
			if a == "" {
				return // "\" alone is an empty argument, which has no escaped form
			}
		}
		if got := wire.SplitOptions(wire.JoinOptions(args)); len(args) > 0 && !reflect.DeepEqual(got, args) {
			t.Fatalf("round trip of %q: %q != %q", s, got, args)
		}
		wire.ExtractSettings(args, func(string) bool { return true }) //nolint:errcheck // must not panic
	})
}
