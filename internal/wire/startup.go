package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strings"
)

// Request codes that replace the protocol version in the first packet.
const (
	CancelRequestCode uint32 = 80877102
	SSLRequestCode    uint32 = 80877103
	GSSENCRequestCode uint32 = 80877104

	// ProtocolVersion30 is protocol 3.0, the version PostgreSQL 7.4 to 17 speak.
	ProtocolVersion30 uint32 = 3 << 16

	// MaxStartupPacketLen is PostgreSQL's MAX_STARTUP_PACKET_LENGTH: the server
	// refuses longer first packets, and so does the proxy.
	MaxStartupPacketLen = 10000
)

// StartupKind says what a first packet asks for.
type StartupKind uint8

const (
	KindStartup StartupKind = iota + 1
	KindSSLRequest
	KindGSSENCRequest
	KindCancelRequest
)

func (k StartupKind) String() string {
	switch k {
	case KindStartup:
		return "StartupMessage"
	case KindSSLRequest:
		return "SSLRequest"
	case KindGSSENCRequest:
		return "GSSENCRequest"
	case KindCancelRequest:
		return "CancelRequest"
	}
	return fmt.Sprintf("StartupKind(%d)", uint8(k))
}

// Param is one startup parameter. Order is kept: the proxy forwards the
// parameters in the order the client sent them.
type Param struct {
	Name, Value string
}

// Startup is a decoded first packet.
type Startup struct {
	Kind StartupKind
	// Version is the requested protocol version (KindStartup only): major in
	// the high 16 bits, minor in the low 16 bits.
	Version uint32
	// Params are the startup parameters (KindStartup only).
	Params []Param
	// ProcessID and SecretKey identify the backend to cancel (KindCancelRequest
	// only). Protocol 3.2 allows keys longer than 4 bytes.
	ProcessID uint32
	SecretKey []byte
}

// ErrStartup is wrapped by every error about a malformed first packet.
var ErrStartup = errors.New("invalid startup packet")

// ErrStartupLength is wrapped (with ErrStartup) by the errors about a first
// packet's framing: a length out of range, a packet cut short, a
// CancelRequest of the wrong size. PostgreSQL only logs these and closes the
// connection without a word (a client that connects and ends before its
// startup, as node-postgres does, sends a Terminate here), unlike a
// malformed parameter list, which it answers with a FATAL 08P01.
var ErrStartupLength = errors.New("invalid length of startup packet")

// ErrUnsupportedProtocol is wrapped (with ErrStartup) by the error for a
// protocol version other than 3.x; PostgreSQL reports it as 0A000.
var ErrUnsupportedProtocol = errors.New("unsupported frontend protocol")

// ErrProtocol2 is wrapped (with ErrUnsupportedProtocol) by the error for a
// version below 3.0: such a client reads errors in protocol 2's format
// (AppendErrorV2), which PostgreSQL still answers it in.
var ErrProtocol2 = errors.New("protocol 2")

// startupError wraps several sentinels under one message.
type startupError struct {
	msg  string
	errs []error
}

func (e *startupError) Error() string   { return e.msg }
func (e *startupError) Unwrap() []error { return e.errs }

func startupErr(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrStartup, fmt.Sprintf(format, args...))
}

// ReadStartup reads one first packet (length-prefixed, no type byte) from r.
// The packet's length is checked before its body is read, so garbage never
// makes the proxy allocate more than MaxStartupPacketLen bytes.
func ReadStartup(r io.Reader) (*Startup, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n < 8 || n > MaxStartupPacketLen {
		return nil, fmt.Errorf("%w: %w: %d out of range [8, %d]", ErrStartup, ErrStartupLength, n, MaxStartupPacketLen)
	}
	body := make([]byte, n-4)
	if _, err := io.ReadFull(r, body); err != nil {
		return nil, fmt.Errorf("%w: %w: truncated: %w", ErrStartup, ErrStartupLength, err)
	}
	return ParseStartup(body)
}

