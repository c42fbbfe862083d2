package proxy

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/sqltx"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

const bufSize = 32 << 10

// session is one client and its upstream connection.
type session struct {
	srv *Server
	log *zap.Logger

	client, server net.Conn
	cr, sr         *wire.Reader
	cw, sw         *bufio.Writer
	cwMu, swMu     sync.Mutex

	// BackendKeyData of the upstream backend, to cancel its queries.
	pid uint32
	key []byte

	clientTLS bool // the client connection is TLS

	// ownPrepared is true while the check is prepared on the server under
	// the name ownPrepared (DEALLOCATE, DISCARD ALL or a Close by the
	// client make it false for good: the proxy then sends the check's text).
	ownPrepared atomic.Bool

	cred     fence.Credentials
	mode     checkMode
	checkSQL string
	sub      *fence.Subscription

	// stale is set when a higher token was admitted for the session's
	// resource; admitted is that token.
	stale         atomic.Bool
	admitted      atomic.Int64
	blocked       atomic.Pointer[fence.Error] // resource blocked: lock free, or LockIndex regression
	closeOnStale  bool                        // close the session at its next idle point once stale
	consulChecked bool                        // the token was validated against Consul
	cancelSent    atomic.Bool
	shuttingDown  atomic.Bool
	closeReason   atomic.Pointer[fence.Error]
	// The server's lexing settings as last reported (ParameterStatus), read
	// for every Query and Parse of a fenced session: atomics, no lock.
	stdStringsOff  atomic.Bool // standard_conforming_strings is off
	encodingUnsafe atomic.Bool // client_encoding may hide a backslash in a multibyte character

	// Shared between the two relay directions, guarded by mu.
	mu          sync.Mutex
	cond        *sync.Cond
	status      byte // from the last ReadyForQuery relayed
	outstanding int  // units (Sync, Query, FunctionCall) forwarded but not answered
	closed      bool
	done        chan struct{} // closed when the relay ends
	queue       entryQueue
}

type checkMode uint8

const (
	modePassthrough checkMode = iota // unfenced, allowed: relay only
	modeFenced                       // fence.check at every commit point
	modeReadOnly                     // fence.check_readonly at every commit point
)

// fatal is an error the client sees as a FATAL ErrorResponse before the
// connection closes.
type fatal struct {
	resp *pgproto3.ErrorResponse
	err  error
}

func (f *fatal) Error() string { return f.resp.Message }
func (f *fatal) Unwrap() error { return f.err }

func fatalf(code, format string, args ...any) *fatal {
	return &fatal{resp: &pgproto3.ErrorResponse{Severity: wire.SeverityFatal, Code: code, Message: fmt.Sprintf(format, args...)}}
}

func fatalFence(fe *fence.Error) *fatal {
	return &fatal{resp: fe.Response(wire.SeverityFatal), err: fe}
}

func (s *Server) handle(ctx context.Context, conn net.Conn) {
	sess := &session{srv: s, client: conn, status: 'I', done: make(chan struct{})}
	sess.cond = sync.NewCond(&sess.mu)
	sess.log = s.log.With(zap.Uint64("session", s.sessionIDs.Add(1)))
	if tc, ok := conn.(*net.TCPConn); ok {
		tc.SetNoDelay(true) //nolint:errcheck // best effort
	}
	n := s.clients.Add(1)
	defer s.clients.Add(-1)
	defer conn.Close()

	err := sess.start(ctx, n)
	if err != nil {
		if sess.server != nil {
			sess.server.Close()
		}
		var f *fatal
		if errors.As(err, &f) {
			s.metrics.sessionOutcome("refused")
			if f.resp.Code[:2] == "ZF" {
				s.metrics.rejection(f.resp.Code)
			}
			sess.log.Info("session refused", zap.String("sqlstate", f.resp.Code), zap.String("reason", f.resp.Message))
			// sess.client, not conn: after an SSLRequest the error goes over TLS.
			sess.client.SetWriteDeadline(time.Now().Add(time.Second)) //nolint:errcheck
			sess.client.Write(wire.AppendError(nil, f.resp))          //nolint:errcheck // the connection closes anyway
		} else if !errors.Is(err, errCancelHandled) && !errors.Is(err, io.EOF) {
			s.metrics.sessionOutcome("error")
			sess.log.Debug("session ended during startup", zap.Error(err))
		}
		return
	}
	s.metrics.sessionOutcome("ok")
	s.metrics.sessions(1)
	defer s.metrics.sessions(-1)
	s.track(sess, true)
	defer s.track(sess, false)
	defer sess.sub.Close()
	err = sess.relay(ctx)
	if err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
		sess.log.Debug("session ended", zap.Error(err))
	}
}

