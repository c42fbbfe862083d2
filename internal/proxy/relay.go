package proxy

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/sqltx"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// How a fenced session keeps the guarantee (the proof obligations):
//
//  1. Every transaction that can commit passes through a check first. A
//     transaction commits (a) at an explicit COMMIT/END/COMMIT AND
//     CHAIN/PREPARE TRANSACTION, wherever it appears (simple Query string or
//     extended-protocol Execute), (b) at the end of a simple Query message
//     that leaves no explicit block open, (c) at a Sync that leaves no
//     explicit block open, (d) inside CALL/DO/fast-path function calls run
//     outside a block, and (e) in statements that run in their own
//     transaction (CREATE DATABASE ...). (a)-(c) get an injected check
//     immediately before; (d) runs inside the implicit block of a
//     multi-statement Query (simple protocol), where procedures cannot
//     commit, or is refused (extended protocol, function calls); (e) is refused.
//  2. A check is omitted only where the proxy knows exactly that the session
//     is inside an explicit block (then the commit comes later, at a commit
//     point that gets its own check), or that the transaction a Sync would
//     commit holds no statement (the unit's last statements ended their
//     block: a COMMIT, which had its check, or a ROLLBACK). "Exactly" means
//     from the server's last ReadyForQuery with nothing outstanding, plus
//     the statements of the current unit, whose failure skips everything up
//     to the unit's end.
//     When a prediction would omit a check and earlier units are still
//     outstanding, the proxy waits for them instead of guessing.
//  3. Refusals are made by the server, in order: the proxy replaces the
//     refused message with a statement that raises the fencing error, so
//     the client sees the error exactly where its message's result would be,
//     and the server's own error handling skips the rest of the unit.
//  4. A check that fails before an explicit COMMIT leaves the block failed;
//     the proxy then sends ROLLBACK itself before it forwards anything else
//     from the client, so the client sees its COMMIT fail and the session idle.
//
// Statement splitting and classification are PostgreSQL's own grammar (via
// internal/sqltx). SQL text the proxy sends is built from validated resource
// names and integer tokens only.

// Names of the proxy's own prepared statement and portal. They are closed
// before every use, so a leftover from a failed unit never collides.
const (
	ownStmt     = "__fenceproxy_s"
	ownPortal   = "__fenceproxy_p"
	ownPrepared = "__fenceproxy_check" // the check, prepared at session start
)

type entryKind uint8

const (
	eParse    entryKind = iota + 1 // ParseComplete
	eBind                          // BindComplete
	eDescribe                      // [ParameterDescription] RowDescription|NoData
	eExecute                       // DataRow*... CommandComplete|EmptyQueryResponse|PortalSuspended
	eClose                         // CloseComplete
	eFunc                          // FunctionCallResponse
	eStmt                          // one statement of a simple Query
	eSync                          // ReadyForQuery ending a Sync unit
	eQueryEnd                      // ReadyForQuery ending a Query or FunctionCall
)

// entry is one expected response (or group of responses), in the order the
// server will send them.
type entry struct {
	kind    entryKind
	ours    bool         // swallow the responses
	check   bool         // our fence check: its error is a fencing rejection
	refusal *fence.Error // our refusal: its error is replaced by this one
	unit    *unit        // on end entries
	copyRes chan bool    // COPY FROM STDIN (extended): true once copy-in started, false if refused
	// syncOnError: our check sent ahead of a simple Query. After an error in
	// an extended-protocol message the server skips everything up to a
	// Sync, the client's Query included: the proxy then sends the Sync.
	syncOnError bool
}

// unit is what ends with one ReadyForQuery.
type unit struct {
	rollbackOnFail bool // a check before an explicit COMMIT: ROLLBACK if it fails
	checkFailed    bool
	end            entry // the entry of its end (Sync, Query end), allocated with it
}

// entryQueue holds the expected responses, oldest first. Popping moves head
// instead of reslicing, so that the array is reused from its start whenever
// the queue empties: a session's usual back and forth allocates nothing here.
type entryQueue struct {
	buf  []*entry
	head int
}

func (q *entryQueue) len() int      { return len(q.buf) - q.head }
func (q *entryQueue) front() *entry { return q.buf[q.head] }

func (q *entryQueue) push(es ...*entry) {
	if q.head > 0 && len(q.buf)+len(es) > cap(q.buf) {
		// Full, with popped slots at the start (a pipeline that never
		// drains): move the live entries down instead of growing.
		n := copy(q.buf, q.buf[q.head:])
		clear(q.buf[n:])
		q.buf, q.head = q.buf[:n], 0
	}
	q.buf = append(q.buf, es...)
}

func (q *entryQueue) pop() *entry {
	e := q.buf[q.head]
	q.buf[q.head] = nil
	q.head++
	if q.head == len(q.buf) {
		q.buf, q.head = q.buf[:0], 0
		if cap(q.buf) > 1024 { // do not pin a long pipeline's array
			q.buf = nil
		}
	}
	return e
}

// relay runs both directions until either side closes or fails.
func (sess *session) relay(ctx context.Context) error {
	// ctx ends when the shutdown grace period is over: tell the client why.
	stop := context.AfterFunc(ctx, func() {
		sess.closeReason.Store(nil)
		sess.closeForShutdown()
	})
	defer stop()
	errc := make(chan error, 2)
	go func() { errc <- sess.clientToServer() }()
	go func() { errc <- sess.serverToClient() }()
	err := <-errc
	close(sess.done)
	sess.mu.Lock()
	sess.closed = true
	sess.cond.Broadcast()
	sess.mu.Unlock()
	// Closing both ends unblocks the other direction. Closing the server
	// connection ends the backend, which rolls back any open transaction.
	sess.client.Close()
	sess.server.Close()
	<-errc
	return err
}

// ---------------------------------------------------------------------
// server -> client

func (sess *session) serverToClient() error {
	if sess.mode == modePassthrough {
		return sess.serverToClientPlain()
	}
	return sess.serverToClientFenced()
}