// ParseStartup decodes the body of a first packet (everything after the length).
func ParseStartup(body []byte) (*Startup, error) {
	if len(body) < 4 {
		return nil, startupErr("%d bytes, need at least 4", len(body))
	}
	code := binary.BigEndian.Uint32(body)
	rest := body[4:]
	switch code {
	case SSLRequestCode, GSSENCRequestCode:
		// Bytes after the code are part of the packet and ignored, as
		// PostgreSQL 15 ignores them.
		if code == SSLRequestCode {
			return &Startup{Kind: KindSSLRequest}, nil
		}
		return &Startup{Kind: KindGSSENCRequest}, nil
	case CancelRequestCode:
		// 4 bytes of process ID, then the key: 4 bytes in protocol 3.0, up
		// to 256 in 3.2.
		if len(rest) < 8 || len(rest) > 4+256 {
			return nil, fmt.Errorf("%w: %w: cancel request of %d bytes", ErrStartup, ErrStartupLength, len(body))
		}
		return &Startup{
			Kind:      KindCancelRequest,
			ProcessID: binary.BigEndian.Uint32(rest),
			SecretKey: append([]byte(nil), rest[4:]...),
		}, nil
	}
	if code>>16 < 3 {
		return nil, &startupError{fmt.Sprintf("unsupported frontend protocol %d.%d: server supports 3.0 to 3.2", code>>16, code&0xffff), []error{ErrStartup, ErrUnsupportedProtocol, ErrProtocol2}}
	}
	if code>>16 != 3 {
		return nil, fmt.Errorf("%w: %w %d.%d: server supports 3.0 to 3.2", ErrStartup, ErrUnsupportedProtocol, code>>16, code&0xffff)
	}
	s := &Startup{Kind: KindStartup, Version: code}
	// name\0value\0 ... \0, exactly as PostgreSQL's ProcessStartupPacket
	// reads it: the last byte must be the terminator.
	if len(rest) == 0 || rest[len(rest)-1] != 0 {
		return nil, startupErr("expected terminator as last byte")
	}
	rest = rest[:len(rest)-1]
	for len(rest) > 0 {
		name, after, ok := cutNul(rest)
		if !ok {
			return nil, startupErr("parameter name without terminator")
		}
		if len(name) == 0 {
			return nil, startupErr("empty parameter name")
		}
		value, after2, ok := cutNul(after)
		if !ok {
			return nil, startupErr("parameter %q has no value", name)
		}
		s.Params = append(s.Params, Param{Name: string(name), Value: string(value)})
		rest = after2
	}
	return s, nil
}

func cutNul(b []byte) (before, after []byte, ok bool) {
	for i, c := range b {
		if c == 0 {
			return b[:i], b[i+1:], true
		}
	}
	return nil, nil, false
}

// Param returns the value of the named parameter and whether it was present.
// A parameter given twice has its last value, as PostgreSQL reads it.
func (s *Startup) Param(name string) (string, bool) {
	for i := len(s.Params) - 1; i >= 0; i-- {
		if s.Params[i].Name == name {
			return s.Params[i].Value, true
		}
	}
	return "", false
}

// SetParam replaces every occurrence of the named parameter, or appends it.
func (s *Startup) SetParam(name, value string) {
	found := false
	for i, p := range s.Params {
		if p.Name == name {
			s.Params[i].Value = value
			found = true
		}
	}
	if !found {
		s.Params = append(s.Params, Param{Name: name, Value: value})
	}
}

// DeleteParam removes the named parameter.
func (s *Startup) DeleteParam(name string) {
	out := s.Params[:0]
	for _, p := range s.Params {
		if p.Name != name {
			out = append(out, p)
		}
	}
	s.Params = out
}

// Encode appends the packet (with its length) to dst.
func (s *Startup) Encode(dst []byte) []byte {
	start := len(dst)
	dst = append(dst, 0, 0, 0, 0)
	switch s.Kind {
	case KindSSLRequest:
		dst = binary.BigEndian.AppendUint32(dst, SSLRequestCode)
	case KindGSSENCRequest:
		dst = binary.BigEndian.AppendUint32(dst, GSSENCRequestCode)
	case KindCancelRequest:
		dst = binary.BigEndian.AppendUint32(dst, CancelRequestCode)
		dst = binary.BigEndian.AppendUint32(dst, s.ProcessID)
		dst = append(dst, s.SecretKey...)
	default:
		dst = binary.BigEndian.AppendUint32(dst, s.Version)
		for _, p := range s.Params {
			dst = append(dst, p.Name...)
			dst = append(dst, 0)
			dst = append(dst, p.Value...)
			dst = append(dst, 0)
		}
		dst = append(dst, 0)
	}
	binary.BigEndian.PutUint32(dst[start:], uint32(len(dst)-start))
	return dst
}

// String describes the packet for logs without secrets (cancel keys are not printed).
func (s *Startup) String() string {
	switch s.Kind {
	case KindStartup:
		var b strings.Builder
		fmt.Fprintf(&b, "StartupMessage %d.%d", s.Version>>16, s.Version&0xffff)
		for _, p := range s.Params {
			fmt.Fprintf(&b, " %s=%q", p.Name, p.Value)
		}
		return b.String()
	case KindCancelRequest:
		return fmt.Sprintf("CancelRequest pid=%d", s.ProcessID)
	}
	return s.Kind.String()
}
