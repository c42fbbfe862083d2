package proxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// The relay, after startup: every session, fenced or not, is a plain relay of
// framed messages in both directions.
//
// The guarantee does not rest on anything here. A fenced session's backend was
// bound to its token before the client saw ReadyForQuery (session.bind); from
// then on PostgreSQL itself ends the backend when a higher token is admitted
// (migrations/00004_bind_sessions.sql, obligations P1-P6), whatever the client
// sends. So the relay looks inside no message on the passthrough path. What it
// adds for fenced sessions is promptness and a clear error:
//
//   - a session this proxy knows to be stale (the registry: its own binds, the
//     control database's notifications, Consul) is ended with ZF001, and one
//     whose resource is blocked (lock free, LockIndex regression) at its next
//     message with the blocking error; in both cases only once the client has
//     every answer the server gave to what it sent before (endWhenAnswered):
//     an answer the server sent is the truth about that unit (a COMMIT that
//     committed says so), whatever the proxy has learned meanwhile;
//   - when PostgreSQL ends the backend (FATAL 57P01, or the connection closes),
//     the proxy asks the database whether a raise did it (explainServerEnd)
//     and if so tells the client ZF001 with the admitted token instead.
//
// Each direction is one goroutine with a method of its own, so that a stack
// trace says which one is stuck; both end the session through end, once.

// staleWait is how long (Config.StaleWait's default) a fenced session whose
// backend the server ended waits for the registry to learn of the raise, to
// say ZF001 instead of relaying the server's 57P01, when the proxy cannot ask
// the database (no --control-database, or the session is in another
// database). The raise commits about a millisecond after its last victim
// exits, and its notification or the proxy's own bind follows; 100 and 150 ms
// let a notification through another proxy arrive late under -race on a
// loaded machine. The price: a backend ended for another reason (an
// administrator's pg_terminate_backend) is reported this much later than
// without the proxy.
const staleWait = time.Second

// staleLinger is how long (Config.StaleLinger's default) the client connection
// of an idle session ended with a fencing error stays open after the server
// connection closed. A stale leader may be frozen, or idle in a transaction,
// when its session ends, and send its COMMIT much later. Were the socket closed
// by then, the kernel would answer that COMMIT with a reset, and libpq reports
// the FATAL it read earlier, while idle, as "server closed the connection
// unexpectedly" without its SQLSTATE; so the proxy keeps the connection and
// answers the client's next message itself with the error as a FATAL, then
// closes (answerEnded), as PostgreSQL ends a terminated session: drivers see
// the SQLSTATE and a connection that is gone. A client that closes, or a proxy
// that shuts down, ends it sooner.
const staleLinger = 5 * time.Minute

// errServerGone marks errors of the server connection (read or write), as
// opposed to the client's.
var errServerGone = errors.New("server connection ended")

// errEnded is returned by a direction that ended the session itself.
var errEnded = errors.New("session ended by fenceproxy")