func (sess *session) flushClientIfIdle() error {
	if sess.sr.Buffered() == 0 {
		sess.cwMu.Lock()
		err := sess.cw.Flush()
		sess.cwMu.Unlock()
		return err
	}
	return nil
}

// serverToClientPlain relays everything, tracking ReadyForQuery.
func (sess *session) serverToClientPlain() error {
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
				return err
			}
			if len(body) != 1 {
				return fmt.Errorf("malformed ReadyForQuery")
			}
			if err := sess.writeClient(typ, body); err != nil {
				return err
			}
			sess.readyForQuery(body[0])
		case 'S':
			body, err := sess.sr.Body()
			if err != nil {
				return err
			}
			sess.noteParameter(body)
			if err := sess.writeClient(typ, body); err != nil {
				return err
			}
		default:
			if err := sess.copyClient(); err != nil {
				return err
			}
		}
	}
}

func (sess *session) writeClient(typ byte, body []byte) error {
	sess.cwMu.Lock()
	defer sess.cwMu.Unlock()
	return wire.WriteMessage(sess.cw, typ, body)
}

func (sess *session) copyClient() error {
	sess.cwMu.Lock()
	defer sess.cwMu.Unlock()
	return sess.sr.CopyBody(sess.cw)
}

func (sess *session) writeClientError(resp *pgproto3.ErrorResponse) error {
	return sess.writeClient('E', wire.AppendError(nil, resp)[5:])
}

// readyForQuery records a ReadyForQuery relayed to the client.
func (sess *session) readyForQuery(status byte) {
	sess.mu.Lock()
	sess.status = status
	if sess.outstanding > 0 {
		sess.outstanding--
	}
	idle := sess.outstanding == 0 && status == 'I'
	sess.cond.Broadcast()
	sess.mu.Unlock()
	if idle && sess.shuttingDown.Load() {
		sess.flushClientIfIdle() //nolint:errcheck
		sess.closeForShutdown()
	}
}

// popThroughEnd removes entries up to and including the first end entry
// (Sync/Query end) and returns it.
func (sess *session) popThroughEnd() *entry {
	sess.mu.Lock()
	defer sess.mu.Unlock()
	for sess.queue.len() > 0 {
		e := sess.queue.pop()
		if e.kind == eSync || e.kind == eQueryEnd {
			return e
		}
	}
	return nil
}

func (sess *session) push(es ...*entry) {
	sess.mu.Lock()
	sess.queue.push(es...)
	sess.mu.Unlock()
}

// push queues entries of the current unit.
func (c *cstate) push(sess *session, es ...*entry) {
	for _, e := range es {
		e.unit = c.unit
	}
	sess.push(es...)
}

func (sess *session) serverToClientFenced() error {
	for {
		if err := sess.flushClientIfIdle(); err != nil {
			return err
		}
		typ, _, err := sess.sr.Next()
		if err != nil {
			return sess.serverReadError(err)
		}
		switch typ {
		case 'N', 'A': // asynchronous: relay whatever is expected
			if err := sess.copyClient(); err != nil {
				return err
			}
			continue
		case 'S':
			body, err := sess.sr.Body()
			if err != nil {
				return err
			}
			sess.noteParameter(body)
			if err := sess.writeClient(typ, body); err != nil {
				return err
			}
			continue
		case 'E':
			body, err := sess.sr.Body()
			if err != nil {
				return err
			}
			if err := sess.serverError(body); err != nil {
				return err
			}
			continue
		case 'Z':
			body, err := sess.sr.Body()
			if err != nil {
				return err
			}
			if len(body) != 1 {
				return fmt.Errorf("malformed ReadyForQuery")
			}
			if err := sess.serverReady(body); err != nil {
				return err
			}
			continue
		}
		e := sess.answer(typ)
		if e == nil || !e.ours {
			if err := sess.copyClient(); err != nil {
				return err
			}
		} else if err := sess.sr.Discard(); err != nil {
			return err
		}
		if typ == 'G' && e != nil && e.copyRes != nil {
			e.copyRes <- true
			e.copyRes = nil
		}
	}
}

// answer returns the entry a server message of type typ answers (nil: none
// expected) and removes it from the queue when typ completes it, under one
// lock: this runs for every message the server sends.
func (sess *session) answer(typ byte) *entry {
	sess.mu.Lock()
	defer sess.mu.Unlock()
	if sess.queue.len() == 0 {
		return nil
	}
	e := sess.queue.front()
	var done bool
	switch typ {
	case '1', '2', '3', 'V': // ParseComplete, BindComplete, CloseComplete, FunctionCallResponse
		done = true
	case 'n', 'T': // NoData, RowDescription: the end of a Describe (a Query's rows go on)
		done = e.kind == eDescribe
	case 'C', 'I', 's': // CommandComplete, EmptyQueryResponse, PortalSuspended
		done = e.kind == eExecute || e.kind == eStmt
	case 'E': // ErrorResponse: the rest of the unit is skipped, up to its end entry
		done = e.kind != eSync && e.kind != eQueryEnd
	}
	if done {
		sess.queue.pop()
	}
	return e
}

// serverError relays (or translates) an ErrorResponse and completes the
// entry it answers; the server skips the rest of the unit, whose entries are
// dropped at its ReadyForQuery.
func (sess *session) serverError(body []byte) error {
	e := sess.answer('E')
	if e == nil || e.kind == eSync || e.kind == eQueryEnd {
		return sess.writeClient('E', body)
	}
	if e.copyRes != nil {
		e.copyRes <- false // the COPY failed before copy-in mode
		e.copyRes = nil
	}
	if e.syncOnError {
		// The server now skips the client's Query; this Sync's
		// ReadyForQuery ends the unit instead (the block is failed, and
		// serverReady rolls it back).
		if err := sess.sendServer('S', nil); err != nil {
			return err
		}
	}
	resp, derr := wire.DecodeError(body)
	switch {
	case e.refusal != nil:
		sess.srv.metrics.rejection(e.refusal.Code)
		return sess.writeClientError(e.refusal.Response(wire.SeverityError))
	case e.check && derr == nil:
		if resp.Code == "26000" { // our prepared check is gone: send its text from now on
			sess.ownPrepared.Store(false)
		}
		e.unit.checkFailed = true
		sess.srv.metrics.checkFailure()
		return sess.writeClientError(sess.translateCheckError(resp))
	case derr == nil && resp.Code == wire.CodeQueryCanceled && sess.stale.Load() && sess.cancelSent.Load():
		return sess.writeClientError(sess.staleCancel())
	}
	return sess.writeClient('E', body)
}