var errCancelHandled = errors.New("cancel request handled")

// start negotiates TLS, reads the startup message, validates the fence
// parameters, connects upstream, relays authentication and, for fenced
// sessions, raises the token. On success the client has received
// ReadyForQuery and the session is ready to relay.
func (sess *session) start(ctx context.Context, clients int64) error {
	s := sess.srv
	loginCtx, cancel := context.WithTimeout(ctx, s.cfg.LoginTimeout)
	defer cancel()
	var timedOut atomic.Bool
	// The raw connection: login replaces sess.client after a TLS handshake,
	// and a deadline on the raw connection stops TLS reads too.
	raw := sess.client
	stop := context.AfterFunc(loginCtx, func() {
		timedOut.Store(true)
		raw.SetDeadline(time.Now()) //nolint:errcheck
		if sc := sess.serverConn(); sc != nil {
			sc.SetDeadline(time.Now()) //nolint:errcheck
		}
	})
	err := sess.login(loginCtx, clients)
	if !stop() || timedOut.Load() {
		// Whatever failed first (a read, the server's answer), the cause is
		// the timeout: say so, and whose side was late.
		var f *fatal
		if errors.As(err, &f) && f.resp.Code == wire.CodeConnectionFailure {
			return fatalf(wire.CodeConnectionFailure, "login timeout: the server did not complete startup within %s (fenceproxy --login-timeout)", s.cfg.LoginTimeout)
		}
		return fatalf(wire.CodeProtocolViolation, "login timeout: startup and authentication took longer than %s (fenceproxy --login-timeout)", s.cfg.LoginTimeout)
	}
	if err != nil {
		return err
	}
	sess.client.SetDeadline(time.Time{}) //nolint:errcheck
	sess.server.SetDeadline(time.Time{}) //nolint:errcheck
	return nil
}

func (sess *session) serverConn() net.Conn {
	sess.mu.Lock()
	defer sess.mu.Unlock()
	return sess.server
}

func (sess *session) login(ctx context.Context, clients int64) error {
	s := sess.srv
	br := bufio.NewReaderSize(sess.client, bufSize)
	tlsDone := false
	var st *wire.Startup
	for st == nil {
		p, err := wire.ReadStartup(br)
		if err != nil {
			if errors.Is(err, wire.ErrUnsupportedProtocol) {
				return fatalf(wire.CodeFeatureNotSupported, "%v", err)
			}
			if errors.Is(err, wire.ErrStartup) {
				return fatalf(wire.CodeProtocolViolation, "%v", err)
			}
			return err
		}
		switch p.Kind {
		case wire.KindSSLRequest, wire.KindGSSENCRequest:
			// Bytes sent before our one-byte answer would be read as
			// plaintext after the TLS switch: refuse them, as PostgreSQL
			// and PgBouncer do.
			if br.Buffered() > 0 {
				return fatalf(wire.CodeProtocolViolation, "received unencrypted data after %s", p.Kind)
			}
			if p.Kind == wire.KindSSLRequest && s.cfg.clientTLS != nil && !tlsDone {
				if _, err := sess.client.Write([]byte{'S'}); err != nil {
					return err
				}
				tc := tls.Server(sess.client, s.cfg.clientTLS)
				if err := tc.HandshakeContext(ctx); err != nil {
					return fmt.Errorf("client TLS handshake: %w", err)
				}
				sess.client = tc
				sess.clientTLS = true
				br = bufio.NewReaderSize(tc, bufSize)
				tlsDone = true
				continue
			}
			if _, err := sess.client.Write([]byte{'N'}); err != nil {
				return err
			}
		case wire.KindCancelRequest:
			if err := s.forwardCancel(ctx, p); err != nil {
				sess.log.Debug("cancel request not delivered", zap.Error(err))
			}
			return errCancelHandled
		case wire.KindStartup:
			st = p
		}
	}
	if clients > int64(s.cfg.MaxClients) {
		return fatalf(wire.CodeTooManyConnections, "sorry, too many clients already (fenceproxy max-clients %d)", s.cfg.MaxClients)
	}
	if s.draining.Load() {
		return fatalf(wire.CodeCannotConnectNow, "fenceproxy is shutting down")
	}
	if err := sess.classify(ctx, st); err != nil {
		return err
	}

	up, err := s.dialUpstream(ctx)
	if err != nil {
		return fatalf(wire.CodeConnectionFailure, "fenceproxy could not connect to the server: %v", err)
	}
	sess.mu.Lock()
	sess.server = up
	sess.mu.Unlock()
	if dl, ok := ctx.Deadline(); ok {
		up.SetDeadline(dl) //nolint:errcheck
	}
	sess.cr = wire.NewReader(br, bufSize, s.cfg.MaxMessageSize)
	sess.cw = bufio.NewWriterSize(sess.client, bufSize)
	sess.sr = wire.NewReader(up, bufSize, s.cfg.MaxMessageSize)
	sess.sw = bufio.NewWriterSize(up, bufSize)
	if _, err := up.Write(st.Encode(nil)); err != nil {
		return fatalf(wire.CodeConnectionFailure, "fenceproxy lost the server during startup: %v", err)
	}
	return sess.relayAuth(ctx)
}

