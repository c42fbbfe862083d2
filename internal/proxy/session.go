package proxy

import (
	"bufio"
	"bytes"
	"cmp"
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
	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/standby"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

const bufSize = 32 << 10

func newWriter(c net.Conn) *bufio.Writer { return bufio.NewWriterSize(c, bufSize) }

// session is one client and its upstream connection.
//
// Ownership: login fills the connections, cred, mode, database, pid and key
// before the relay starts and nothing changes them afterwards. During the
// relay, cw belongs to whoever holds cwMu and sw to clientToServer, its only
// writer; status and outstanding are guarded by mu; the rest are atomics or
// set once.
type session struct {
	srv *Server
	log *zap.Logger

	client, server net.Conn
	cr, sr         *wire.Reader
	cw, sw         *bufio.Writer
	cwMu           sync.Mutex

	// BackendKeyData of the upstream backend: its pid is also what the bind
	// is keyed by (with its backend_start, which the database reads itself).
	pid uint32
	key []byte

	clientTLS bool // the client connection is TLS

	id      uint64    // the session's number in the logs and SHOW CLIENTS
	since   time.Time // when the client connected
	user    string    // the startup message's user
	console bool      // an admin console connection (console.go), not relayed

	// host is the index of the --upstream host the session reached (upstream.go);
	// hotStandby and readOnlyDefault are what its startup reported (in_hot_standby,
	// default_transaction_read_only; "" when not reported).
	host                        int
	hotStandby, readOnlyDefault string

	cred         fence.Credentials
	mode         sessionMode
	database     string // the database the session connects to (the registry's key, the proof's)
	guardChecked bool   // the token was validated by its lock service's Guard
	holder       string // the lock's holder the admitter showed with the token ("" if none): recorded by the bind
	leaseBind    bool   // bound with fence.lease_bind (a --lease-resource): its row starts with the lease's holder
	sub          *fence.Subscription

	// stale is set when a higher token was admitted for the session's
	// resource (admitted is that token, staleCh is closed then).
	stale       atomic.Bool
	admitted    atomic.Int64
	staleOnce   sync.Once
	staleCh     chan struct{}
	blocked     atomic.Pointer[fence.Error] // resource blocked: lock free, or LockIndex regression
	serverFatal atomic.Pointer[pgproto3.ErrorResponse]
	serverSaid  atomic.Bool // a FATAL of the server's own (not 57P01) was relayed to the client
	cut         atomic.Bool // the server's stream ended inside a message relayed in part

	shuttingDown atomic.Bool
	endOnce      sync.Once
	ended        atomic.Bool                            // end ran
	endedCh      chan struct{}                          // closed when end runs
	lingerResp   atomic.Pointer[pgproto3.ErrorResponse] // endFencing's error, for answerEnded (staleLinger)
	draining     atomic.Bool                            // relay drains the client connection before it closes it
	finSent      atomic.Bool                            // endFencing sent the client its FATAL and the end (no linger for an answer)
	told         atomic.Bool                            // endFencing told the idle client with a FATAL (answerEnded's unit gets no second one)
	slotFreed    atomic.Bool                            // the session's --max-clients slot is given back (freeSlot)

	// loop is the session's time in the event loop (loop_linux.go), nil if it had none;
	// resume says that serverToClient starts with the rest of a message the loop relayed
	// in part, holding cwMu.
	loop      atomic.Pointer[loopSession]
	loopState atomic.Int32
	resume    bool

	mu          sync.Mutex
	status      byte // from the last ReadyForQuery relayed
	outstanding int  // units (Sync, Query, FunctionCall) forwarded but not answered
	// pending is an end waiting for the answers in flight
	// (endWhenAnswered), pendingTimer its bound.
	pending      *pendingEnd
	pendingTimer *time.Timer
	done         chan struct{} // closed when the relay ends
}

// freeSlot gives the session's --max-clients slot back, once: when it closes, or when a
// raise ended its backend and only its client's answer remains.
func (sess *session) freeSlot() {
	if sess.slotFreed.CompareAndSwap(false, true) {
		sess.srv.clients.Add(-1)
	}
}

type sessionMode uint8

const (
	modeUnfenced sessionMode = iota // no token: relay only (reject refused it at startup)
	modeFenced                      // bound to its token at startup
)

// fatal is an error the client sees as a FATAL ErrorResponse before the
// connection closes.
type fatal struct {
	resp *pgproto3.ErrorResponse
	err  error
	// protocol2: the client asked for protocol 2 and reads its errors in
	// that format.
	protocol2 bool
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
	sess := &session{srv: s, client: conn, status: 'I', done: make(chan struct{}), staleCh: make(chan struct{}), endedCh: make(chan struct{})}
	sess.id, sess.since = s.sessionIDs.Add(1), time.Now()
	sess.log = s.log.With(zap.Uint64("session", sess.id))
	if tc, ok := conn.(*net.TCPConn); ok {
		tc.SetNoDelay(true) //nolint:errcheck // best effort
	}
	n := s.clients.Add(1)
	defer sess.freeSlot()
	defer conn.Close()
	// The subscription (what counts the session in its resource's sessions per token) is
	// made by bind, and the start may still fail after it (the client gone before its
	// ReadyForQuery): every exit from here closes it.
	defer func() { sess.sub.Close() }()

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
				r := Refusal{At: time.Now(), Resource: sess.cred.Resource, Token: sess.cred.Token, SQLState: f.resp.Code, Message: f.resp.Message}
				if fe := (*fence.Error)(nil); r.Resource == "" && errors.As(f, &fe) {
					r.Resource, r.Token = fe.Resource, fe.Token // refused before its credentials were read (ZF005)
				}
				s.lead.refusal(r)
			}
			sess.log.Info("session refused", zap.String("sqlstate", f.resp.Code), zap.String("reason", f.resp.Message))
			// sess.client, not conn: after an SSLRequest the error goes over TLS.
			sess.client.SetWriteDeadline(time.Now().Add(time.Second)) //nolint:errcheck
			msg := wire.AppendError(nil, f.resp)
			if f.protocol2 {
				msg = wire.AppendErrorV2(nil, f.resp.Severity, f.resp.Message)
			}
			sess.client.Write(msg) //nolint:errcheck // the connection closes anyway
		} else if !errors.Is(err, errCancelHandled) && !errors.Is(err, io.EOF) {
			s.metrics.sessionOutcome("error")
			sess.log.Debug("session ended during startup", zap.Error(err))
		}
		return
	}
	s.metrics.sessionOutcome("ok")
	if sess.console {
		s.serveConsole(sess)
		return
	}
	s.metrics.sessions(1)
	defer s.metrics.sessions(-1)
	s.track(sess, true)
	defer s.track(sess, false)
	err = sess.relay(ctx)
	if err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
		sess.log.Debug("session ended", zap.Error(err))
	}
	if sess.stale.Load() {
		s.lead.endedStale(sess.cred.Resource)
	}
}