// staleCancel is the fencing error that replaces the query_canceled error
// of a query the proxy cancelled because its session went stale.
func (sess *session) staleCancel() *pgproto3.ErrorResponse {
	fe := fence.Stale(sess.cred.Resource, sess.cred.Token, sess.admitted.Load())
	fe.Detail = "The query was cancelled because another holder of the lock was admitted with a higher token."
	sess.srv.metrics.rejection(fe.Code)
	return fe.Response(wire.SeverityError)
}

// translateCheckError turns what the check raised into the fencing error.
// fence.check reports staleness itself (ZF001) at every isolation level.
// The check of schema version 2, which a database not yet migrated still
// runs, read the token with FOR SHARE under REPEATABLE READ and
// SERIALIZABLE, where a concurrent raise surfaces as 40001: that is
// translated here, as are the proxy's own cancellations.
func (sess *session) translateCheckError(resp *pgproto3.ErrorResponse) *pgproto3.ErrorResponse {
	if sess.mode != modeFenced {
		return resp
	}
	switch resp.Code {
	case wire.CodeSerializationFailure:
		fe := fence.Stale(sess.cred.Resource, sess.cred.Token, sess.srv.reg.Highest(sess.cred.Resource))
		fe.Message = fmt.Sprintf("stale fencing token: resource %q token %d was superseded by a token admitted while this transaction ran", sess.cred.Resource, sess.cred.Token)
		sess.srv.metrics.rejection(fe.Code)
		return fe.Response(wire.SeverityError)
	case wire.CodeQueryCanceled:
		if sess.stale.Load() {
			return sess.staleCancel()
		}
	}
	if strings.HasPrefix(resp.Code, "ZF") {
		sess.srv.metrics.rejection(resp.Code)
	}
	return resp
}

// serverReady handles a ReadyForQuery (its one-byte body): it completes the
// unit, or first rolls back a block whose commit check failed.
func (sess *session) serverReady(body []byte) error {
	status := body[0]
	if end := sess.popThroughEnd(); end != nil && end.unit.checkFailed && end.unit.rollbackOnFail && status == 'E' {
		// The client's COMMIT was skipped after the failed check. End the
		// failed block so that the client sees what a failed deferred
		// constraint shows: its COMMIT failed and the session is idle.
		// The client's next message waits at the barrier (cstate.barrier),
		// so nothing of its own can reach the server before this ROLLBACK,
		// whose ReadyForQuery then completes the client's unit.
		sess.push(&entry{kind: eStmt, ours: true}, &entry{kind: eQueryEnd, ours: true, unit: &unit{}})
		return sess.sendServer('Q', []byte("ROLLBACK\x00"))
	}
	if err := sess.writeClient('Z', body); err != nil {
		return err
	}
	sess.readyForQuery(status)
	return nil
}

// ---------------------------------------------------------------------
// client -> server

// cstate is the client-to-server direction's view of the transaction.
type cstate struct {
	stmts   map[string]sqltx.Kind
	portals map[string]sqltx.Kind

	// pred is the predicted status after everything forwarded so far.
	pred byte

	// The current unit (messages up to a Sync).
	open       bool
	start      byte // status at the unit's start
	exact      bool // start is known from a ReadyForQuery with nothing outstanding
	kinds      []sqltx.Kind
	hasExecute bool
	unit       *unit

	ownCheck         []byte // the check as Close, Close, Parse, Bind, Execute messages
	ownPreparedCheck []byte // the prepared check as Close, Bind, Execute messages

	// copyRes is set after an Execute of COPY FROM STDIN until the client's
	// CopyDone/CopyFail, or until the server refused the COPY: while the
	// server is in copy-in mode it ignores Sync and Flush, which then must
	// not end the unit nor carry a check.
	copyRes chan bool

	// barrier is set after a unit with a check before an explicit COMMIT:
	// the next client message waits until that unit is answered.
	barrier bool
}

func apply(st byte, k sqltx.Kind) byte {
	switch k {
	case sqltx.Begin:
		if st == 'I' {
			return 'T'
		}
	case sqltx.Commit, sqltx.Rollback, sqltx.PrepareTransaction:
		return 'I'
	case sqltx.CommitChain, sqltx.RollbackChain:
		return 'T'
	}
	return st
}

func (sess *session) clientToServer() error {
	if sess.mode == modePassthrough {
		return sess.clientToServerPlain()
	}
	return sess.clientToServerFenced()
}

func (sess *session) flushServerIfIdle() error {
	if sess.cr.Buffered() == 0 {
		sess.swMu.Lock()
		err := sess.sw.Flush()
		sess.swMu.Unlock()
		return err
	}
	return nil
}

func (sess *session) clientToServerPlain() error {
	for {
		if err := sess.flushServerIfIdle(); err != nil {
			return err
		}
		typ, _, err := sess.cr.Next()
		if err != nil {
			return sess.clientReadError(err)
		}
		switch typ {
		case 'Q', 'S', 'F':
			// Each ends with one ReadyForQuery: count it, so that a shutdown
			// waits for the answer instead of closing a busy session.
			sess.mu.Lock()
			sess.outstanding++
			status := sess.status
			sess.mu.Unlock()
			if typ == 'Q' && sess.srv.cfg.DebugParseUnfenced {
				if err := sess.parseOnly(status); err != nil {
					return err
				}
				continue
			}
		}
		sess.swMu.Lock()
		err = sess.cr.CopyBody(sess.sw)
		sess.swMu.Unlock()
		if err != nil {
			return err
		}
		if typ == 'X' {
			sess.sw.Flush() //nolint:errcheck
			return io.EOF
		}
	}
}