// classify reads the fence parameters (removing them from the startup
// message) and decides the session's mode.
func (sess *session) classify(ctx context.Context, st *wire.Startup) error {
	s := sess.srv
	cred, err := fence.FromStartup(st, s.cfg.names)
	if err != nil {
		var fe *fence.Error
		if errors.As(err, &fe) {
			return fatalFence(fe)
		}
		return fatalf(fence.CodeMalformed, "%v", err)
	}
	sess.cred = cred
	if !cred.Present {
		switch s.cfg.Unfenced {
		case UnfencedAllow:
			sess.mode = modePassthrough
		case UnfencedReadOnly:
			sess.mode = modeReadOnly
			sess.checkSQL = fence.CheckReadOnlySQL()
			// The early, friendly refusal ("cannot execute INSERT in a
			// read-only transaction"). The client can SET it off; the
			// injected fence.check_readonly is what it cannot switch off.
			st.SetParam("default_transaction_read_only", "on")
		default:
			return fatalFence(fence.Missing("this proxy requires a fencing token for every session (--unfenced=reject)"))
		}
		return nil
	}
	sess.mode = modeFenced
	sess.checkSQL, err = fence.CheckSQL(cred.Resource, cred.Token)
	if err != nil {
		return fatalf(fence.CodeMalformed, "%v", err)
	}
	sess.log = sess.log.With(zap.String("resource", cred.Resource), zap.Int64("token", cred.Token))
	if h := s.reg.Highest(cred.Resource); h > cred.Token {
		return fatalFence(fence.Stale(cred.Resource, cred.Token, h))
	}
	if v, ok := s.admit.(interface{ Validates(string) bool }); ok && v.Validates(cred.Resource) {
		// Consul says who holds the lock: when it hands the lock to a newer
		// holder, this session is closed at its next idle point.
		sess.consulChecked = true
		sess.closeOnStale = true
	}
	if s.admit != nil {
		if err := s.admit.Admit(ctx, cred); err != nil {
			var fe *fence.Error
			if errors.As(err, &fe) {
				return fatalFence(fe)
			}
			return fatalFence(fence.Unavailable(cred.Resource, err.Error()))
		}
	}
	return nil
}

