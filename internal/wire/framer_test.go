package wire_test

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/wire"
)

func TestReader(t *testing.T) {
	var in []byte
	in = wire.AppendMessage(in, 'Q', []byte("SELECT 1\x00"))
	big := bytes.Repeat([]byte{'x'}, 200_000)
	in = wire.AppendMessage(in, 'd', big)
	in = wire.AppendMessage(in, 'S', nil)
	r := wire.NewReader(bytes.NewReader(in), 4096, 1<<20)

	typ, n, err := r.Next()
	if err != nil || typ != 'Q' || n != 9 {
		t.Fatalf("first: %q %d %v", typ, n, err)
	}
	body, err := r.Body()
	if err != nil || string(body) != "SELECT 1\x00" {
		t.Fatalf("body %q %v", body, err)
	}
	typ, n, err = r.Next()
	if err != nil || typ != 'd' || n != len(big) {
		t.Fatalf("second: %q %d %v", typ, n, err)
	}
	var out bytes.Buffer
	w := bufio.NewWriter(&out)
	if err := r.CopyBody(w); err != nil {
		t.Fatal(err)
	}
	w.Flush()
	if !bytes.Equal(out.Bytes(), wire.AppendMessage(nil, 'd', big)) {
		t.Fatal("streamed copy differs")
	}
	typ, n, err = r.Next()
	if err != nil || typ != 'S' || n != 0 {
		t.Fatalf("third: %q %d %v", typ, n, err)
	}
	if _, _, err := r.Next(); err != io.EOF {
		t.Fatalf("end: %v", err)
	}
}

func TestReaderLimits(t *testing.T) {
	tests := []struct {
		name string
		in   []byte
		want error
	}{
		{"too large", wire.AppendMessage(nil, 'Q', make([]byte, 2000)), wire.ErrMessageTooLarge},
		{"length below 4", []byte{'Q', 0, 0, 0, 3}, wire.ErrMalformed},
		{"truncated header", []byte{'Q', 0, 0}, io.ErrUnexpectedEOF},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := wire.NewReader(bytes.NewReader(tt.in), 4096, 1000)
			_, _, err := r.Next()
			if !errors.Is(err, tt.want) {
				t.Fatalf("got %v, want %v", err, tt.want)
			}
		})
	}
	r := wire.NewReader(bytes.NewReader([]byte{'Q', 0, 0, 0, 100, 1, 2}), 4096, 1000)
	if _, _, err := r.Next(); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Body(); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("truncated body: %v", err)
	}
}

// FuzzReader frames arbitrary bytes: it must never panic, never return a
// body longer than the limit, and re-encoding what it framed must give back
// a prefix of the input.
func FuzzReader(f *testing.F) {
	f.Add(wire.AppendMessage(wire.AppendMessage(nil, 'Q', []byte("SELECT 1\x00")), 'S', nil), 64)
	f.Add([]byte{'d', 0, 0, 0, 4, 'X', 0, 0, 0, 4}, 1)
	f.Add([]byte{'Q', 0xff, 0xff, 0xff, 0xff}, 0)
	f.Fuzz(func(t *testing.T, in []byte, mode int) {
		const max = 1 << 16
		r := wire.NewReader(bytes.NewReader(in), 16, max)
		var out bytes.Buffer
		w := bufio.NewWriter(&out)
		for i := 0; ; i++ {
			typ, n, err := r.Next()
			if err != nil {
				break
			}
			if n > max {
				t.Fatalf("body of %d bytes above the limit", n)
			}
			if (i+mode)%2 == 0 {
				body, err := r.Body()
				if err != nil {
					break
				}
				wire.WriteMessage(w, typ, body)
			} else if err := r.CopyBody(w); err != nil {
				break
			}
		}
		w.Flush()
		if !bytes.HasPrefix(in, out.Bytes()) {
			t.Fatalf("re-encoded stream is not a prefix of the input")
		}
	})
}