// debugCheck stands in for the check in parseOnly's plans.
const debugCheck = "SELECT fence.check('debug', 1)"

// parseOnly forwards a Query after planning it as a fenced session would
// (--debug-parse-unfenced): the plan is thrown away.
func (sess *session) parseOnly(status byte) error {
	body, err := sess.cr.Body()
	if err != nil {
		return err
	}
	if sql, _, err := wire.CString(body); err == nil {
		sess.srv.sqlCache.PlanQuery(sql, status != 'I', status == 'E', debugCheck) //nolint:errcheck // a diagnostic: the server judges the text
	}
	return sess.writeServer('Q', body)
}

// clientReadError tells the client why its connection is being closed when
// the problem is its own message (too large, malformed).
func (sess *session) clientReadError(err error) error {
	if errors.Is(err, wire.ErrMessageTooLarge) {
		sess.fatalToClient(wire.CodeProgramLimitExceeded, err.Error())
		sess.drainClient()
	} else if errors.Is(err, wire.ErrMalformed) {
		sess.fatalToClient(wire.CodeProtocolViolation, err.Error())
	}
	return err
}

// drainClient drops what the client is still sending, for a moment, before
// its connection is closed. Closing a socket with unread data resets it,
// and the client, still writing its oversized message, would see
// "connection reset" instead of the error that says why.
func (sess *session) drainClient() {
	sess.client.SetReadDeadline(time.Now().Add(time.Second)) //nolint:errcheck // best effort
	io.Copy(io.Discard, io.LimitReader(sess.client, 64<<20)) //nolint:errcheck
}

// serverReadError tells the client why its connection is being closed when
// the server sent a message the proxy will not relay (above the limit).
func (sess *session) serverReadError(err error) error {
	if errors.Is(err, wire.ErrMessageTooLarge) {
		sess.fatalToClient(wire.CodeProgramLimitExceeded, "cannot relay the server's message: "+err.Error())
	}
	return err
}

func (sess *session) fatalToClient(code, msg string) {
	sess.log.Info("closing session", zap.String("sqlstate", code), zap.String("reason", msg))
	sess.cwMu.Lock()
	defer sess.cwMu.Unlock()
	resp := &pgproto3.ErrorResponse{Severity: wire.SeverityFatal, Code: code, Message: "fenceproxy: " + msg}
	wire.WriteMessage(sess.cw, 'E', wire.AppendError(nil, resp)[5:]) //nolint:errcheck
	sess.cw.Flush()                                                  //nolint:errcheck
}

func (sess *session) writeServer(typ byte, body []byte) error {
	sess.swMu.Lock()
	defer sess.swMu.Unlock()
	return wire.WriteMessage(sess.sw, typ, body)
}

// writeServerQuery writes a Query message carrying text, without copying
// text into a body first.
func (sess *session) writeServerQuery(text string) error {
	sess.swMu.Lock()
	defer sess.swMu.Unlock()
	if err := wire.WriteHeader(sess.sw, 'Q', len(text)+1); err != nil {
		return err
	}
	if _, err := sess.sw.WriteString(text); err != nil {
		return err
	}
	return sess.sw.WriteByte(0)
}

func (sess *session) writeServerRaw(b []byte) error {
	sess.swMu.Lock()
	defer sess.swMu.Unlock()
	_, err := sess.sw.Write(b)
	return err
}

// waitIdle blocks until every forwarded unit is answered and returns the
// server's status then.
func (sess *session) waitIdle() (byte, error) {
	if err := sess.flushServer(); err != nil {
		return 0, err
	}
	sess.mu.Lock()
	defer sess.mu.Unlock()
	for sess.outstanding > 0 && !sess.closed {
		sess.cond.Wait()
	}
	if sess.closed {
		return 0, errSessionClosed
	}
	return sess.status, nil
}

var errSessionClosed = errors.New("session closed")

// sendServer writes one message of the proxy's own to the server at once,
// from the server-to-client direction.
func (sess *session) sendServer(typ byte, body []byte) error {
	sess.swMu.Lock()
	defer sess.swMu.Unlock()
	if err := wire.WriteMessage(sess.sw, typ, body); err != nil {
		return err
	}
	return sess.sw.Flush()
}

func (sess *session) flushServer() error {
	sess.swMu.Lock()
	defer sess.swMu.Unlock()
	return sess.sw.Flush()
}

func (c *cstate) begin(sess *session) {
	if c.open {
		return
	}
	c.open = true
	c.kinds = c.kinds[:0]
	c.hasExecute = false
	c.unit = &unit{}
	c.unit.end.unit = c.unit
	sess.mu.Lock()
	if sess.outstanding == 0 && sess.queue.len() == 0 {
		c.start, c.exact = sess.status, true
	} else {
		c.start, c.exact = c.pred, false
	}
	sess.mu.Unlock()
}

func (c *cstate) ensureExact(sess *session) error {
	if c.exact {
		return nil
	}
	st, err := sess.waitIdle()
	if err != nil {
		return err
	}
	c.start, c.exact = st, true
	return nil
}

func (c *cstate) current() byte {
	st, _ := c.walk()
	return st
}

// walk applies the unit's statements to its start: the status after them,
// and whether a statement runs in the implicit transaction that the unit's
// Sync commits: one executed outside any block after the unit's start or
// after the last statement that ended a transaction (COMMIT, ROLLBACK,
// PREPARE TRANSACTION). A statement that opens a block (BEGIN, the chained
// COMMIT and ROLLBACK) takes the implicit transaction's earlier statements
// into the block, whose own commit point has the check. A statement that
// fails skips the rest of the unit and aborts the implicit transaction:
// nothing commits then, check or not.
func (c *cstate) walk() (st byte, implicitWork bool) {
	st = c.start
	for _, k := range c.kinds {
		st = apply(st, k)
		implicitWork = st == 'I' && !k.EndsBlock()
	}
	return st, implicitWork
}

// failed reports whether the unit is still inside a failed block, where a
// COMMIT only rolls back and a check would only add an error.
func (c *cstate) failed() bool {
	if c.start != 'E' {
		return false
	}
	for _, k := range c.kinds {
		if k.EndsBlock() || k == sqltx.CommitChain || k == sqltx.RollbackChain {
			return false
		}
	}
	return true
}

