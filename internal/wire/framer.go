package wire

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// DefaultMaxMessageSize is the largest message the proxy accepts by default:
// PostgreSQL's own limit for a single field is 1 GB, so real rows fit.
const DefaultMaxMessageSize = 1 << 30

// ErrMessageTooLarge is wrapped by the error for a message above the limit.
var ErrMessageTooLarge = errors.New("message too large")

// ErrMalformed is wrapped by errors about a message whose length field is
// impossible.
var ErrMalformed = errors.New("malformed message")

// Reader frames typed messages (1 type byte, 4 length bytes, body). It reads
// the header first so that the caller can decide whether to buffer the body
// (Body) or stream it (CopyBody, Discard) without holding it in memory.
type Reader struct {
	br      *bufio.Reader
	max     int
	buf     []byte
	typ     byte
	n       int // body length of the current message
	pending int // body bytes not yet consumed
}

// NewReader returns a Reader reading from r with a buffer of bufSize bytes
// that refuses messages whose body exceeds max bytes (max <= 0: DefaultMaxMessageSize).
func NewReader(r io.Reader, bufSize, max int) *Reader {
	if max <= 0 {
		max = DefaultMaxMessageSize
	}
	return &Reader{br: bufio.NewReaderSize(r, bufSize), max: max}
}

// Next discards what is left of the current message and reads the next header.
// It returns the message type and its body length.
func (r *Reader) Next() (typ byte, n int, err error) {
	if r.pending > 0 {
		if _, err := r.br.Discard(r.pending); err != nil {
			return 0, 0, err
		}
		r.pending = 0
	}
	hdr, err := r.br.Peek(5)
	if err != nil {
		if len(hdr) > 0 && errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return 0, 0, err
	}
	typ = hdr[0]
	l := binary.BigEndian.Uint32(hdr[1:])
	if _, err := r.br.Discard(5); err != nil {
		return 0, 0, err
	}
	if l < 4 {
		return 0, 0, fmt.Errorf("%w: type %q with length %d", ErrMalformed, typ, l)
	}
	if int64(l)-4 > int64(r.max) {
		return 0, 0, fmt.Errorf("%w: type %q of %d bytes exceeds the limit of %d bytes", ErrMessageTooLarge, typ, int64(l)-4, r.max)
	}
	r.typ, r.n, r.pending = typ, int(l)-4, int(l)-4
	return typ, r.n, nil
}

// Body reads the rest of the current message's body. The slice is valid only
// until the next call on r.
func (r *Reader) Body() ([]byte, error) {
	if r.pending != r.n {
		return nil, errors.New("wire: Body after partial read")
	}
	if cap(r.buf) < r.n {
		r.buf = make([]byte, r.n)
	}
	b := r.buf[:r.n]
	if _, err := io.ReadFull(r.br, b); err != nil {
		return nil, unexpected(err)
	}
	r.pending = 0
	// Do not pin huge buffers for the life of a session.
	if cap(r.buf) > 1<<20 {
		r.buf = nil
	}
	return b, nil
}

// ErrRead is wrapped by CopyBody's errors of reading (as opposed to writing w),
// and ErrCut too by those that leave part of the message written to w.
var (
	ErrRead = errors.New("wire: read")
	ErrCut  = errors.New("wire: message cut off")
)

// CopyBody writes the current message (header included) to w, streaming
// the body. A message that fits the read buffer is read whole before anything
// of it is written, so that a source that ends within it leaves no partial
// message in w (the writer can still end its stream with an error message of
// its own); a larger one is streamed. Errors of reading wrap ErrRead, and
// ErrCut when part of the message is in w (nothing can follow it then).
func (r *Reader) CopyBody(w *bufio.Writer) error {
	if r.pending == r.n && r.n <= r.br.Size() {
		b, err := r.br.Peek(r.n)
		if err != nil {
			return fmt.Errorf("%w: %w", ErrRead, unexpected(err))
		}
		if err := WriteHeader(w, r.typ, r.n); err != nil {
			return err
		}
		if _, err := w.Write(b); err != nil {
			return err
		}
		r.br.Discard(len(b)) //nolint:errcheck // Peek succeeded, so Discard cannot fail
		r.pending = 0
		return nil
	}
	if err := WriteHeader(w, r.typ, r.n); err != nil {
		return err
	}
	return r.CopyRest(w)
}