// relayAuth relays the authentication exchange unchanged until the server's
// first ReadyForQuery, which it holds back until the token is raised.
func (sess *session) relayAuth(ctx context.Context) error {
	for {
		typ, _, err := sess.sr.Next()
		if err != nil {
			return fatalf(wire.CodeConnectionFailure, "fenceproxy lost the server during authentication: %v", err)
		}
		body, err := sess.sr.Body()
		if err != nil {
			return fatalf(wire.CodeConnectionFailure, "fenceproxy lost the server during authentication: %v", err)
		}
		switch typ {
		case 'R':
			if len(body) < 4 {
				return fatalf(wire.CodeProtocolViolation, "malformed authentication request from the server")
			}
			if err := sess.toClient(typ, body, true); err != nil {
				return err
			}
			switch binary.BigEndian.Uint32(body) {
			case 0, 12: // AuthenticationOk, SASLFinal: no answer
			case 2, 6: // Kerberos V5, SCM credentials: unsupported by PostgreSQL 9.1+
				return fatalf(wire.CodeProtocolViolation, "unsupported authentication method requested by the server")
			default: // cleartext, MD5, GSS, SSPI, SASL, SASLContinue: the client answers
				if err := sess.relayAuthAnswer(); err != nil {
					return err
				}
			}
		case 'E':
			// Authentication failed or the server refused us: relay as is,
			// with a hint when SCRAM channel binding could not work through
			// the proxy. (Binding cannot be repaired in flight: SCRAM signs
			// the client's view of it, and withdrawing SCRAM-SHA-256-PLUS makes
			// the server detect a downgrade.)
			if e, err := wire.DecodeError(body); err == nil && e.Code == wire.CodeInvalidAuthorization &&
				strings.Contains(e.Message, "channel binding") && sess.bindingMismatch() {
				e.Hint = "fenceproxy terminates TLS with its own certificate, so SCRAM channel binding to the server cannot verify: " +
					"connect with channel_binding=disable, give the proxy the server's certificate and key (--tls-cert, --tls-key), or reach the server without TLS (e.g. its Unix socket)"
				body = wire.AppendError(nil, e)[5:]
			}
			sess.toClient(typ, body, true) //nolint:errcheck
			return errors.New("server refused the session")
		case 'K':
			if len(body) < 8 {
				return fatalf(wire.CodeProtocolViolation, "malformed BackendKeyData from the server")
			}
			sess.pid = binary.BigEndian.Uint32(body)
			sess.key = append([]byte(nil), body[4:]...)
			if err := sess.toClient(typ, body, false); err != nil {
				return err
			}
		case 'S':
			sess.noteParameter(body)
			if err := sess.toClient(typ, body, false); err != nil {
				return err
			}
		case 'Z':
			if len(body) != 1 {
				return fatalf(wire.CodeProtocolViolation, "malformed ReadyForQuery from the server")
			}
			if err := sess.afterLogin(ctx); err != nil {
				return err
			}
			sess.status = body[0]
			return sess.toClient(typ, body, true)
		default: // NegotiateProtocolVersion, NoticeResponse, ...
			if err := sess.toClient(typ, body, false); err != nil {
				return err
			}
		}
	}
}

// bindingMismatch reports whether SCRAM channel binding would fail: both
// legs are TLS and the proxy presents a different certificate from the
// server's (tls-server-end-point binds to the certificate's hash, so a proxy
// that presents the server's own certificate keeps binding working).
func (sess *session) bindingMismatch() bool {
	up, ok := sess.server.(*tls.Conn)
	if !sess.clientTLS || !ok {
		return false
	}
	peers := up.ConnectionState().PeerCertificates
	certs := sess.srv.cfg.clientTLS.Certificates
	if len(peers) == 0 || len(certs) == 0 || len(certs[0].Certificate) == 0 {
		return true
	}
	return !bytes.Equal(peers[0].Raw, certs[0].Certificate[0])
}

func (sess *session) relayAuthAnswer() error {
	typ, _, err := sess.cr.Next()
	if err != nil {
		return err
	}
	if typ != 'p' {
		return fatalf(wire.CodeProtocolViolation, "expected an authentication answer, got message type %q", typ)
	}
	body, err := sess.cr.Body()
	if err != nil {
		return err
	}
	if err := wire.WriteMessage(sess.sw, typ, body); err != nil {
		return err
	}
	return sess.sw.Flush()
}

func (sess *session) toClient(typ byte, body []byte, flush bool) error {
	if err := wire.WriteMessage(sess.cw, typ, body); err != nil {
		return err
	}
	if flush {
		return sess.cw.Flush()
	}
	return nil
}

// noteParameter tracks the two settings that decide how SQL text lexes:
// the proxy's parser reads strings as with standard_conforming_strings=on
// and an ASCII-safe client_encoding, so fenced sessions are refused SQL
// while either is otherwise (see internal/sqltx's doc).
func (sess *session) noteParameter(body []byte) {
	name, rest, err := wire.CString(body)
	if err != nil {
		return
	}
	val, _, _ := wire.CString(rest)
	switch name {
	case "standard_conforming_strings":
		sess.stdStringsOff.Store(val != "on")
	case "client_encoding":
		sess.encodingUnsafe.Store(!sqltx.ClientEncodingSafe(val))
	}
}