func (sess *session) clientToServerFenced() error {
	c := &cstate{
		stmts:   map[string]sqltx.Kind{},
		portals: map[string]sqltx.Kind{},
		pred:    'I',
	}
	c.ownCheck = ownStatementMessages(nil, sess.checkSQL)
	c.ownPreparedCheck = preparedCheckMessages()
	for {
		if err := sess.flushServerIfIdle(); err != nil {
			return err
		}
		typ, _, err := sess.cr.Next()
		if err != nil {
			return sess.clientReadError(err)
		}
		if c.barrier {
			if _, err := sess.waitIdle(); err != nil {
				return err
			}
			c.barrier = false
		}
		if c.copyRes != nil {
			handled, err := sess.duringCopy(c, typ)
			if err != nil {
				return err
			}
			if handled {
				continue
			}
		}
		switch typ {
		case 'Q':
			err = sess.onQuery(c)
		case 'P':
			err = sess.onParse(c)
		case 'B':
			err = sess.onBind(c)
		case 'E':
			err = sess.onExecute(c)
		case 'S':
			err = sess.onSync(c)
		case 'D':
			c.begin(sess)
			c.push(sess, &entry{kind: eDescribe})
			err = sess.forward()
		case 'C':
			err = sess.onClose(c)
		case 'F':
			err = sess.onFunctionCall(c)
		case 'H': // Flush
			if err = sess.forward(); err == nil {
				err = sess.flushServer()
			}
		case 'X':
			sess.forward()     //nolint:errcheck
			sess.flushServer() //nolint:errcheck
			return io.EOF
		default: // CopyData, CopyDone, CopyFail, and anything the server judges
			err = sess.forward()
		}
		if err != nil {
			return err
		}
	}
}

// duringCopy handles a client message after an extended-protocol COPY FROM
// STDIN: CopyData goes through; CopyDone/CopyFail end the copy (the next
// Sync is a real one); anything else waits until the server has said
// whether it entered copy-in mode. In copy-in mode a Sync or Flush is
// forwarded bare: the server ignores it. If the COPY was refused, the
// message is handled normally (handled is false).
func (sess *session) duringCopy(c *cstate, typ byte) (handled bool, err error) {
	switch typ {
	case 'd':
		return true, sess.forward()
	case 'c', 'f':
		c.copyRes = nil
		return true, sess.forward()
	}
	if err := sess.flushServer(); err != nil {
		return false, err
	}
	var started bool
	select {
	case started = <-c.copyRes:
	case <-sess.done:
		return false, errSessionClosed
	}
	if !started {
		c.copyRes = nil
		return false, nil
	}
	// Still in copy-in mode: the server ignores Sync and Flush, and refuses
	// anything else itself (which ends the session, as it would directly).
	// Put the answer back for the next message.
	c.copyRes <- true
	return true, sess.forward()
}

// forward streams the current client message to the server unchanged.
func (sess *session) forward() error {
	sess.swMu.Lock()
	defer sess.swMu.Unlock()
	return sess.cr.CopyBody(sess.sw)
}

func (sess *session) protocolError(what string, err error) error {
	msg := fmt.Sprintf("malformed %s message: %v", what, err)
	sess.fatalToClient(wire.CodeProtocolViolation, msg)
	return errors.New(msg)
}

func (sess *session) onParse(c *cstate) error {
	body, err := sess.cr.Body()
	if err != nil {
		return err
	}
	name, rest, err := wire.CString(body)
	if err != nil {
		return sess.protocolError("Parse", err)
	}
	query, _, err := wire.CString(rest)
	if err != nil {
		return sess.protocolError("Parse", err)
	}
	c.begin(sess)
	kind, cerr := sess.srv.sqlCache.Classify(query)
	if cerr == nil {
		cerr = sess.settingsKnown(c, query)
	}
	if cerr == nil {
		cerr = sess.lexUnsafe(kind)
	}
	if cerr != nil {
		// The proxy cannot tell what this statement does: refuse it rather
		// than risk an unchecked commit.
		c.stmts[name] = sqltx.Other
		return sess.refuse(c, sess.parseRefusal(cerr))
	}
	c.stmts[name] = kind
	c.push(sess, &entry{kind: eParse})
	return sess.writeServer('P', body)
}

var (
	errStdStrings = errors.New("standard_conforming_strings is off")
	errEncoding   = errors.New("client_encoding is not ASCII-safe")
)

// errPipelinedSetting refuses text that would lex differently with
// standard_conforming_strings off, sent behind an Execute of the same unit
// that might have turned it off (set_config in a query): the server reports
// the setting only at the unit's ReadyForQuery.
var errPipelinedSetting = errors.New("a string literal with a backslash behind an Execute of the same pipeline segment")

// settingsKnown makes sure the lexing settings the server will apply to sql
// are known before the proxy parses it, when it matters: for text that
// standard_conforming_strings changes the meaning of, it waits until every
// earlier unit has reported its settings (ReadyForQuery), and refuses it
// behind an Execute of its own unit.
func (sess *session) settingsKnown(c *cstate, sql string) error {
	sensitive, err := sqltx.StdStringsSensitive(sql)
	if err != nil || !sensitive {
		return err
	}
	if c.hasExecute {
		return errPipelinedSetting
	}
	return c.ensureExact(sess)
}

// lexUnsafe reports whether the session's settings, or the statement about
// to change them, would make the server lex SQL differently from the
// proxy's parser (a COMMIT could then hide from the proxy).
func (sess *session) lexUnsafe(kinds ...sqltx.Kind) error {
	for _, k := range kinds {
		switch k {
		case sqltx.SetStdStrings:
			return errStdStrings
		case sqltx.SetClientEncoding:
			return errEncoding
		}
	}
	if sess.stdStringsOff.Load() {
		return errStdStrings
	}
	if sess.encodingUnsafe.Load() {
		return errEncoding
	}
	return nil
}