var errCancelHandled = errors.New("cancel request handled")

// start negotiates TLS, reads the startup message, validates the fence
// parameters, connects upstream, relays authentication and, for fenced
// sessions, binds the backend to the token. On success the client has received
// ReadyForQuery and the session is ready to relay.
func (sess *session) start(ctx context.Context, clients int64) error {
	s := sess.srv
	loginTimeout := s.conf().loginTimeout
	loginCtx, cancel := context.WithTimeout(ctx, loginTimeout)
	defer cancel()
	// The raw connection: login replaces sess.client after a TLS handshake,
	// and a deadline on the raw connection stops TLS reads too.
	raw := sess.client
	var mu sync.Mutex // held by the AfterFunc while it runs
	timedOut := false
	stop := context.AfterFunc(loginCtx, func() {
		mu.Lock()
		defer mu.Unlock()
		timedOut = true
		raw.SetDeadline(time.Now()) //nolint:errcheck
		if sc := sess.serverConn(); sc != nil {
			sc.SetDeadline(time.Now()) //nolint:errcheck
		}
	})
	err := sess.login(loginCtx, clients)
	stop()
	mu.Lock() // an AfterFunc that started has finished
	defer mu.Unlock()
	if err == nil {
		// The client has its ReadyForQuery: the session started, whatever
		// the clock says now. Deadlines the AfterFunc set are lifted.
		sess.client.SetDeadline(time.Time{}) //nolint:errcheck
		sess.server.SetDeadline(time.Time{}) //nolint:errcheck
		return nil
	}
	if errors.Is(err, errPaused) {
		return err // it says why it waited, and what ends the pause
	}
	// The upstream connection's own deadline is the login deadline too (login
	// sets it): its read may fail before the AfterFunc runs, and before the
	// context itself says it is done.
	dl, _ := loginCtx.Deadline()
	if timedOut || !time.Now().Before(dl) {
		if sess.mode == modeFenced && sess.pid != 0 {
			// The bind may still be running (its raise waiting for a stale
			// backend to exit): cancel it, or it could commit a raise that
			// no client waits for any more.
			sess.cancelBackend()
		}
		// Whatever failed first (a read, the server's answer), the cause is
		// the timeout: say so, and whose side was late.
		var f *fatal
		var cut *bindCut
		if errors.As(err, &cut) {
			// The bind's wait: stale backends to exit, or the synchronous standbys'
			// confirmation of its COMMIT (a review found the bare "did not complete
			// startup" sent operators to the network, not to the standby).
			return &fatal{resp: &pgproto3.ErrorResponse{Severity: wire.SeverityFatal, Code: wire.CodeConnectionFailure,
				Message: fmt.Sprintf("login timeout: the bind of the session to its fencing token did not finish within %s (fenceproxy --login-timeout)", loginTimeout),
				Detail:  "A bind waits for the backends of lower tokens to exit when it raises the token and, with synchronous_standby_names set on the server, for the synchronous standbys to confirm its COMMIT: check that they stream (pg_stat_replication; docs/failover.md).",
				Hint:    "fenceproxy: " + cut.outcome()}, err: err}
		}
		if errors.As(err, &f) && f.resp.Code == wire.CodeConnectionFailure {
			return fatalf(wire.CodeConnectionFailure, "login timeout: the server did not complete startup within %s (fenceproxy --login-timeout)", loginTimeout)
		}
		return fatalf(wire.CodeProtocolViolation, "login timeout: startup and authentication took longer than %s (fenceproxy --login-timeout)", loginTimeout)
	}
	return err
}