// relay runs both directions until either side closes or fails.
func (sess *session) relay(ctx context.Context) error {
	// ctx ends when the shutdown grace period is over: tell the client why.
	stop := context.AfterFunc(ctx, func() {
		sess.recall()
		resp := sess.shutdownError()
		if sess.busy() && !sess.ended.Load() && sess.pid != 0 {
			// Closing the server connection does not stop a running statement: a
			// review's INSERT committed 6 s after its client was told the session
			// was terminated. It is cancelled; its answer (57014, or its outcome if it
			// completed first) reaches the client if it comes within cancelWait, and
			// the session ends as an idle one does; else the client is told that the
			// outcome is unknown.
			sess.cancelBackend()
			for wait := time.Now(); sess.busy() && time.Since(wait) < cancelWait; {
				time.Sleep(10 * time.Millisecond)
			}
			if sess.busy() {
				resp = &pgproto3.ErrorResponse{Severity: wire.SeverityFatal, Code: wire.CodeResolutionUnknown,
					Message: "terminating connection because fenceproxy is shutting down: the statement in flight was cancelled, but may have completed first",
					Hint:    "Check whether it committed before you retry it."}
			}
		}
		sess.end(resp)
		sess.client.Close() // also a client that lingers after a fencing error
	})
	defer stop()
	if sess.mode == modeFenced {
		go sess.endWhenStale()
	}
	// The hot path (loop_linux.go): the goroutines below take over when the loop lets go.
	sess.relayInLoop()
	errc := make(chan error, 2)
	go func() { errc <- sess.clientToServer() }()
	go func() { errc <- sess.serverToClient() }()
	err := <-errc
	both := false
	var done *clientDone
	if errors.As(err, &done) && !sess.ended.Load() && sess.lingerResp.Load() == nil {
		sess.finishServer(done, errc)
		both = true
	} else if sess.mode == modeFenced && errors.Is(err, errServerGone) && !sess.ended.Load() {
		// The server ended it, not the proxy (whose ends set ended first).
		sess.explainServerEnd()
	}
	if sess.lingerResp.Load() == nil {
		sess.end(nil)
	}
	close(sess.done)
	sess.mu.Lock()
	if sess.pendingTimer != nil {
		sess.pendingTimer.Stop()
	}
	sess.mu.Unlock()
	if !both {
		<-errc
	}
	if sess.draining.Load() {
		// clientToServer has read the client's message (or its end, or the
		// linger ran out); what it sent after that is read and dropped before
		// the close, which would otherwise reset the connection.
		sess.drainClient()
	}
	sess.client.Close()
	return err
}

// clientDone is clientToServer's end when the client sent its last message whole: a
// Terminate, a half-close (EOF at a message boundary), or a message the proxy refuses (too
// large, malformed: refused is the SQLSTATE of its FATAL), which is not forwarded.
type clientDone struct {
	terminated bool
	refused    string // the SQLSTATE of the proxy's FATAL for a refused message ("": none)
	why        error  // why it was refused
}

func (d *clientDone) Error() string {
	if d.why != nil {
		return d.why.Error()
	}
	return io.EOF.Error()
}

func (d *clientDone) Unwrap() error {
	if d.why != nil {
		return d.why
	}
	return io.EOF
}

// finishServer runs when the client has sent its last message (done): the server still
// answers everything forwarded before it, as PostgreSQL answers a direct client that sent a
// query and then Terminate, or shut down its side of the connection; and the proxy's error
// for a message it refuses comes after the answers to the units before it, as PostgreSQL's
// own would. A review saw a query followed by Terminate (or a half-close) commit with no
// answer, and a too-large message's FATAL arrive before the answer of a COMMIT in flight.
//
// Terminate or half-close: unless the client's Terminate was forwarded, the proxy shuts down
// its side of the server connection, as the client did: the server answers what it read,
// then ends the backend at the end of its input, rolling back an open transaction;
// serverToClient relays what it still sends until it closes.
//
// A refused message: the units sent before it get their answers if they come within
// refuseWait (the proxy waits for their ReadyForQuery); then the server connection closes
// (a transaction still open rolls back), nothing it sends after that is relayed, and the
// client gets the error last. A COPY waiting for its data ends that way too. The refused
// message's rest is read and dropped meanwhile, so that a client still writing it does not
// block. A backend the server ends meanwhile (a raise) is explained as in any other session.
func (sess *session) finishServer(done *clientDone, errc <-chan error) {
	var err error
	drained := make(chan struct{})
	switch {
	case done.refused != "":
		go func() { sess.drainClient(); close(drained) }()
		deadline := time.NewTimer(refuseWait)
		defer deadline.Stop()
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
	wait:
		for sess.busy() {
			select {
			case err = <-errc:
				break wait
			case <-deadline.C:
				break wait
			case <-tick.C:
			}
		}
		if err == nil {
			sess.server.Close() // serverToClient relays nothing more
			err = <-errc
		}
	case !done.terminated:
		// clientToServer has returned: the server connection's write side is free.
		if cw, ok := sess.server.(interface{ CloseWrite() error }); ok {
			cw.CloseWrite() //nolint:errcheck // the server may be gone already
		} else if err := wire.WriteMessage(sess.sw, 'X', nil); err == nil {
			sess.sw.Flush() //nolint:errcheck
		}
		err = <-errc
	default:
		err = <-errc
	}
	if sess.mode == modeFenced && errors.Is(err, errServerGone) && !sess.ended.Load() && sess.serverFatal.Load() != nil {
		sess.explainServerEnd()
	}
	if done.refused != "" {
		if !sess.ended.Load() {
			sess.fatalToClient(done.refused, done.why.Error())
		}
		// The connection closes once the rest of the refused message is read, not before:
		// a close with unread data resets it, and the client, still writing, would see
		// "connection reset" instead of the error.
		<-drained
	}
}