func (sess *session) parseRefusal(err error) *fence.Error {
	switch {
	case errors.Is(err, errPipelinedSetting):
		return fence.NotAllowed(err.Error(),
			"standard_conforming_strings might have changed in between (the server reports it only at Sync); send a Sync first, or pass the value as a parameter")
	case errors.Is(err, errStdStrings):
		return fence.NotAllowed("standard_conforming_strings=off",
			"fenceproxy parses SQL with PostgreSQL's grammar under standard_conforming_strings=on; keep that setting on in fenced sessions")
	case errors.Is(err, errEncoding):
		return fence.NotAllowed("a client_encoding whose multibyte characters can contain backslashes or quotes (SJIS, BIG5, GBK, UHC, GB18030, JOHAB)",
			"use UTF8 (or another ASCII-safe encoding) in fenced sessions")
	}
	var se *sqltx.SyntaxError
	if errors.As(err, &se) {
		// PostgreSQL's own grammar refused it: answer as the server would.
		return &fence.Error{Code: wire.CodeSyntaxError, Message: se.Message, Position: int32(se.Position)}
	}
	fe := fence.NotAllowed("statement that fenceproxy could not parse: "+err.Error(),
		"fenceproxy must find transaction control in every statement of a fenced session")
	fe.Code = wire.CodeSyntaxError
	return fe
}

func (sess *session) onBind(c *cstate) error {
	body, err := sess.cr.Body()
	if err != nil {
		return err
	}
	portal, rest, err := wire.CString(body)
	if err != nil {
		return sess.protocolError("Bind", err)
	}
	stmt, _, err := wire.CString(rest)
	if err != nil {
		return sess.protocolError("Bind", err)
	}
	c.begin(sess)
	c.portals[portal] = c.stmts[stmt]
	c.push(sess, &entry{kind: eBind})
	return sess.writeServer('B', body)
}

func (sess *session) onClose(c *cstate) error {
	body, err := sess.cr.Body()
	if err != nil {
		return err
	}
	if len(body) < 2 {
		return sess.protocolError("Close", io.ErrUnexpectedEOF)
	}
	name, _, err := wire.CString(body[1:])
	if err != nil {
		return sess.protocolError("Close", err)
	}
	switch body[0] {
	case 'S':
		delete(c.stmts, name)
		if name == ownPrepared {
			sess.ownPrepared.Store(false)
		}
	case 'P':
		delete(c.portals, name)
	}
	c.begin(sess)
	c.push(sess, &entry{kind: eClose})
	return sess.writeServer('C', body)
}

func (sess *session) onExecute(c *cstate) error {
	body, err := sess.cr.Body()
	if err != nil {
		return err
	}
	portal, _, err := wire.CString(body)
	if err != nil {
		return sess.protocolError("Execute", err)
	}
	c.begin(sess)
	c.hasExecute = true
	kind := c.portals[portal]
	if dropsPrepared(kind) {
		sess.ownPrepared.Store(false)
	}
	// A stale session's statements are refused before they run, except those
	// that end its transaction: commit points go through the check, which
	// fails against the database and leaves the session idle (obligation 4).
	if fe := sess.refusal(); fe != nil && !harmless(kind) && !kind.CommitPoint() {
		return sess.refuse(c, fe)
	}
	switch {
	case kind.CommitPoint():
		if err := c.ensureExact(sess); err != nil {
			return err
		}
		if !c.failed() {
			if err := sess.injectCheck(c, false); err != nil {
				return err
			}
			c.unit.rollbackOnFail = true
		}
	case kind == sqltx.Call || kind == sqltx.Do:
		if c.current() == 'I' {
			if err := c.ensureExact(sess); err != nil {
				return err
			}
			if c.current() == 'I' {
				return sess.refuse(c, fence.NotAllowed(kind.String()+" outside a transaction block",
					"a procedure called outside a block can COMMIT past the fencing check; wrap the call in BEGIN ... COMMIT, or send it with the simple query protocol"))
			}
		}
	case kind.OwnTransaction() && !kind.SafeWithoutCheck():
		return sess.refuse(c, noTxBlockRefusal())
	}
	c.kinds = append(c.kinds, kind)
	e := &entry{kind: eExecute}
	if kind == sqltx.CopyIn {
		e.copyRes = make(chan bool, 1)
		c.copyRes = e.copyRes
	}
	c.push(sess, e)
	return sess.writeServer('E', body)
}

func noTxBlockRefusal() *fence.Error {
	return fence.NotAllowed("statement that runs in its own transaction (it cannot be made conditional on the fencing token)",
		"run it in a session without fencing (an administrator's connection straight to PostgreSQL)")
}

func (sess *session) staleError() *fence.Error {
	fe := fence.Stale(sess.cred.Resource, sess.cred.Token, sess.admitted.Load())
	fe.Detail = "fenceproxy refused this statement before it ran: another holder of the lock was admitted with a higher token."
	return fe
}

func (sess *session) onSync(c *cstate) error {
	body, err := sess.cr.Body()
	if err != nil {
		return err
	}
	c.begin(sess)
	if c.hasExecute {
		st, work := c.walk()
		if st != 'I' {
			if err := c.ensureExact(sess); err != nil {
				return err
			}
			st, work = c.walk()
		}
		// The implicit transaction commits at this Sync. When the unit's
		// start is known exactly, a unit whose last statements ended their
		// block (COMMIT, which had its check, or ROLLBACK) leaves nothing in
		// it; a predicted start gets the check anyway rather than wait.
		if st == 'I' && (!c.exact || work) {
			if err := sess.injectCheck(c, false); err != nil {
				return err
			}
		}
	}
	return sess.endUnit(c, eSync, 'S', body)
}

// endUnit forwards the message that ends the unit and, after a check before
// an explicit COMMIT, waits for its outcome (obligation 4).
func (sess *session) endUnit(c *cstate, kind entryKind, typ byte, body []byte) error {
	u := sess.queueEnd(c, kind, nil)
	if err := sess.writeServer(typ, body); err != nil {
		return err
	}
	return sess.afterEnd(c, u)
}