func (sess *session) serverConn() net.Conn {
	sess.mu.Lock()
	defer sess.mu.Unlock()
	return sess.server
}

func (sess *session) login(ctx context.Context, clients int64) error {
	s := sess.srv
	br := bufio.NewReaderSize(sess.client, bufSize)
	// As PostgreSQL's ProcessStartupPacket: one SSLRequest and one
	// GSSENCRequest at most, a GSSENCRequest not after TLS.
	sslDone, gssDone := false, false
	var st *wire.Startup
	for st == nil {
		p, err := wire.ReadStartup(br)
		if err != nil {
			if errors.Is(err, wire.ErrStartupLength) {
				// PostgreSQL closes without a word here (a client that
				// connects and ends at once writes a Terminate first).
				return fmt.Errorf("closed without an answer: %w", err)
			}
			if errors.Is(err, wire.ErrUnsupportedProtocol) {
				f := fatalf(wire.CodeFeatureNotSupported, "%v", err)
				f.protocol2 = errors.Is(err, wire.ErrProtocol2)
				return f
			}
			if errors.Is(err, wire.ErrStartup) {
				return fatalf(wire.CodeProtocolViolation, "%v", err)
			}
			return err
		}
		switch p.Kind {
		case wire.KindSSLRequest, wire.KindGSSENCRequest:
			if p.Kind == wire.KindSSLRequest && sslDone || p.Kind == wire.KindGSSENCRequest && gssDone {
				// PostgreSQL reads a second request as a protocol version.
				return fatalf(wire.CodeFeatureNotSupported, "%v: a second %s", wire.ErrUnsupportedProtocol, p.Kind)
			}
			// Bytes sent before our one-byte answer would be read as
			// plaintext after the TLS switch: refuse them, as PostgreSQL
			// and PgBouncer do (PostgreSQL after its answer when it has
			// no TLS to offer).
			unencrypted := br.Buffered() > 0
			if p.Kind == wire.KindSSLRequest {
				sslDone = true
			} else {
				gssDone = true
			}
			if p.Kind == wire.KindSSLRequest && s.cfg.clientTLS != nil {
				if unencrypted {
					return fatalf(wire.CodeProtocolViolation, "received unencrypted data after %s", p.Kind)
				}
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
				gssDone = true
				continue
			}
			if _, err := sess.client.Write([]byte{'N'}); err != nil {
				return err
			}
			if unencrypted {
				return fatalf(wire.CodeProtocolViolation, "received unencrypted data after %s", p.Kind)
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
	sess.user, _ = st.Param("user")
	if db, _ := st.Param("database"); cmp.Or(db, sess.user) == s.conf().adminDatabase { // PostgreSQL's default: the user's name
		// Not refused by --max-clients: an operator must get in when the proxy is full.
		if s.draining.Load() {
			return fatalf(wire.CodeCannotConnectNow, "fenceproxy is shutting down")
		}
		return sess.consoleLogin(ctx, br, st)
	}
	if maxClients := s.conf().maxClients; clients > int64(maxClients) {
		return fatalf(wire.CodeTooManyConnections, "sorry, too many clients already (fenceproxy max-clients %d)", maxClients)
	}
	if s.draining.Load() {
		return fatalf(wire.CodeCannotConnectNow, "fenceproxy is shutting down")
	}
	if err := sess.classify(st); err != nil {
		return err
	}
	if err := sess.waitResumed(ctx); err != nil {
		return err
	}
	if s.draining.Load() {
		return fatalf(wire.CodeCannotConnectNow, "fenceproxy is shutting down")
	}
	return sess.authenticate(ctx, br, st)
}

// authenticate connects to the server, sends it st and relays the authentication exchange
// (relayAuth: a fenced session is bound before its ReadyForQuery). br is the client's reader.
func (sess *session) authenticate(ctx context.Context, br *bufio.Reader, st *wire.Startup) error {
	s := sess.srv
	up, host, err := s.dialUpstream(ctx, s.wantOf(sess.mode == modeFenced))
	sess.host = host
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
	sess.cw = newWriter(sess.client)
	sess.sr = wire.NewReader(up, bufSize, s.cfg.MaxMessageSize)
	sess.sw = newWriter(up)
	if _, err := up.Write(st.Encode(nil)); err != nil {
		return fatalf(wire.CodeConnectionFailure, "fenceproxy lost the server during startup: %v", err)
	}
	return sess.relayAuth(ctx)
}

// classify reads the fence parameters (removing them from the startup
// message) and decides the session's mode.
func (sess *session) classify(st *wire.Startup) error {
	conf := sess.srv.conf()
	cred, err := fence.FromStartup(st, conf.names)
	if err != nil {
		var fe *fence.Error
		if errors.As(err, &fe) {
			return fatalFence(fe)
		}
		return fatalf(fence.CodeMalformed, "%v", err)
	}
	sess.cred = cred
	sess.database, _ = st.Param("database")
	if sess.database == "" {
		sess.database, _ = st.Param("user") // PostgreSQL's default
	}
	if !cred.Present {
		switch conf.unfenced {
		case UnfencedAllow:
		case UnfencedReadOnly:
			// Best effort: a client can SET it off. A role without write
			// privileges is what enforces read-only (README).
			st.SetParam("default_transaction_read_only", "on")
		default:
			return fatalFence(fence.Missing("this proxy requires a fencing token for every session (--unfenced=reject)"))
		}
		return nil
	}
	sess.mode = modeFenced
	sess.log = sess.log.With(zap.String("resource", cred.Resource), zap.Int64("token", cred.Token))
	return nil
}

// admit decides, after authentication (a client that has not authenticated
// learns nothing of the tokens), whether a fenced session's token may be
// bound: not below the highest token this proxy knows of (the early
// refusal; fence.bind refuses it anyway), and Consul's word when the resource
// has a lock key. For a Consul resource, Consul is asked first: a token below
// the stored one that Consul shows as current is a regression (ZF007, the
// Guard decides), not a stale leader (ZF001).
func (sess *session) admit(ctx context.Context) error {
	err := sess.admitToken(ctx)
	var f *fatal
	if errors.As(err, &f) {
		switch f.resp.Code {
		case fence.CodeStale, fence.CodeHolderMismatch, fence.CodeMissing:
			// A leader that holds another lock than the one this proxy validates sees it here.
			if g := guardOf(sess.srv.admit, sess.cred.Resource); g != nil {
				a := g.Authority(sess.cred.Resource)
				f.resp.Hint = strings.TrimSpace(f.resp.Hint + fmt.Sprintf(" This proxy validates resource %q against %s: a lock held elsewhere is not this resource's.",
					sess.cred.Resource, a))
			}
		}
	}
	return err
}

func (sess *session) admitToken(ctx context.Context) error {
	s, cred := sess.srv, sess.cred
	if w := s.controlMismatch(); w != "" {
		fe := fence.Unavailable(cred.Resource, w)
		fe.Hint = "The session is not started (fail closed). Point --control-database at the --upstream's hosts and restart the proxy (docs/guarantee.md)."
		return fatalFence(fe)
	}
	sess.guardChecked = guardOf(s.admit, cred.Resource) != nil
	if h := s.reg.Highest(sess.database, cred.Resource); h > cred.Token && !sess.guardChecked {
		return fatalFence(fence.Stale(cred.Resource, cred.Token, h))
	}
	if s.admit != nil {
		var err error
		if ha, ok := s.admit.(HolderAdmitter); ok {
			sess.holder, err = ha.AdmitHolder(ctx, cred)
		} else {
			err = s.admit.Admit(ctx, cred)
		}
		if err != nil {
			if h := s.reg.Highest(sess.database, cred.Resource); h > cred.Token && !fence.IsRegression(err) && !errors.Is(err, fence.ErrMoved) {
				// Stale whatever Consul's state (unknown during an outage): say so.
				return fatalFence(fence.Stale(cred.Resource, cred.Token, h))
			}
			var fe *fence.Error
			if errors.As(err, &fe) {
				return fatalFence(fe)
			}
			return fatalFence(fence.Unavailable(cred.Resource, err.Error()))
		}
	}
	if h := s.reg.Highest(sess.database, cred.Resource); h > cred.Token {
		return fatalFence(fence.Stale(cred.Resource, cred.Token, h))
	}
	return nil
}

// relayAuth relays the authentication exchange unchanged until the server's
// first ReadyForQuery, which it holds back until the session is bound.
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
		case 'Z':
			if len(body) != 1 {
				return fatalf(wire.CodeProtocolViolation, "malformed ReadyForQuery from the server")
			}
			// body aliases the server reader's buffer, which the bind reuses
			// for its own answers: keep the status byte, not the slice (a
			// kept slice told psycopg 3 'T' on the Consul path, and it
			// skipped its first BEGIN).
			status := body[0]
			if err := sess.checkRole(); err != nil {
				return err
			}
			if err := sess.bind(ctx); err != nil {
				return err
			}
			sess.status = status
			return sess.toClient(typ, []byte{status}, true)
		default: // NegotiateProtocolVersion, NoticeResponse, ...
			if typ == 'S' {
				sess.noteParameter(body)
			}
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

// maxAuthMessage is the largest authentication answer relayed: PostgreSQL's own
// PG_MAX_AUTH_TOKEN_LENGTH. Before authentication nobody is trusted with the
// 1 GiB limit of an authenticated session's messages, which the proxy would
// buffer whole.
const maxAuthMessage = 65535

func (sess *session) relayAuthAnswer() error {
	typ, n, err := sess.cr.Next()
	if err != nil {
		return err
	}
	if typ != 'p' {
		return fatalf(wire.CodeProtocolViolation, "expected an authentication answer, got message type %q", typ)
	}
	if n > maxAuthMessage {
		return fatalf(wire.CodeProtocolViolation, "authentication message of %d bytes is too large (at most %d)", n, maxAuthMessage)
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

// bindStart opens the bind's own transaction: READ COMMITTED and READ WRITE
// whatever the session's defaults (default_transaction_isolation or _read_only
// in the startup options: fence.bind refuses other isolation levels, and a
// read-only default would refuse the raise), and without the role's or the
// client's statement, lock and idle-in-transaction timeouts (a bind that raises
// waits for the stale backends to exit, within the raise's own bound and the
// login timeout; a role or database setting of idle_in_transaction_session_timeout
// ended the bind's transaction between its messages on a loaded server), and with
// the search_path pinned to pg_catalog: the bind's statements name no function or
// operator that the client's own search_path could shadow (a review's client defined
// its own pg_current_wal_flush_lsn() ahead of pg_catalog and was admitted without
// the standby wait).
const bindStart = "BEGIN ISOLATION LEVEL READ COMMITTED READ WRITE; SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = 0; SET LOCAL idle_in_transaction_session_timeout = 0; SET LOCAL search_path = pg_catalog, pg_temp"

// bind binds a fenced session's backend to its token (fence.bind, which
// raises the token first when it is higher, ending the backends bound to lower
// ones) in its own transaction on the session's own connection, with the
// client's credentials, after authentication and before the client sees
// ReadyForQuery: the client can send nothing before its backend is bound. A
// refusal closes the session.
//
// The proof goes as a parameter of the extended protocol, not in the SQL
// text: pg_stat_activity shows the text to the role's other sessions.
func (sess *session) bind(ctx context.Context) error {
	if sess.mode != modeFenced {
		return nil
	}
	if err := sess.admit(ctx); err != nil {
		return err
	}
	if sess.pid == 0 {
		return fatalf(fence.CodeUnavailable, "fenceproxy cannot bind the session: the server sent no BackendKeyData")
	}
	query, args, err := sess.bindCall()
	if err != nil {
		return fatalf(fence.CodeMalformed, "%v", err)
	}
	msgs := []pgproto3.FrontendMessage{
		&pgproto3.Query{String: bindStart},
		&pgproto3.Parse{Query: query},
		&pgproto3.Bind{Parameters: args},
		&pgproto3.Execute{},
		&pgproto3.Sync{},
		&pgproto3.Query{String: "COMMIT"},
	}
	conf := sess.srv.conf()
	standbys := conf.standbys
	answers := 3 // ReadyForQuery after the BEGIN, the Sync and the COMMIT
	if !standbys.Empty() {
		// The WAL position after the commit, in the same round trip: the standbys must
		// flush up to it before the session starts (waitStandbys).
		msgs = append(msgs, &pgproto3.Query{String: standby.FlushedLSNQuery})
		answers++
	}
	var buf []byte
	for _, m := range msgs {
		if buf, err = m.Encode(buf); err != nil {
			return err
		}
	}
	started := time.Now()
	if _, err := sess.sw.Write(buf); err != nil {
		return err
	}
	if err := sess.sw.Flush(); err != nil {
		return err
	}
	var row [][]byte
	var lsn string
	var serverErr *pgproto3.ErrorResponse
	var commitWarning *pgproto3.ErrorResponse // a WARNING of the COMMIT's: its wait for the synchronous standbys was cancelled (D3)
	for ready := 0; ready < answers; {
		typ, _, err := sess.sr.Next()
		if err != nil {
			// Once the Sync's answer is in, the COMMIT runs: a raise it carries may be
			// committed on the primary (and not on the standbys) whatever ended it.
			cut := &bindCut{committing: ready >= 2, err: err}
			if serverErr != nil && serverErr.Severity == wire.SeverityFatal {
				// The server said why (a pg_terminate_backend of the
				// binding backend: 57P01): its own words.
				return &fatal{resp: &pgproto3.ErrorResponse{Severity: wire.SeverityFatal, Code: serverErr.Code,
					Message: serverErr.Message, Detail: serverErr.Detail,
					Hint: "fenceproxy: the server ended the session's backend while binding it to its fencing token; " + cut.outcome()}, err: cut}
			}
			return &fatal{resp: &pgproto3.ErrorResponse{Severity: wire.SeverityFatal, Code: wire.CodeConnectionFailure,
				Message: fmt.Sprintf("fenceproxy lost the server while binding the session: %v", err), Hint: "fenceproxy: " + cut.outcome()}, err: cut}
		}
		body, err := sess.sr.Body()
		if err != nil {
			return err
		}
		switch typ {
		case 'D':
			var d pgproto3.DataRow
			switch {
			case d.Decode(body) != nil:
			case ready == 3: // the LSN query's row
				if len(d.Values) == 1 {
					lsn = string(d.Values[0]) // a copy: the values alias the reader's buffer
				}
			default:
				for _, v := range d.Values { // they alias the reader's buffer
					row = append(row, bytes.Clone(v))
				}
			}
		case 'E':
			if serverErr == nil {
				serverErr, _ = wire.DecodeError(body)
			}
		case 'N':
			// PostgreSQL answers a cancel of a commit's wait for the synchronous standbys
			// with a WARNING (01000) and the commit, visible here but maybe not there.
			if ready == 2 && commitWarning == nil {
				if n, err := wire.DecodeError(body); err == nil && n.SeverityUnlocalized == wire.SeverityWarning {
					commitWarning = n
				}
			}
		case 'S':
			if err := sess.toClient(typ, body, false); err != nil {
				return err
			}
		case 'Z':
			ready++
		}
		// Notices and the other answers of our own statements are not the client's business.
	}
	err = sess.bound(ctx, row, serverErr)
	if err == nil && commitWarning != nil {
		// (D3 of docs/proof.md) The bind committed here, but nothing says the synchronous
		// standbys have it, nor the raise it rests on: not admitted (fail closed).
		sess.log.Warn("the bind's commit was not confirmed by the synchronous standbys", zap.String("warning", commitWarning.Message))
		fe := fence.Unavailable(sess.cred.Resource, fmt.Sprintf("token %d is committed on the primary, but its wait for the synchronous standbys was cancelled (%s), so a failover could lose it", sess.cred.Token, commitWarning.Message))
		fe.Hint = "The session is not started (fail closed). Retry: the next session's bind waits for the synchronous standbys again; if they do not stream, fix replication or synchronous_standby_names (docs/failover.md)."
		err = fatalFence(fe)
	}
	if err == nil && !standbys.Empty() {
		err = sess.waitStandbys(ctx, conf, lsn)
	}
	outcome := "bound"
	if err != nil {
		outcome = "refused"
	}
	sess.srv.metrics.bind(outcome, time.Since(started))
	return err
}

// bindCut is a bind whose answer the proxy could not read to the end: the server ended the
// backend, the connection broke, or the login timeout cut it.
type bindCut struct {
	committing bool // the COMMIT had started: the raise, if the bind made one, may be committed
	err        error
}

func (b *bindCut) Error() string { return b.err.Error() }
func (b *bindCut) Unwrap() error { return b.err }

// outcome says what a cut bind left behind and what to do.
func (b *bindCut) outcome() string {
	if b.committing {
		return "the session is not started, but its COMMIT had begun: a raise of its token may be committed on the primary (fenceproxy fence history shows it) while a wait for the synchronous standbys was cut. Retry: the next session's bind waits again."
	}
	return "nothing was committed or bound, retry."
}

// waitStandbys waits until the failover standbys have flushed the bind's commit (at or
// before lsn): whether the bind raised the token here or another session's raise did, the
// session's token is admitted for good only once a failover cannot lose it. A standby that
// does not confirm within --standby-flush-timeout fails the start, named (fail closed).
func (sess *session) waitStandbys(ctx context.Context, conf *live, lsn string) error {
	s, c := sess.srv, sess.cred
	if lsn == "" {
		return fatalFence(fence.Unavailable(c.Resource, "fenceproxy could not read the WAL position of the bind's commit, so it cannot wait for the failover standbys to flush it"))
	}
	started := time.Now()
	err := conf.standbys.WaitFlushed(ctx, s.control, lsn, conf.standbyFlushTimeout)
	s.metrics.standbyWait(err, time.Since(started))
	if err == nil {
		return nil
	}
	var nf *standby.NotFlushedError
	if errors.As(err, &nf) {
		sess.log.Warn("failover standbys did not confirm the bind", zap.Strings("pending", nf.Pending), zap.String("lsn", lsn))
		fe := fence.Unavailable(c.Resource, fmt.Sprintf("token %d is committed on the primary but not yet on the standbys a failover may promote: %v", c.Token, err))
		fe.Hint = "The session is not started (fail closed). Retry once the standby streams again, or remove it from fenceproxy --failover-standbys if it can no longer be promoted (docs/failover.md)."
		if nf.Unread {
			fe.Hint = "The session is not started (fail closed). The proxy's --control-database connection did not answer: check that it reaches the primary (list every host with target_session_attrs=read-write), then retry (docs/failover.md)."
		}
		return fatalFence(fe)
	}
	if ctx.Err() != nil {
		return err // the login timeout: start says so
	}
	return fatalFence(fence.Unavailable(c.Resource, fmt.Sprintf("cannot confirm that the failover standbys flushed the bind: %v", err)))
}

// cancelBackend asks the server to cancel what the session's backend runs.
func (sess *session) cancelBackend() {
	ctx, cancel := context.WithTimeout(context.Background(), sess.srv.cfg.ConnectTimeout)
	defer cancel()
	req := &wire.Startup{Kind: wire.KindCancelRequest, ProcessID: sess.pid, SecretKey: sess.key}
	if err := sess.srv.forwardCancel(ctx, req); err != nil {
		sess.log.Warn("could not cancel the backend's statement", zap.Error(err))
	}
}

// bindCall is the bind's statement and its parameters: with the holder's record
// (fence.ConsulBindQuery) when the admitter named the lock's holder.
func (sess *session) bindCall() (string, [][]byte, error) {
	c, k := sess.cred, sess.srv.cfg.Key
	if sess.holder != "" {
		args, err := k.ConsulBindCall(sess.database, c.Resource, c.Token, sess.holder, sess.pid)
		return fence.ConsulBindQuery, args, err
	}
	call, err := k.BindCall(sess.database, c.Resource, c.Token, sess.pid)
	if sess.srv.conf().authority(c.Resource) == lease.StorePostgres {
		// No token before the lease exists (fence.lease_bind, L10 of migration 10).
		sess.leaseBind = true
		return fence.LeaseBindQuery, call.Args(), err
	}
	return fence.BindQuery, call.Args(), err
}

// bound judges the bind's outcome: row is the bind statement's row (nil: none).
func (sess *session) bound(ctx context.Context, row [][]byte, serverErr *pgproto3.ErrorResponse) error {
	c := sess.cred
	judge, _ := sess.srv.admit.(HolderAdmitter)
	if serverErr != nil {
		if serverErr.Code == fence.CodeStale && sess.guardChecked && judge != nil {
			// Consul said this token was current, yet the database admitted a higher
			// one: a hand-over since Consul's answer (stale, ZF001), or Consul's numbers
			// went backwards (ZF007). A consistent read made now tells them apart;
			// taking every such refusal for a regression told stale holders of quick
			// hand-overs ZF007.
			err := judge.Judge(ctx, c.Resource, c.Token, sess.holder, fence.ConsulRecord{Token: storedOf(serverErr.Message, c.Token)})
			var fe *fence.Error
			if errors.As(err, &fe) {
				return fatalFence(fe)
			}
			return fatalFence(fence.Unavailable(c.Resource, fmt.Sprint(err)))
		}
		if f := sess.keyRefused(serverErr); f != nil {
			return f
		}
		if strings.HasPrefix(serverErr.Code, "ZF") {
			return &fatal{resp: &pgproto3.ErrorResponse{Severity: wire.SeverityFatal, Code: serverErr.Code,
				Message: serverErr.Message, Detail: serverErr.Detail, Hint: serverErr.Hint}}
		}
		switch serverErr.Code {
		case "25006": // read_only_sql_transaction: BEGIN READ WRITE on a standby (a server before 14 does not report in_hot_standby)
			return fatalf(wire.CodeCannotConnectNow, "fenceproxy: the server at %s is in recovery (a standby): a fenced session needs the writable primary (%s)",
				sess.srv.cfg.upstream.hosts[max(sess.host, 0)], serverErr.Message)
		case "42883", "3F000", "42P01", "42501": // undefined function, schema or table; no privilege
			return fatalf(fence.CodeUnavailable, "fenceproxy could not bind the session to fencing token %d of resource %q: %s (SQLSTATE %s); this fenceproxy needs fence schema version %d in this database (run fenceproxy migrate), and this role must be allowed to execute the fence schema's functions",
				c.Token, c.Resource, serverErr.Message, serverErr.Code, fence.SchemaVersion)
		}
		// Another cause (e.g. 08P01 in a replication connection, which takes no extended
		// query): the server's own words.
		return fatalf(fence.CodeUnavailable, "fenceproxy could not bind the session to fencing token %d of resource %q: %s (SQLSTATE %s)",
			c.Token, c.Resource, serverErr.Message, serverErr.Code)
	}
	stored := int64(-1)
	if sess.holder != "" {
		// recorded, recorded holder, regression, stored (ConsulBindQuery)
		if len(row) != 4 {
			return fatalf(fence.CodeUnavailable, "fenceproxy could not read the database's record of Consul tokens for resource %q: this fenceproxy needs fence schema version %d (run fenceproxy migrate)", c.Resource, fence.SchemaVersion)
		}
		rec := fence.ConsulRecord{Holder: string(row[1]), Regression: string(row[2])}
		rec.Token, _ = strconv.ParseInt(string(row[0]), 10, 64)
		if !rec.Admits(c.Token, sess.holder) {
			if judge == nil {
				return fatalFence(fence.Unavailable(c.Resource, "the database's record of Consul tokens does not admit the token"))
			}
			var fe *fence.Error
			if err := judge.Judge(ctx, c.Resource, c.Token, sess.holder, rec); errors.As(err, &fe) {
				return fatalFence(fe)
			} else if err != nil {
				return fatalFence(fence.Unavailable(c.Resource, err.Error()))
			}
			return fatalFence(fence.Unavailable(c.Resource, "the database's record of Consul tokens does not admit the token"))
		}
		row = row[3:]
	}
	var leaseHolder string
	if sess.leaseBind {
		// holder (NULL unless the token is the lease's current generation), stored
		if len(row) != 2 {
			return fatalf(fence.CodeUnavailable, "fenceproxy could not read fence.lease_bind's answer for resource %q: this fenceproxy needs fence schema version %d (run fenceproxy migrate)", c.Resource, fence.SchemaVersion)
		}
		leaseHolder = string(row[0])
		row = row[1:]
	}
	if len(row) == 1 && row[0] != nil {
		stored, _ = strconv.ParseInt(string(row[0]), 10, 64)
	}
	if stored < 0 {
		return fatalf(fence.CodeUnavailable, "fenceproxy could not read the stored token for resource %q", c.Resource)
	}
	sess.srv.reg.Observe(sess.database, c.Resource, stored)
	// Consul's word on the holder (the session from the consistent read) before the client's.
	sess.srv.reg.SetHolder(c.Resource, c.Token, cmp.Or(sess.holder, leaseHolder, c.Session))
	if stored > c.Token { // fence.bind refuses this itself; never trust one side alone
		return fatalFence(fence.Stale(c.Resource, c.Token, stored))
	}
	sess.sub = sess.srv.reg.Subscribe(sess.database, c.Resource, c.Token, fence.Handler{Stale: sess.onStale, Blocked: sess.onBlocked})
	return nil
}

// onStale runs when the registry learns of a higher token. It must not
// block: endWhenStale ends the session.
func (sess *session) onStale(admitted int64) {
	sess.staleOnce.Do(func() {
		sess.admitted.Store(admitted)
		sess.stale.Store(true)
		close(sess.staleCh)
	})
}

// onBlocked runs when the resource is blocked or unblocked.
func (sess *session) onBlocked(err *fence.Error) {
	sess.blocked.Store(err)
	if err != nil {
		sess.log.Info("session blocked", zap.String("reason", err.Message))
	}
}

// refusal is the error a fenced session is ended with at its next message
// before the database ends it, or nil.
func (sess *session) refusal() *fence.Error {
	if sess.stale.Load() {
		return sess.endedError(false)
	}
	return sess.blocked.Load()
}

// endedError is the error of a session a raise ended; inFlight: a unit of its
// client's was unanswered then (fence.Ended).
func (sess *session) endedError(inFlight bool) *fence.Error {
	return fence.Ended(sess.cred.Resource, sess.cred.Token, sess.admitted.Load(), inFlight)
}

// shutdownWhenIdle closes the session now if it is idle between
// transactions, or at its next idle point.
func (sess *session) shutdownWhenIdle() {
	sess.shuttingDown.Store(true)
	sess.recall()
	if sess.ended.Load() {
		sess.client.Close() // lingering after a fencing error: no need to wait now
		return
	}
	sess.mu.Lock()
	idle := sess.outstanding == 0 && sess.status == 'I'
	sess.mu.Unlock()
	if idle {
		sess.end(sess.shutdownError())
	}
}

func (sess *session) shutdownError() *pgproto3.ErrorResponse {
	return &pgproto3.ErrorResponse{Severity: wire.SeverityFatal, Code: wire.CodeAdminShutdown,
		Message: "terminating connection because fenceproxy is shutting down"}
}

// storedOf reads the stored token from fence.bind's ZF001 message ("... lower than the highest
// admitted token N"); token+1 (some higher token) when it cannot.
func storedOf(message string, token int64) int64 {
	if i := strings.LastIndexByte(message, ' '); i >= 0 {
		if n, err := strconv.ParseInt(message[i+1:], 10, 64); err == nil && n > token {
			return n
		}
	}
	return token + 1
}