// afterLogin raises a fenced session's token in its own transaction on the
// session's own connection (with the client's credentials) before the
// client sees ReadyForQuery, and refuses the session if a higher token is
// already stored.
func (sess *session) afterLogin(ctx context.Context) error {
	if sess.mode == modePassthrough {
		return nil
	}
	c := sess.cred
	// The check is prepared once per session: PostgreSQL then neither
	// parses nor plans it again at every commit (measured: that was most of
	// the check's cost). If the client deallocates it, the proxy falls back
	// to sending the check's text (see ownPrepared).
	prepare := "PREPARE " + ownPrepared + " AS " + sess.checkSQL
	q := prepare
	if sess.mode == modeFenced {
		raise, err := fence.RaiseSQL(c.Resource, c.Token)
		if err != nil {
			return fatalf(fence.CodeMalformed, "%v", err)
		}
		// Its own short transaction, READ COMMITTED and READ WRITE whatever
		// the session's defaults (default_transaction_isolation or _read_only
		// given in the startup options): under REPEATABLE READ two racing
		// raises would fail with 40001, and a read-only default would refuse
		// the raise.
		q = "BEGIN ISOLATION LEVEL READ COMMITTED READ WRITE; " + raise + "; COMMIT; " + prepare
	}
	if err := wire.WriteMessage(sess.sw, 'Q', append([]byte(q), 0)); err != nil {
		return err
	}
	if err := sess.sw.Flush(); err != nil {
		return err
	}
	var stored int64 = -1
	var serverErr *pgproto3.ErrorResponse
	for {
		typ, _, err := sess.sr.Next()
		if err != nil {
			return fatalf(wire.CodeConnectionFailure, "fenceproxy lost the server while raising the token: %v", err)
		}
		body, err := sess.sr.Body()
		if err != nil {
			return err
		}
		switch typ {
		case 'D':
			// One column, text format.
			if len(body) >= 6 && binary.BigEndian.Uint16(body) == 1 {
				n := int32(binary.BigEndian.Uint32(body[2:]))
				if n > 0 && int(n) <= len(body)-6 {
					stored, _ = strconv.ParseInt(string(body[6:6+n]), 10, 64)
				}
			}
		case 'E':
			serverErr, _ = wire.DecodeError(body)
		case 'S':
			sess.noteParameter(body)
			if err := sess.toClient(typ, body, false); err != nil {
				return err
			}
		case 'N', 'A':
			// Notices of our own statement are not the client's business.
		case 'Z':
			if serverErr != nil && sess.mode == modeReadOnly {
				return fatalf(fence.CodeUnavailable, "fenceproxy could not prepare the read-only check: %s (SQLSTATE %s); is the fence schema installed in this database (fenceproxy migrate)?",
					serverErr.Message, serverErr.Code)
			}
			if sess.mode == modeReadOnly {
				sess.ownPrepared.Store(true)
				return nil
			}
			if serverErr != nil {
				if serverErr.Code[:2] == "ZF" {
					return &fatal{resp: &pgproto3.ErrorResponse{Severity: wire.SeverityFatal, Code: serverErr.Code,
						Message: serverErr.Message, Detail: serverErr.Detail, Hint: serverErr.Hint}}
				}
				return fatalf(fence.CodeUnavailable, "fenceproxy could not raise fencing token %d for resource %q: %s (SQLSTATE %s); is the fence schema installed in this database (fenceproxy migrate) and may this role execute fence.raise?",
					c.Token, c.Resource, serverErr.Message, serverErr.Code)
			}
			if stored < 0 {
				return fatalf(fence.CodeUnavailable, "fenceproxy could not read the stored token for resource %q", c.Resource)
			}
			if stored > c.Token && sess.consulChecked {
				// Consul just said this token is the current LockIndex, yet the
				// database admitted a higher one: Consul's numbers went backwards
				// (key re-created, plain PUT, snapshot restore). Fail closed and say so.
				fe := fence.Regression(c.Resource, fmt.Sprintf("Consul's current LockIndex is %d but the database already admitted token %d", c.Token, stored))
				sess.log.Error("failing closed: stored token above Consul's LockIndex", zap.Int64("stored", stored))
				return fatalFence(fe)
			}
			sess.srv.reg.Observe(c.Resource, stored)
			if stored > c.Token {
				return fatalFence(fence.Stale(c.Resource, c.Token, stored))
			}
			sess.ownPrepared.Store(true)
			sess.sub = sess.srv.reg.Subscribe(c.Resource, c.Token, fence.Handler{Stale: sess.onStale, Blocked: sess.onBlocked})
			return nil
		}
	}
}