// endQuery is endUnit for a Query message carrying text, whose statements'
// entries (stmts) are queued with the unit's end.
func (sess *session) endQuery(c *cstate, text string, stmts []entry) error {
	u := sess.queueEnd(c, eQueryEnd, stmts)
	if err := sess.writeServerQuery(text); err != nil {
		return err
	}
	return sess.afterEnd(c, u)
}

// queueEnd closes the current unit and queues stmts, then its end entry.
func (sess *session) queueEnd(c *cstate, kind entryKind, stmts []entry) *unit {
	u := c.unit
	c.pred = c.current()
	c.open = false
	u.end.kind = kind
	sess.mu.Lock()
	sess.outstanding++
	for i := range stmts {
		stmts[i].unit = u
		sess.queue.push(&stmts[i])
	}
	sess.queue.push(&u.end)
	sess.mu.Unlock()
	return u
}

// afterEnd is what endUnit does once the message is written.
func (sess *session) afterEnd(c *cstate, u *unit) error {
	if u.rollbackOnFail {
		// Nothing more of the client's may reach the server before this
		// unit's outcome is known (the proxy may have to roll back): the next
		// message waits for it (see clientToServerFenced). The client almost
		// always waits for the answer itself, so this costs nothing then.
		c.barrier = true
		return sess.flushServer()
	}
	return nil
}

// injectCheck sends the proxy's check before the message being handled:
// Bind and Execute of the check prepared at session start while the session
// has it, else the check's text (Parse, Bind, Execute under the proxy's own
// names), with Closes first where a leftover of an earlier check could
// collide. An error in any of them is the check's: the Bind of the prepared
// check fails when it is gone (26000), and the proxy then sends the text
// from now on. Ahead of a simple Query (beforeQuery) the server waits for a
// Sync after such an error, which the proxy then sends (entry.syncOnError).
func (sess *session) injectCheck(c *cstate, beforeQuery bool) error {
	sess.srv.metrics.checks(1)
	own := func(k entryKind, check bool) *entry {
		return &entry{kind: k, ours: true, check: check, syncOnError: beforeQuery}
	}
	switch {
	case !sess.ownPrepared.Load():
		c.push(sess, own(eClose, false), own(eClose, false), own(eParse, true), own(eBind, true), own(eExecute, true))
		return sess.writeServerRaw(c.ownCheck)
	case c.exact:
		// Every place a check goes ends the transaction right after it
		// (a commit point, or a Sync in an implicit transaction), and a
		// transaction's end drops the portal: when the state is known
		// exactly, the portal cannot be left from an earlier check and
		// needs no Close first.
		c.push(sess, own(eBind, true), own(eExecute, true))
		return sess.writeServerRaw(c.ownPreparedCheck[closePortalLen:])
	default:
		c.push(sess, own(eClose, false), own(eBind, true), own(eExecute, true))
		return sess.writeServerRaw(c.ownPreparedCheck)
	}
}

// refuse replaces the current client message with a statement that makes
// the server raise fe, so the refusal arrives in order and the server skips
// the rest of the unit by its own rules. The current message's body must
// already be consumed or is discarded here.
func (sess *session) refuse(c *cstate, fe *fence.Error) error {
	if err := sess.cr.Discard(); err != nil {
		return err
	}
	c.push(sess,
		&entry{kind: eClose, ours: true},
		&entry{kind: eClose, ours: true},
		&entry{kind: eParse, ours: true},
		&entry{kind: eBind, ours: true},
		&entry{kind: eExecute, ours: true, refusal: fe},
	)
	return sess.writeServerRaw(ownStatementMessages(nil, refusalSQL(fe)))
}

// refusalSQL raises fe's SQLSTATE on the server. The text is the proxy's
// own (validated names, integers); quotes are doubled regardless. The client
// never sees this error: the proxy replaces it with fe itself.
func refusalSQL(fe *fence.Error) string {
	return "DO $fenceproxy$BEGIN RAISE EXCEPTION USING ERRCODE = '" + fe.Code + "', MESSAGE = '" +
		strings.ReplaceAll(strings.ReplaceAll(fe.Message, "'", "''"), "$fenceproxy$", "") + "'; END$fenceproxy$"
}

// closePortalLen is the length of the Close message that starts
// preparedCheckMessages.
const closePortalLen = 1 + 4 + 1 + len(ownPortal) + 1 // type, length, 'P', name, NUL

// preparedCheckMessages are Close portal, Bind and Execute of the prepared
// check under the proxy's own portal name.
func preparedCheckMessages() []byte {
	dst := wire.AppendMessage(nil, 'C', append([]byte{'P'}, ownPortal+"\x00"...))
	bind := append([]byte(ownPortal+"\x00"+ownPrepared+"\x00"), 0, 0, 0, 0, 0, 0)
	dst = wire.AppendMessage(dst, 'B', bind)
	return wire.AppendMessage(dst, 'E', append([]byte(ownPortal+"\x00"), 0, 0, 0, 0))
}

// checkText is the check a simple Query carries.
func (sess *session) checkText() string {
	if sess.ownPrepared.Load() {
		return "EXECUTE " + ownPrepared
	}
	return sess.checkSQL
}

// dropsPrepared reports whether a statement of kind k may remove the
// proxy's prepared check.
func dropsPrepared(k sqltx.Kind) bool {
	return k == sqltx.Deallocate || k == sqltx.Maintenance // DISCARD ALL
}

// ownStatementMessages appends Close portal, Close statement, Parse, Bind and
// Execute of sql under the proxy's own names.
func ownStatementMessages(dst []byte, sql string) []byte {
	dst = wire.AppendMessage(dst, 'C', append([]byte{'P'}, ownPortal+"\x00"...))
	dst = wire.AppendMessage(dst, 'C', append([]byte{'S'}, ownStmt+"\x00"...))
	parse := make([]byte, 0, len(ownStmt)+len(sql)+4)
	parse = append(parse, ownStmt+"\x00"...)
	parse = append(parse, sql...)
	parse = append(parse, 0, 0, 0) // no parameter types
	dst = wire.AppendMessage(dst, 'P', parse)
	bind := make([]byte, 0, 64)
	bind = append(bind, ownPortal+"\x00"+ownStmt+"\x00"...)
	bind = append(bind, 0, 0, 0, 0, 0, 0) // no formats, no parameters, no result formats
	dst = wire.AppendMessage(dst, 'B', bind)
	exec := append([]byte(ownPortal+"\x00"), 0, 0, 0, 0)
	return wire.AppendMessage(dst, 'E', exec)
}