// CopyRest streams what is left of the current message's body to w, without
// its header (written already: by CopyBody, or, for a message whose start the
// proxy's event loop relayed, before Resume). Its read errors wrap ErrRead and
// ErrCut: part of the message is in w.
func (r *Reader) CopyRest(w *bufio.Writer) error {
	for r.pending > 0 {
		chunk := r.pending
		if b := r.br.Buffered(); b > 0 && b < chunk {
			chunk = b
		}
		if chunk > r.br.Size() {
			chunk = r.br.Size()
		}
		b, err := r.br.Peek(chunk)
		if err != nil {
			return fmt.Errorf("%w: %w: %w", ErrRead, ErrCut, unexpected(err))
		}
		if _, err := w.Write(b); err != nil {
			return err
		}
		r.br.Discard(len(b)) //nolint:errcheck // Peek succeeded, so Discard cannot fail
		r.pending -= len(b)
	}
	return nil
}

// Resume makes the reader continue inside a message whose first bytes went
// elsewhere: rest bytes of it come next, for CopyRest.
func (r *Reader) Resume(rest int) {
	r.typ, r.n, r.pending = 0, -1, rest
}

// Pending is how many bytes of the current message are still to come.
func (r *Reader) Pending() int { return r.pending }

// TakeBuffered returns, and consumes, what the reader has read past the
// current message (which it skips first, reading it if need be): the bytes
// another reader of the same stream must see first.
func (r *Reader) TakeBuffered() ([]byte, error) {
	if r.pending > 0 {
		if _, err := r.br.Discard(r.pending); err != nil {
			return nil, err
		}
		r.pending = 0
	}
	n := r.br.Buffered()
	if n == 0 {
		return nil, nil
	}
	b, _ := r.br.Peek(n)
	b = append([]byte(nil), b...)
	r.br.Discard(n) //nolint:errcheck // buffered
	return b, nil
}

// Buffered reports how many bytes can be read without blocking.
func (r *Reader) Buffered() int { return r.br.Buffered() }

// NextWhole reports whether the next message (after what is left of the current one) is
// in the buffer whole, so that reading it cannot block. The proxy flushes its writer
// unless it does: a message followed by the first bytes of the next must not wait in the
// writer for the rest (a review's client sent a query and part of the next message, and
// got no answer). A header that is malformed or above the limit counts as not whole:
// reading it fails, and what was written before must have gone out.
func (r *Reader) NextWhole() bool {
	skip := r.pending
	if r.br.Buffered() < skip+5 {
		return false
	}
	hdr, err := r.br.Peek(skip + 5)
	if err != nil {
		return false
	}
	l := int64(binary.BigEndian.Uint32(hdr[skip+1:]))
	return l >= 4 && l-4 <= int64(r.max) && int64(r.br.Buffered()) >= int64(skip)+1+l
}

func unexpected(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}

// WriteHeader writes a message header for a body of n bytes. It builds the
// header in w's free buffer, so it allocates nothing (a local array would
// escape to the heap through w.Write).
func WriteHeader(w *bufio.Writer, typ byte, n int) error {
	hdr := append(w.AvailableBuffer(), typ)
	hdr = binary.BigEndian.AppendUint32(hdr, uint32(n+4))
	_, err := w.Write(hdr)
	return err
}

// WriteMessage writes a whole message.
func WriteMessage(w *bufio.Writer, typ byte, body []byte) error {
	if err := WriteHeader(w, typ, len(body)); err != nil {
		return err
	}
	_, err := w.Write(body)
	return err
}

// AppendMessage appends a whole message to dst.
func AppendMessage(dst []byte, typ byte, body []byte) []byte {
	dst = append(dst, typ)
	dst = binary.BigEndian.AppendUint32(dst, uint32(len(body)+4))
	return append(dst, body...)
}