// onStale runs when the registry learns of a higher token. It must not block.
func (sess *session) onStale(admitted int64) {
	sess.admitted.Store(admitted)
	sess.stale.Store(true)
	sess.mu.Lock()
	busy := sess.outstanding > 0 || sess.queue.len() > 0
	sess.mu.Unlock()
	sess.log.Info("session went stale", zap.Int64("admitted", admitted), zap.Bool("in_flight", busy))
	if busy {
		go sess.cancelInFlight()
	}
	if sess.closeOnStale {
		// A new holder exists: close the old one's session as soon as it is
		// idle (right away if it is), telling it why.
		sess.closeWhenIdle(sess.staleError())
	}
}

// onBlocked runs when the resource is blocked or unblocked.
func (sess *session) onBlocked(err *fence.Error) {
	sess.blocked.Store(err)
	if err != nil {
		sess.log.Info("session blocked", zap.String("reason", err.Message))
	}
}

// refusal is the error a fenced session's statements are refused with
// before they run, or nil.
func (sess *session) refusal() *fence.Error {
	if sess.mode != modeFenced {
		return nil
	}
	if sess.stale.Load() {
		return sess.staleError()
	}
	return sess.blocked.Load()
}

// cancelInFlight asks the server to cancel the session's running query.
func (sess *session) cancelInFlight() {
	if !sess.cancelSent.CompareAndSwap(false, true) {
		return
	}
	sess.srv.metrics.cancel()
	ctx, cancel := context.WithTimeout(context.Background(), sess.srv.cfg.ConnectTimeout)
	defer cancel()
	req := &wire.Startup{Kind: wire.KindCancelRequest, ProcessID: sess.pid, SecretKey: sess.key}
	if err := sess.srv.forwardCancel(ctx, req); err != nil {
		sess.log.Warn("could not cancel the stale session's query", zap.Error(err))
	}
}

// shutdownWhenIdle closes the session now if it is idle between
// transactions, or at its next idle point.
func (sess *session) shutdownWhenIdle() {
	sess.closeWhenIdle(nil)
}

// closeWhenIdle closes the session with a FATAL error (nil: fenceproxy is
// shutting down) now if it is idle between transactions, or at its next
// idle point.
func (sess *session) closeWhenIdle(why *fence.Error) {
	if why != nil {
		sess.closeReason.Store(why)
	}
	sess.shuttingDown.Store(true)
	sess.mu.Lock()
	idle := sess.outstanding == 0 && sess.queue.len() == 0 && sess.status == 'I'
	sess.mu.Unlock()
	if idle {
		sess.closeForShutdown()
	}
}

func (sess *session) closeForShutdown() {
	resp := &pgproto3.ErrorResponse{Severity: wire.SeverityFatal, Code: wire.CodeAdminShutdown,
		Message: "terminating connection because fenceproxy is shutting down"}
	if why := sess.closeReason.Load(); why != nil {
		resp = why.Response(wire.SeverityFatal)
	}
	sess.cwMu.Lock()
	if sess.cw != nil {
		sess.client.SetWriteDeadline(time.Now().Add(time.Second))        //nolint:errcheck
		wire.WriteMessage(sess.cw, 'E', wire.AppendError(nil, resp)[5:]) //nolint:errcheck
		sess.cw.Flush()                                                  //nolint:errcheck
	}
	sess.cwMu.Unlock()
	// Half-close first so that the client reads the FATAL before it sees the end.
	if cw, ok := sess.client.(interface{ CloseWrite() error }); ok {
		cw.CloseWrite() //nolint:errcheck
	}
	if sc := sess.serverConn(); sc != nil {
		sc.Close()
	}
	sess.client.Close()
}