func (sess *session) onQuery(c *cstate) error {
	body, err := sess.cr.Body()
	if err != nil {
		return err
	}
	sql, _, err := wire.CString(body)
	if err != nil {
		return sess.protocolError("Query", err)
	}
	c.begin(sess)
	if err := sess.settingsKnown(c, sql); err != nil {
		return sess.refuseQuery(c, sess.parseRefusal(err))
	}
	// The session's lexing settings are checked with the plan's statements
	// below (lexUnsafe): a plan made under other settings is never sent.
	st := c.current()
	plan, perr := sess.srv.sqlCache.PlanQuery(sql, st != 'I', c.failed(), sess.checkText())
	if slices.ContainsFunc(plan.Kinds, dropsPrepared) && sess.ownPrepared.Load() {
		// The string may deallocate the prepared check before it runs (a
		// lone DISCARD ALL comes with ErrNeedsOwnTransaction, and its kind).
		sess.ownPrepared.Store(false)
		if perr == nil {
			plan, perr = sess.srv.sqlCache.PlanQuery(sql, st != 'I', c.failed(), sess.checkText())
		}
	}
	if perr == nil && !c.exact && (st != 'I' || plan.Checks > finalChecks(plan)) {
		if err := c.ensureExact(sess); err != nil {
			return err
		}
		st = c.current()
		plan, perr = sess.srv.sqlCache.PlanQuery(sql, st != 'I', c.failed(), sess.checkText())
	}
	if perr != nil {
		if !errors.Is(perr, sqltx.ErrNeedsOwnTransaction) {
			return sess.refuseQuery(c, sess.parseRefusal(perr))
		}
		// A lone statement that PostgreSQL runs outside any block: no check
		// can share its transaction. Maintenance that changes no data
		// (VACUUM, DISCARD ALL) goes as it is; the rest is refused.
		if len(plan.Kinds) != 1 || !plan.Kinds[0].SafeWithoutCheck() {
			return sess.refuseQuery(c, noTxBlockRefusal())
		}
	}
	if err := sess.lexUnsafe(plan.Kinds...); err != nil {
		return sess.refuseQuery(c, sess.parseRefusal(err))
	}
	if fe := sess.refusal(); fe != nil && plan.Checks == finalChecks(plan) && !harmlessQuery(plan) {
		return sess.refuseQuery(c, fe)
	}
	if plan.Checks > finalChecks(plan) {
		c.unit.rollbackOnFail = true
	}
	text, ours := plan.Text, plan.Ours
	if plan.Checks == 1 && ours[0] {
		// The one check goes before the string's first statement, a commit
		// point in an explicit block (END, COMMIT, COMMIT AND CHAIN, PREPARE
		// TRANSACTION): it is sent ahead of the client's Query as
		// extended-protocol messages, which cost the server about 10 k
		// instructions less than an EXECUTE statement inside the string
		// (bench/check-cost.sh), and the Query goes as the client sent it.
		if err := sess.injectCheck(c, true); err != nil {
			return err
		}
		text, ours = sql, ours[1:]
	} else {
		sess.srv.metrics.checks(plan.Checks)
	}
	// One entry per statement (an empty query gets one EmptyQueryResponse),
	// allocated together.
	es := make([]entry, max(len(ours), 1))
	for i := range es {
		es[i].kind = eStmt
		if i < len(ours) && ours[i] {
			es[i].ours, es[i].check = true, true
		}
	}
	// The Query ends the unit; its statements decide the state after it.
	c.kinds = append(c.kinds, plan.Kinds...)
	return sess.endQuery(c, text, es)
}

// finalChecks is 1 when the plan's last statement is the check appended for
// the implicit transaction, which needs no ROLLBACK when it fails.
func finalChecks(p sqltx.QueryPlan) int {
	if n := len(p.Ours); n > 0 && p.Ours[n-1] {
		return 1
	}
	return 0
}

// harmlessQuery reports whether a stale session's Query only ends its
// transaction (ROLLBACK and friends), which the proxy lets through.
func harmlessQuery(p sqltx.QueryPlan) bool {
	if len(p.Kinds) == 0 {
		return false
	}
	for _, k := range p.Kinds {
		if !harmless(k) {
			return false
		}
	}
	return true
}

// refuseQuery answers a Query with a refusal raised by the server.
func (sess *session) refuseQuery(c *cstate, fe *fence.Error) error {
	return sess.endQuery(c, refusalSQL(fe), []entry{{kind: eStmt, ours: true, refusal: fe}})
}

func (sess *session) onFunctionCall(c *cstate) error {
	body, err := sess.cr.Body()
	if err != nil {
		return err
	}
	c.begin(sess)
	if c.current() == 'I' {
		if err := c.ensureExact(sess); err != nil {
			return err
		}
	}
	if fe := sess.refusal(); c.current() == 'I' || fe != nil {
		if fe == nil {
			fe = fence.NotAllowed("fast-path function call outside a transaction block",
				"a function call outside a block commits without the fencing check; call it inside BEGIN ... COMMIT")
		}
		return sess.refuseQuery(c, fe)
	}
	if len(body) < 4 {
		return sess.protocolError("FunctionCall", io.ErrUnexpectedEOF)
	}
	_ = binary.BigEndian.Uint32(body)
	c.push(sess, &entry{kind: eFunc})
	return sess.endUnit(c, eQueryEnd, 'F', body)
}

// harmless kinds only end or unwind a transaction: a stale session may
// still send them, so that it can leave its block.
func harmless(k sqltx.Kind) bool {
	switch k {
	case sqltx.Rollback, sqltx.RollbackTo, sqltx.RollbackPrepared, sqltx.Release:
		return true
	}
	return false
}