// cancelWait bounds how long a session still busy when the shutdown grace runs out waits
// for the answer to the cancel of its statement (relay).
const cancelWait = time.Second

// refuseWait bounds how long a session whose client sent a message the proxy refuses waits
// for the answers to the units sent before it (finishServer).
const refuseWait = 2 * time.Second

// end tells the client why the session ends (resp; nil: nothing to say),
// closes the server connection, which ends the backend and rolls back any open
// transaction, and then the client connection, once. Safe from any goroutine.
func (sess *session) end(resp *pgproto3.ErrorResponse) {
	sess.recall()
	sess.endOnce.Do(func() {
		sess.ended.Store(true)
		close(sess.endedCh)
		if resp != nil && !sess.cut.Load() {
			sess.client.SetWriteDeadline(time.Now().Add(time.Second)) //nolint:errcheck
			sess.writeClientError(resp)                               //nolint:errcheck // the connection closes anyway
			sess.flushClient()                                        //nolint:errcheck
		}
		sess.server.Close()
		sess.halfClose()
		sess.client.Close()
	})
}

// endFencing ends a session with a fencing error. Each unit the client waits
// for (units in flight) gets the error as an ERROR and a ReadyForQuery, as a
// server that refused it would: the driver's own call fails with the SQLSTATE
// (libpq's PQexec keeps the last result of a unit, and a FATAL followed by the
// end of the connection would leave it "server closed the connection
// unexpectedly" without one). Then the end follows as PostgreSQL ends a
// terminated backend's session: the error as a FATAL, then the end of the
// connection, which drivers read at their next call. An idle client is told
// at once with the FATAL, which drivers that read while idle (LISTEN) see,
// and the connection waits (StaleLinger) for its next unit, which answerEnded
// answers with the error: a frozen leader that wakes reads the SQLSTATE. A
// unit the client is sending (answering: a refused message) is answered by
// answerEnded too, followed by the FATAL and the end.
func (sess *session) endFencing(fe *fence.Error, answering bool) {
	sess.recall()
	sess.endOnce.Do(func() {
		sess.ended.Store(true)
		close(sess.endedCh)
		// The server first: nothing it still sends may follow the error.
		sess.server.Close()
		// Its backend is gone: what lingers to answer the client takes no --max-clients
		// slot (a review's new leader was refused 53300 while its predecessor's ended
		// sessions lingered).
		sess.freeSlot()
		// Before cwMu: a relayed write blocked on a client that does not
		// read, holding it, fails by then.
		sess.client.SetWriteDeadline(time.Now().Add(time.Second)) //nolint:errcheck
		// Under cwMu, which relayReady holds while it relays a ReadyForQuery
		// and counts it: the units counted here are exactly those whose
		// ReadyForQuery did not reach the client, and nothing relayed follows.
		sess.cwMu.Lock()
		if sess.cut.Load() {
			// The server's stream ended inside a message the client has
			// part of: nothing can follow it but the end.
			sess.cwMu.Unlock()
			sess.client.Close()
			return
		}
		sess.mu.Lock()
		waiting := sess.outstanding
		sess.outstanding = 0
		sess.mu.Unlock()
		if waiting > 0 && fe.Code == fence.CodeStale && sess.stale.Load() {
			// A unit was unanswered when the backend ended: its COMMIT may have
			// committed, and the detail says so.
			fe = sess.endedError(true)
		}
		sess.srv.metrics.rejection(fe.Code)
		sess.srv.lead.endedSession(sess.cred.Resource, sess.cred.Token, fe)
		sess.log.Info("session ended with a fencing error", zap.String("sqlstate", fe.Code), zap.String("reason", fe.Message),
			zap.Int("in_flight", waiting), zap.Bool("answering", answering))
		resp := fe.Response(wire.SeverityError)
		fatal := wire.AppendError(nil, fe.Response(wire.SeverityFatal))[5:]
		var err error
		switch {
		case waiting > 0:
			body := wire.AppendError(nil, resp)[5:]
			for range waiting {
				err = errors.Join(err, wire.WriteMessage(sess.cw, 'E', body), wire.WriteMessage(sess.cw, 'Z', []byte{'I'}))
			}
			err = errors.Join(err, wire.WriteMessage(sess.cw, 'E', fatal))
		case !answering:
			err = wire.WriteMessage(sess.cw, 'E', fatal)
			sess.told.Store(true)
		}
		err = errors.Join(err, sess.cw.Flush())
		sess.cwMu.Unlock()
		if err != nil {
			// The client does not read (frozen with a result half sent, whose
			// write just failed at the deadline): no answer can reach it
			// whole, and lingering would leave it waiting for the rest.
			sess.client.Close()
			return
		}
		sess.lingerResp.Store(resp)
		if waiting > 0 {
			// The client has its answers and the FATAL: the end follows now;
			// what it still sends is read and dropped (answerEnded) until it
			// closes, so that the close resets nothing.
			sess.halfClose()
			sess.finSent.Store(true)
		}
		sess.client.SetReadDeadline(time.Now().Add(sess.srv.cfg.StaleLinger)) //nolint:errcheck
	})
}

// answerEnded answers, as a server that refuses it would, the unit the client
// sends after its session ended with a fencing error, from its message typ on:
// the error as an ERROR at its first message, then its ReadyForQuery at its
// end (Query, Sync, FunctionCall; each answer gets its own second, as a
// client may send its Sync long after the message that got the error); then,
// unless the client was told so while idle, the FATAL; then the end of the
// connection (relay drains what follows, so that the close resets nothing).
// A client that was sent the end already (finSent) gets nothing more.
func (sess *session) answerEnded(typ byte) error {
	if sess.finSent.Load() {
		sess.draining.Store(true)
		return errEnded
	}
	resp := sess.lingerResp.Load()
	errSent := false
	for {
		sess.client.SetWriteDeadline(time.Now().Add(time.Second)) //nolint:errcheck
		switch typ {
		case 'X':
			return io.EOF
		case 'Q', 'F', 'S':
			if !errSent {
				sess.writeClientError(resp) //nolint:errcheck // the connection closes anyway
			}
			sess.writeClient('Z', []byte{'I'}) //nolint:errcheck
			if !sess.told.Load() {
				fatal := *resp
				fatal.Severity, fatal.SeverityUnlocalized = wire.SeverityFatal, wire.SeverityFatal
				sess.writeClientError(&fatal) //nolint:errcheck
			}
			sess.flushClient() //nolint:errcheck
			sess.halfClose()
			sess.draining.Store(true)
			return errEnded
		case 'd', 'c', 'f':
			// COPY data of a copy that ended with the session: its end is
			// answered with the unit's ReadyForQuery.
		default: // Parse, Bind, Describe, Execute, Close, Flush: the unit fails at its first
			if !errSent {
				sess.writeClientError(resp) //nolint:errcheck
				sess.flushClient()          //nolint:errcheck
				errSent = true
			}
		}
		var err error
		if typ, _, err = sess.cr.Next(); err != nil {
			return err
		}
	}
}

// halfClose ends the proxy's side of the client connection, so that the
// client reads what was sent, then the end, and no reset.
func (sess *session) halfClose() {
	if cw, ok := sess.client.(interface{ CloseWrite() error }); ok {
		cw.CloseWrite() //nolint:errcheck
	}
}

// busy reports whether the client waits for an answer.
func (sess *session) busy() bool {
	sess.mu.Lock()
	defer sess.mu.Unlock()
	return sess.outstanding > 0
}

// endWhenStale ends a fenced session once the registry says a higher token
// was admitted for its resource, and the client has the answers in flight
// (endWhenAnswered). A running statement is left to the server: when the
// database admitted the token, its raise ended the backend already (the relay
// hears of it as the server's end); when only Consul said so, the statement
// may still commit, as it may until the raise commits, and the new leader's
// raise ends the backend.
func (sess *session) endWhenStale() {
	select {
	case <-sess.staleCh:
		sess.recall()
		sess.log.Info("ending stale session", zap.Int64("admitted", sess.admitted.Load()), zap.Bool("in_flight", sess.busy()))
		sess.endWhenAnswered(sess.endedError(false), false)
	case <-sess.done:
	}
}

// endWhenAnswered ends the session with fe (endFencing) as soon as no unit the
// client sent waits for the server's answer: now if none does, else when the
// relay has delivered the last ReadyForQuery (relayReady), or when the server
// ends (explainServerEnd), which answers the units left with fe. The first fe
// is the one used. A client that does not read its answers is given
// staleLinger; then the session ends anyway.
func (sess *session) endWhenAnswered(fe *fence.Error, answering bool) {
	sess.mu.Lock()
	if sess.pending == nil {
		sess.pending = &pendingEnd{fe: fe, answering: answering}
		sess.pendingTimer = time.AfterFunc(staleLinger, func() { sess.endFencing(fe, answering) })
	}
	p := sess.pending
	idle := sess.outstanding == 0
	sess.mu.Unlock()
	if idle {
		sess.endFencing(p.fe, p.answering)
	}
}

// pendingEnd is an end that waits for the answers in flight.
type pendingEnd struct {
	fe        *fence.Error
	answering bool // a unit of the client's waits for the error (no FATAL)
}

// explainServerEnd runs when the server ended a fenced session (FATAL 57P01
// held back by serverToClient, or a closed connection). If a higher token was
// admitted (the registry knows, or learns it by asking the database, or
// within staleWait when it cannot ask), the raise ended the backend and the
// client is told ZF001; otherwise it gets the server's own error, or one that
// says the server went away (a crash, a shutdown, a failover: serverGone), with a hint
// that says whether a raise may have done it.
func (sess *session) explainServerEnd() {
	sess.mu.Lock()
	p := sess.pending
	sess.mu.Unlock()
	if p != nil && p.fe.Code == fence.CodeStale {
		// The proxy was ending it as stale already: the units left get the
		// error (whose detail says a COMMIT among them may have committed).
		sess.endFencing(p.fe, false)
		return
	}
	// A server FATAL other than 57P01 was relayed already (08P01, 25P03...):
	// the end was the server's own, not a raise's, and said so.
	said := sess.serverFatal.Load() == nil && sess.serverSaid.Load()
	settled, gone := false, false
	if !sess.stale.Load() && !said {
		if settled, gone = sess.askSettled(); !settled {
			t := time.NewTimer(sess.srv.cfg.StaleWait)
			select {
			case <-sess.staleCh:
			case <-t.C:
			}
			t.Stop()
		}
	}
	if sess.stale.Load() {
		sess.endFencing(sess.endedError(false), false)
		return
	}
	// Not known to be stale: the server's own error (or one saying it closed
	// the connection), relayed as a server's FATAL is; nothing to add when it
	// was relayed already, as a direct connection would show.
	if said {
		sess.end(nil)
		return
	}
	resp := sess.serverFatal.Load()
	host := sess.srv.cfg.upstream.hosts[max(sess.host, 0)]
	// A raise ends a backend with pg_terminate_backend, whose FATAL 57P01 the backend sends
	// before it exits: a connection that ended without a word was lost (a crash: an
	// immediate shutdown sends a WARNING only; a cut network; a failover behind a virtual
	// IP), not ended by a raise.
	if gone || resp == nil || sess.serverGone() {
		// A crash, a shutdown or a failover: no raise, and the client is told so.
		if resp == nil {
			resp = &pgproto3.ErrorResponse{Severity: wire.SeverityFatal, Code: wire.CodeConnectionFailure,
				Message: fmt.Sprintf("fenceproxy: the server at %s went away: the connection to it was lost (a crash, a shutdown or a failover)", host)}
		}
		resp.Hint = fmt.Sprintf("fenceproxy: the server went away; this was not a raise of resource %q (no higher token was admitted as far as the proxy knows). Reconnect: new sessions go to the writable primary. A transaction in flight may or may not have committed.", sess.cred.Resource)
		sess.end(resp)
		return
	}
	if settled {
		resp.Hint = fmt.Sprintf("fenceproxy: not a raise of resource %q: the database stores no higher token than this session's; the server or an administrator ended the backend.", sess.cred.Resource)
	} else {
		resp.Hint = fmt.Sprintf("fenceproxy: a raise of resource %q ends the sessions of lower tokens this way; if this process may have lost its lock, stop writing and acquire it again.", sess.cred.Resource)
	}
	sess.end(resp)
}

// serverGone reports whether the session's server is gone: the host's role as last learned
// (the monitor's reading, or a failed dial) says it is unreachable or no primary now, or it
// does not accept a connection now.
func (sess *session) serverGone() bool {
	s := sess.srv
	if sess.host < 0 {
		return false
	}
	r := &s.roles[sess.host]
	if role := r.role.Load(); role == roleDown || role == roleStandby && sess.mode == modeFenced {
		return true
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	c, err := s.dialHost(ctx, s.cfg.upstream.hosts[sess.host])
	if err != nil {
		return true
	}
	c.Close()
	return false
}

// askSettled asks the database, on the control connection, for the session's
// resource's token once no raise of it is in flight (fence.settled: a raise
// that ended this backend holds the token row until it commits), and tells
// the registry, which marks the session stale if the token is higher. It
// reports whether that settles the question: also when the server cannot be
// asked because it is shutting down or refuses connections (no raise can
// commit then either); not when the proxy cannot ask (no control database for
// the session's database, or another failure, such as a database without
// fence.settled), and explainServerEnd waits for the registry instead. gone says that the
// server is going away (a shutdown or a crash, not a raise).
func (sess *session) askSettled() (settled, gone bool) {
	srv := sess.srv
	if srv.control == nil || sess.database != srv.controlDB {
		return false, false
	}
	// The raise's own wait is bounded by 5 s (fence.end_stale); a slower
	// answer means the control database is in trouble too.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// On a new connection if the pooled one was ended (CI saw two idle connections
	// ended, and both asked): fence.OnControl. Only the answer of a new connection can say
	// that the server itself is going away.
	var stored int64
	err := fence.OnControl(ctx, srv.control, func(conn *pgx.Conn) error {
		var err error
		stored, err = srv.cfg.Key.Settled(ctx, conn, sess.cred.Resource, sess.cred.Token)
		return err
	})
	if err == nil {
		sess.log.Debug("asked whether a raise ended the session", zap.Int64("stored", stored))
		srv.reg.Observe(sess.database, sess.cred.Resource, stored)
		return true, false
	}
	if fence.GoingAway(err) {
		sess.log.Warn("the server is going away: the session's end was not a raise's", zap.Error(err))
		return true, true
	}
	sess.log.Warn("could not ask the control database whether a raise ended the session", zap.Error(err))
	return false, false
}

// ---------------------------------------------------------------------
// server -> client

func (sess *session) serverToClient() error {
	if sess.resume {
		// The rest of a message the event loop relayed in part; rebuild took cwMu.
		sess.resume = false
		err := sess.sr.CopyRest(sess.cw)
		if errors.Is(err, wire.ErrCut) {
			sess.cut.Store(true)
		}
		sess.cwMu.Unlock()
		if errors.Is(err, wire.ErrRead) {
			return fmt.Errorf("%w: %w", errServerGone, err)
		}
		if err != nil {
			return err
		}
	}
	for {
		if err := sess.flushClientIfIdle(); err != nil {
			return err
		}
		typ, _, err := sess.sr.Next()
		if err != nil {
			return sess.serverReadError(err)
		}
		switch typ {
		case 'Z':
			body, err := sess.sr.Body()
			if err != nil {
				return fmt.Errorf("%w: %w", errServerGone, err)
			}
			if len(body) != 1 {
				return fmt.Errorf("malformed ReadyForQuery")
			}
			if err := sess.relayReady(body); err != nil {
				return err
			}
		case 'E':
			if sess.mode != modeFenced {
				if err := sess.copyClient(); err != nil {
					return err
				}
				continue
			}
			body, err := sess.sr.Body()
			if err != nil {
				return fmt.Errorf("%w: %w", errServerGone, err)
			}
			e, derr := wire.DecodeError(body)
			if derr == nil && e.Code == wire.CodeAdminShutdown && e.Severity == wire.SeverityFatal {
				// Maybe a raise ending this stale backend: relay's
				// explainServerEnd decides what the client is told.
				sess.serverFatal.Store(e)
				return fmt.Errorf("%w: terminated by the server", errServerGone)
			}
			if derr == nil && e.Severity == wire.SeverityFatal {
				sess.serverSaid.Store(true) // the end is not silent: explainServerEnd adds nothing
			}
			if err := sess.relayClient(typ, body); err != nil {
				return err
			}
		default:
			if err := sess.copyClient(); err != nil {
				return err
			}
		}
	}
}

func (sess *session) flushClientIfIdle() error {
	if !sess.sr.NextWhole() {
		sess.cwMu.Lock()
		err := sess.cw.Flush()
		sess.cwMu.Unlock()
		return err
	}
	return nil
}

func (sess *session) writeClientError(resp *pgproto3.ErrorResponse) error {
	return sess.writeClient('E', wire.AppendError(nil, resp)[5:])
}

func (sess *session) flushClient() error {
	sess.cwMu.Lock()
	defer sess.cwMu.Unlock()
	return sess.cw.Flush()
}

func (sess *session) writeClient(typ byte, body []byte) error {
	sess.cwMu.Lock()
	defer sess.cwMu.Unlock()
	return wire.WriteMessage(sess.cw, typ, body)
}

// copyClient streams the current server message to the client. Its errors
// are the client's, but for a read error of the server's body.
//
// It and relayClient write nothing once the proxy ended the session: the
// server connection is closed then, but messages read before the close may
// still be buffered, and nothing the server sent may follow the proxy's
// error. endFencing and end set ended before they take cwMu to write it, so a
// message whose write holds cwMu first goes before the error, whole, and one
// that takes it after sees ended.
func (sess *session) copyClient() error {
	sess.cwMu.Lock()
	if sess.ended.Load() {
		sess.cwMu.Unlock()
		return errEnded
	}
	err := sess.sr.CopyBody(sess.cw)
	if errors.Is(err, wire.ErrCut) {
		sess.cut.Store(true) // under cwMu: before any end writes after it
	}
	sess.cwMu.Unlock()
	if errors.Is(err, wire.ErrRead) {
		return fmt.Errorf("%w: %w", errServerGone, err)
	}
	return err
}

// relayClient writes a server message read whole (see copyClient).
func (sess *session) relayClient(typ byte, body []byte) error {
	sess.cwMu.Lock()
	defer sess.cwMu.Unlock()
	if sess.ended.Load() {
		return errEnded
	}
	return wire.WriteMessage(sess.cw, typ, body)
}

// relayReady relays a ReadyForQuery and counts it, both under cwMu (see
// endFencing), and ends the session if it is shutting down and now idle.
func (sess *session) relayReady(body []byte) error {
	status := body[0]
	sess.cwMu.Lock()
	if sess.ended.Load() {
		sess.cwMu.Unlock()
		return errEnded
	}
	err := wire.WriteMessage(sess.cw, 'Z', body)
	sess.mu.Lock()
	sess.status = status
	if sess.outstanding > 0 {
		sess.outstanding--
	}
	idle := sess.outstanding == 0 && status == 'I'
	p := sess.pending
	answered := p != nil && sess.outstanding == 0
	sess.mu.Unlock()
	sess.cwMu.Unlock()
	if err != nil {
		return err
	}
	if answered {
		sess.endFencing(p.fe, p.answering)
		return errEnded
	}
	if idle && sess.shuttingDown.Load() {
		sess.flushClientIfIdle() //nolint:errcheck
		sess.end(sess.shutdownError())
	}
	return nil
}

// serverReadError tells the client why its connection is being closed when
// the server sent a message the proxy will not relay (above the limit).
func (sess *session) serverReadError(err error) error {
	if errors.Is(err, wire.ErrMessageTooLarge) {
		sess.fatalToClient(wire.CodeProgramLimitExceeded, "cannot relay the server's message: "+err.Error())
		return err
	}
	return fmt.Errorf("%w: %w", errServerGone, err)
}

// ---------------------------------------------------------------------
// client -> server

func (sess *session) clientToServer() error {
	fenced := sess.mode == modeFenced
	if sess.cr.Pending() > 0 {
		// The rest of a message the event loop relayed in part.
		if err := sess.cr.CopyRest(sess.sw); errors.Is(err, wire.ErrRead) {
			return err // the client's
		} else if err != nil {
			return fmt.Errorf("%w: %w", errServerGone, err)
		}
	}
	for {
		if err := sess.flushServerIfIdle(); err != nil {
			return fmt.Errorf("%w: %w", errServerGone, err)
		}
		typ, _, err := sess.cr.Next()
		if err == io.EOF { // exactly: at a message boundary, a half-close or a close
			return &clientDone{}
		}
		if err != nil {
			return sess.clientReadError(err)
		}
		if fenced && typ != 'X' {
			if sess.lingerResp.Load() != nil {
				return sess.answerEnded(typ)
			}
			// Two atomic loads: the refusal known before the database's.
			// The unit is not forwarded; the answers to those before it
			// reach the client first, then the session ends and this
			// one gets the error.
			if fe := sess.refusal(); fe != nil {
				sess.log.Info("message of a fenced session refused", zap.String("sqlstate", fe.Code), zap.String("reason", fe.Message), zap.String("message_type", string(typ)))
				sess.endWhenAnswered(fe, true)
				<-sess.endedCh
				if sess.lingerResp.Load() == nil {
					return errEnded // ended otherwise (shutdown, the server's own end)
				}
				return sess.answerEnded(typ)
			}
		}
		switch typ {
		case 'Q', 'S', 'F':
			// Each ends with one ReadyForQuery: count it, so that a shutdown
			// waits for the answer instead of closing a busy session.
			sess.mu.Lock()
			sess.outstanding++
			sess.mu.Unlock()
		}
		err = sess.cr.CopyBody(sess.sw)
		if errors.Is(err, wire.ErrRead) {
			return err // the client's
		}
		if err != nil {
			return fmt.Errorf("%w: %w", errServerGone, err)
		}
		if typ == 'X' {
			sess.sw.Flush() //nolint:errcheck
			return &clientDone{terminated: true}
		}
	}
}

// flushBoth writes what the writers hold.
func (sess *session) flushBoth() error {
	sess.cwMu.Lock()
	err := sess.cw.Flush()
	sess.cwMu.Unlock()
	return errors.Join(err, sess.sw.Flush())
}

func (sess *session) flushServerIfIdle() error {
	if !sess.cr.NextWhole() {
		return sess.sw.Flush()
	}
	return nil
}

// clientReadError is the end of the client's stream when reading its next message failed:
// for a message of its own that the proxy refuses (too large, malformed), a clientDone
// whose error finishServer sends after the answers to what came before; else err.
func (sess *session) clientReadError(err error) error {
	code := ""
	switch {
	case errors.Is(err, wire.ErrMessageTooLarge):
		code = wire.CodeProgramLimitExceeded
	case errors.Is(err, wire.ErrMalformed):
		code = wire.CodeProtocolViolation
	default:
		return err
	}
	return &clientDone{refused: code, why: err}
}

// drainClient drops what the client is still sending, for a moment, before
// its connection is closed. Closing a socket with unread data resets it,
// and the client, still writing its oversized message, would see
// "connection reset" instead of the error that says why.
func (sess *session) drainClient() {
	sess.client.SetReadDeadline(time.Now().Add(time.Second)) //nolint:errcheck // best effort
	io.Copy(io.Discard, io.LimitReader(sess.client, 64<<20)) //nolint:errcheck
}

func (sess *session) fatalToClient(code, msg string) {
	sess.log.Info("closing session", zap.String("sqlstate", code), zap.String("reason", msg))
	sess.cwMu.Lock()
	defer sess.cwMu.Unlock()
	resp := &pgproto3.ErrorResponse{Severity: wire.SeverityFatal, Code: code, Message: "fenceproxy: " + msg}
	wire.WriteMessage(sess.cw, 'E', wire.AppendError(nil, resp)[5:]) //nolint:errcheck
	sess.cw.Flush()                                                  //nolint:errcheck
}
