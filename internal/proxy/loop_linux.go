//go:build linux

package proxy

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// The event loop: the relay's hot path, for sessions whose both connections are plain
// sockets (no TLS). Once a session is started (a fenced one bound to its token), relay hands
// its two sockets to one loop shared by all sessions, which moves bytes between them and
// looks at nothing but the 5-byte message headers, as PgBouncer does. Everything else (an
// end, a refusal, a Terminate, an error, a closed socket, a full socket buffer) is the
// goroutine relay's (relay.go): the loop hands the session back at a message boundary, or
// with the part of a message still to pass, and relay carries on from there. The
// guarantee does not rest on the loop any more than on relay.go: PostgreSQL ends a stale
// backend itself (migrations/00004_bind_sessions.sql).
//
// Why a loop, measured (docs/BENCHMARKS.md): with a goroutine per direction, every message
// costs Go's netpoller a second read (to EAGAIN: its readiness flag is cleared before each
// read, so it cannot wait without one) and a goroutine wake-up, about 14 system calls and 6
// context switches per select-only transaction at 1 client where PgBouncer makes 6 and 2.
// The loop makes 6 and 2: one epoll_wait and one read and write per message, for all the
// sessions whose data is ready at once.
//
// The tricks, each with its reason:
//   - Edge-triggered epoll, and a read shorter than the buffer ends the reading of a
//     socket: it was drained then, and data arriving later raises a new edge. So there is
//     no read that returns EAGAIN. The exception is the peer's end (or an error) reported
//     with the data: it raises no edge of its own, so that event is read to the end (pump).
//   - The wait is a raw system call (rawEpollWait): a Go system call gives up its
//     processor when it blocks (entersyscall), and taking it back on every wake-up cost as
//     much as the goroutine relay saved (measured: 7.7 system calls and 3.7 context
//     switches per transaction, sysmon's and futex's included). The loop keeps a processor
//     while it waits (while no session is registered it waits as other system calls do);
//     the runtime still preempts it (a signal, which ends the wait with EINTR) for a
//     garbage collection, and after 10 ms of waiting. So the loop is used only when
//     GOMAXPROCS is 2 or more, and there is one loop per process. Reads and writes are raw
//     too, and a busy loop yields every 2 ms (rawRead, yieldEvery).
//   - No lock, allocation or goroutine hand-off a message: the loop keeps the session's
//     count of units in flight itself while it has the session (commit), and an
//     ErrorResponse is decoded only for a fenced session.
//   - The sockets are the loop's own duplicates, and the net.Conns they came from are
//     closed: Go's netpoller, which watches those, would wake up for every packet too.
//   - One read buffer for the whole loop: bytes are written on at once, so an idle
//     session holds no buffer (a few bytes of an incomplete header at most).
//   - A full socket buffer hands the session back instead of queueing bytes in the loop:
//     the goroutine relay writes with blocking calls (a session that streams more than the
//     client reads stays with it).

// loopOff says why the event loop is not used ("": it is).
func loopOff() string {
	if runtime.GOMAXPROCS(0) < 2 {
		return "GOMAXPROCS is below 2"
	}
	if strings.Contains(os.Getenv("GODEBUG"), "asyncpreemptoff=1") {
		return "GODEBUG asyncpreemptoff=1: the runtime could not stop the loop's wait" // for a garbage collection
	}
	return ""
}

// relayLoop is the event loop: one goroutine waiting in epoll_wait, then relaying what
// each ready socket has.
type relayLoop struct {
	ep, wake int // the epoll instance and the eventfd that wakes it for tasks

	mu    sync.Mutex
	tasks []loopTask // guarded by mu

	// The loop goroutine's alone:
	byFD   []*loopSession // the registered sessions by socket
	active int            // how many sessions are registered
	buf    []byte         // the read buffer
	evs    []unix.EpollEvent
}

type loopTask struct {
	ls  *loopSession
	add bool // register ls (else: hand it back)
}

// loopSession is a session relayed by the loop. d[0] is the client-to-server direction
// (it reads fd[0] and writes fd[1]), d[1] the other.
type loopSession struct {
	sess     *session
	loop     *relayLoop
	fd       [2]int // the loop's duplicates of the client's and the server's socket
	d        [2]loopDir
	fenced   bool
	max      int // largest body accepted (Config.MaxMessageSize)
	recalled atomic.Bool

	// The session's outstanding and status while the loop has it (no lock a message:
	// nothing else reads them then; every reader recalls the session first).
	outstanding int
	status      byte

	registered bool          // the loop goroutine's: in the epoll set
	back       chan struct{} // closed by the loop when it has let go of the session
	rebuilt    chan struct{} // closed by relay when the goroutine relay has the session
}

// loopDir is one direction's framing state between reads.
type loopDir struct {
	rest  int     // bytes of the current message, relayed in part, still to come
	hold  [5]byte // an incomplete header (or a ReadyForQuery's without its status) ...
	nhold int     // ... of this many bytes, not relayed yet
	in    []byte  // at registration and hand-back: bytes read and not relayed
}

var shared struct {
	once sync.Once
	loop *relayLoop
	err  error
}

// sharedLoop starts the process's event loop the first time it is asked for.
func sharedLoop() (*relayLoop, error) {
	shared.once.Do(func() {
		shared.loop, shared.err = newRelayLoop()
		if shared.err == nil {
			go shared.loop.run()
		}
	})
	return shared.loop, shared.err
}

func newRelayLoop() (*relayLoop, error) {
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("epoll_create1: %w", err)
	}
	wake, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		unix.Close(ep)
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(wake)}
	if err := unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, wake, &ev); err != nil {
		unix.Close(ep)
		unix.Close(wake)
		return nil, fmt.Errorf("epoll_ctl: %w", err)
	}
	return &relayLoop{ep: ep, wake: wake, buf: make([]byte, 64<<10), evs: make([]unix.EpollEvent, 256)}, nil
}

// rawEpollWait waits for events without giving up the processor (see above).
func rawEpollWait(ep int, evs []unix.EpollEvent) (int, unix.Errno) {
	n, _, e := unix.RawSyscall6(unix.SYS_EPOLL_PWAIT, uintptr(ep), uintptr(unsafe.Pointer(&evs[0])), uintptr(len(evs)), ^uintptr(0), 0, 0)
	return int(n), e
}

// yieldEvery is how often a busy loop yields its processor (run).
const yieldEvery = 2 * time.Millisecond

// rawRead and rawWrite are read and write on non-blocking sockets, which never block: as
// raw system calls they skip the runtime's bookkeeping of a call that might (entersyscall,
// exitsyscall), and sysmon never hands the loop's processor to another thread in the
// middle of one. With yieldEvery, measured at 64 clients (select-only, 3 interleaved runs,
// perf stat on the proxy): 4.0-4.4 system calls, 0.29-0.53 context switches and 22-25 us
// of CPU per transaction, where Go's read and write made 4.6-5.5, 0.66-1.42 and 30 us
// (PgBouncer: 3.8-4.3, 0.17-0.19, 20-26 us).
func rawRead(fd int, b []byte) (int, error) {
	n, _, e := unix.RawSyscall(unix.SYS_READ, uintptr(fd), uintptr(unsafe.Pointer(unsafe.SliceData(b))), uintptr(len(b)))
	if e != 0 {
		return 0, e
	}
	return int(n), nil
}

func rawWrite(fd int, b []byte) (int, error) {
	n, _, e := unix.RawSyscall(unix.SYS_WRITE, uintptr(fd), uintptr(unsafe.Pointer(unsafe.SliceData(b))), uintptr(len(b)))
	if e != 0 {
		return 0, e
	}
	return int(n), nil
}

func (l *relayLoop) run() {
	yielded := time.Now()
	for {
		if l.active > 0 && time.Since(yielded) > yieldEvery {
			// A goroutine that has run for 10 ms is preempted by a signal (sysmon), and
			// sysmon then polls every 20 us; yielding first costs neither.
			runtime.Gosched()
			yielded = time.Now()
		}
		var n int
		var e error
		if l.active > 0 {
			var errno unix.Errno
			if n, errno = rawEpollWait(l.ep, l.evs); errno != 0 {
				e = errno
			}
		} else {
			// No session: wait as any system call does, giving the processor up.
			n, e = unix.EpollWait(l.ep, l.evs, -1)
		}
		if e == unix.EINTR {
			continue
		}
		if e != nil {
			panic(fmt.Sprintf("fenceproxy: the relay's epoll_wait failed: %v", e)) // EBADF, EFAULT, EINVAL: a bug
		}
		for _, ev := range l.evs[:n] {
			fd := int(ev.Fd)
			if fd == l.wake {
				l.runTasks()
				continue
			}
			if fd >= len(l.byFD) || l.byFD[fd] == nil {
				continue // handed back earlier in this batch
			}
			ls := l.byFD[fd]
			dir := 0
			if fd == ls.fd[1] {
				dir = 1
			}
			l.pump(ls, dir, ev.Events&(unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0)
		}
	}
}

func (l *relayLoop) push(t loopTask) {
	l.mu.Lock()
	l.tasks = append(l.tasks, t)
	l.mu.Unlock()
	var one [8]byte
	binary.NativeEndian.PutUint64(one[:], 1)
	unix.Write(l.wake, one[:]) //nolint:errcheck // EAGAIN: the counter is not zero, the loop wakes anyway
}

func (l *relayLoop) runTasks() {
	var b [8]byte
	unix.Read(l.wake, b[:]) //nolint:errcheck // resets the counter
	l.mu.Lock()
	tasks := l.tasks
	l.tasks = nil
	l.mu.Unlock()
	for _, t := range tasks {
		switch {
		case t.add:
			l.register(t.ls)
		case t.ls.registered:
			l.handBack(t.ls, "recall")
		}
	}
}

func (l *relayLoop) register(ls *loopSession) {
	for _, fd := range ls.fd {
		for fd >= len(l.byFD) {
			l.byFD = append(l.byFD, nil)
		}
		l.byFD[fd] = ls
		ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(fd)}
		if err := unix.EpollCtl(l.ep, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
			ls.registered = true
			l.active++
			l.handBack(ls, "end")
			return
		}
	}
	ls.registered = true
	l.active++
	if ls.recalled.Load() {
		l.handBack(ls, "recall") // recalled before it was registered
		return
	}
	// What the startup's readers had read already goes first; the sockets' own data
	// raised an edge at EPOLL_CTL_ADD, whose event follows.
	for dir := range ls.d {
		if in := ls.d[dir].in; len(in) > 0 {
			ls.d[dir].in = nil
			if !l.pass(ls, dir, in) {
				return
			}
		}
	}
}

// handBack takes the session out of the loop, with what each direction read and did not
// relay in d[].in, and tells relay (back).
func (l *relayLoop) handBack(ls *loopSession, reason string) {
	ls.sess.srv.metrics.handBack(reason)
	ls.sess.mu.Lock()
	ls.sess.outstanding, ls.sess.status = ls.outstanding, ls.status
	ls.sess.mu.Unlock()
	for _, fd := range ls.fd {
		unix.EpollCtl(l.ep, unix.EPOLL_CTL_DEL, fd, nil) //nolint:errcheck // not registered: nothing to remove
		if fd < len(l.byFD) && l.byFD[fd] == ls {
			l.byFD[fd] = nil
		}
	}
	for dir := range ls.d {
		d := &ls.d[dir]
		if d.nhold > 0 {
			d.in = append(append([]byte(nil), d.hold[:d.nhold]...), d.in...)
			d.nhold = 0
		}
	}
	ls.registered = false
	l.active--
	close(ls.back)
}

// pump relays what direction dir's source has until it would block. end says that the
// event that woke the loop was also the peer's end (or an error): it is read after the
// data, with no edge of its own, so the reading goes on past a short read.
func (l *relayLoop) pump(ls *loopSession, dir int, end bool) {
	d := &ls.d[dir]
	for {
		b := l.buf
		k := copy(b, d.hold[:d.nhold])
		n, err := rawRead(ls.fd[dir], b[k:])
		if err == unix.EAGAIN {
			return
		}
		if err == unix.EINTR {
			continue
		}
		if err != nil || n == 0 {
			// The end, or an error: the goroutine relay reads it again and does what it
			// does with an end (a reset reads as an end then).
			l.handBack(ls, "end")
			return
		}
		d.nhold = 0
		if !l.pass(ls, dir, b[:k+n]) {
			return
		}
		if k+n < len(b) && !end {
			return // drained: more data, or the end, raises a new edge
		}
	}
}

// pass relays b, read from direction dir's source, up to the first message the loop
// leaves to the goroutine relay, and keeps an incomplete header for the next read. It
// reports whether the session is still the loop's.
func (l *relayLoop) pass(ls *loopSession, dir int, b []byte) bool {
	d := &ls.d[dir]
	j, stop := ls.scan(dir, b)
	w := 0
	reason := "message"
	for w < j {
		n, err := rawWrite(ls.fd[1-dir], b[w:j])
		if n > 0 {
			w += n
		}
		if err == unix.EINTR {
			continue
		}
		if err == unix.EAGAIN {
			reason = "full" // the goroutine relay writes the rest, waiting as long as it takes
			break
		}
		if err != nil || n == 0 {
			reason = "end" // the goroutine relay fails to write it too
			break
		}
	}
	ls.commit(dir, b, w)
	if w < j || stop {
		d.in = append([]byte(nil), b[w:]...)
		l.handBack(ls, reason)
		return false
	}
	d.nhold = copy(d.hold[:], b[j:])
	return true
}

// scan finds how much of b, read from direction dir's source, the loop relays itself: up
// to the first message it leaves to the goroutine relay (stop), or to an incomplete
// header at the end. It changes nothing: commit does, for what was written.
//
// Left to the goroutine relay, as the message that needs it: a Terminate (the session
// ends); a fenced session's message when the proxy knows it is stale or blocked (it is
// refused, after the answers in flight); a length below 4 or above the limit; a
// ReadyForQuery that is not 5 bytes; and a fenced session's ErrorResponse that is not
// whole in b or is FATAL 57P01 (a raise may have ended the backend: explainServerEnd).
func (ls *loopSession) scan(dir int, b []byte) (j int, stop bool) {
	i := ls.d[dir].rest
	for i < len(b) {
		if len(b)-i < 5 {
			return i, false
		}
		typ := b[i]
		length := int(binary.BigEndian.Uint32(b[i+1:]))
		if length < 4 || length-4 > ls.max {
			return i, true
		}
		if dir == 0 {
			if typ == 'X' || ls.fenced && ls.sess.refusal() != nil {
				return i, true
			}
		} else {
			switch {
			case typ == 'Z' && length != 5:
				return i, true
			case typ == 'Z' && len(b)-i < 6:
				return i, false // its status byte comes with the next read
			case typ == 'E' && ls.fenced:
				if i+1+length > len(b) {
					return i, true
				}
				if e, err := wire.DecodeError(b[i+5 : i+1+length]); err != nil || e.Severity == wire.SeverityFatal && e.Code == wire.CodeAdminShutdown {
					return i, true
				}
			}
		}
		i += 1 + length
	}
	return len(b), false
}

// commit does what relaying b[:w] (of b, scanned), written to direction dir's
// destination, means for the session: the units counted as relay.go counts them
// (outstanding and status, the loop's own until handBack gives them to the session), a
// server's FATAL noted (serverSaid), and where the last message stops (rest).
func (ls *loopSession) commit(dir int, b []byte, w int) {
	d := &ls.d[dir]
	i := d.rest
	sess := ls.sess
	for i < w {
		// scan saw this header whole in b, even if it was written only in part.
		typ := b[i]
		end := i + 1 + int(binary.BigEndian.Uint32(b[i+1:]))
		switch {
		case dir == 0 && (typ == 'Q' || typ == 'S' || typ == 'F'):
			ls.outstanding++
		case dir == 1 && typ == 'Z':
			ls.status = b[i+5]
			if ls.outstanding > 0 {
				ls.outstanding--
			}
		case dir == 1 && typ == 'E' && ls.fenced:
			if e, err := wire.DecodeError(b[i+5 : end]); err == nil && e.Severity == wire.SeverityFatal {
				sess.serverSaid.Store(true)
			}
		}
		i = end
	}
	d.rest = i - w
}

// relayInLoop relays the session in the event loop while it can, and gives it back to
// the goroutine relay (its connections, readers and writers made anew) when the loop lets
// go of it, or when another goroutine needs it (recall). A failure leaves connections that
// fail at once, so that the goroutine relay ends the session.
func (sess *session) relayInLoop() {
	if sess.srv.cfg.Relay != "loop" || loopOff() != "" || sess.clientTLS || !plainSocket(sess.client) || !plainSocket(sess.server) {
		return
	}
	l, err := sharedLoop()
	if err != nil {
		sess.log.Warn("the event loop is not available: relaying with goroutines", zap.Error(err))
		return
	}
	if err := sess.flushBoth(); err != nil {
		return // the goroutine relay meets the same error
	}
	ls := &loopSession{sess: sess, loop: l, fenced: sess.mode == modeFenced, max: sess.srv.cfg.MaxMessageSize,
		back: make(chan struct{}), rebuilt: make(chan struct{})}
	sess.mu.Lock()
	ls.outstanding, ls.status = sess.outstanding, sess.status
	sess.mu.Unlock()
	sess.loop.Store(ls) // before the state says so: recall waits for ls then
	if !sess.loopState.CompareAndSwap(loopNever, loopTaken) {
		return // recalled already: an end is under way
	}
	defer close(ls.rebuilt)
	ls.fd = [2]int{-1, -1}
	for dir, c := range []net.Conn{sess.client, sess.server} {
		if ls.fd[dir], err = dupSocket(c.(syscall.Conn)); err != nil {
			break
		}
	}
	for dir, r := range []*wire.Reader{sess.cr, sess.sr} {
		if err == nil {
			ls.d[dir].in, err = r.TakeBuffered()
		}
	}
	if err != nil {
		// The goroutine relay has the session, with what the readers had buffered.
		sess.log.Warn("the event loop cannot take the session: relaying with goroutines", zap.Error(err))
		for _, fd := range ls.fd {
			if fd >= 0 {
				unix.Close(fd)
			}
		}
		sess.cr = wire.NewReader(prefixed(ls.d[0].in, sess.client), bufSize, ls.max)
		sess.sr = wire.NewReader(prefixed(ls.d[1].in, sess.server), bufSize, ls.max)
		return
	}
	oldClient, oldServer := sess.client, sess.server
	oldClient.Close()
	oldServer.Close()
	// Idle sessions hold no buffers: the goroutine relay makes new ones.
	sess.cr, sess.sr, sess.cw, sess.sw = nil, nil, nil, nil
	l.push(loopTask{ls: ls, add: true})
	<-ls.back
	if err := sess.rebuild(ls, oldClient, oldServer); err != nil {
		sess.log.Warn("could not take the session back from the event loop", zap.Error(err))
	}
}

func plainSocket(c net.Conn) bool {
	switch c.(type) {
	case *net.TCPConn, *net.UnixConn:
		return true
	}
	return false
}

// dupSocket returns a non-blocking duplicate of c's socket, close-on-exec.
func dupSocket(c syscall.Conn) (int, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return -1, err
	}
	fd := -1
	var derr error
	if err := rc.Control(func(s uintptr) { fd, derr = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		return -1, err
	}
	if derr != nil {
		return -1, derr
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

func prefixed(in []byte, c net.Conn) io.Reader {
	if len(in) == 0 {
		return c
	}
	return io.MultiReader(bytes.NewReader(in), c)
}

// rebuild gives the session back to the goroutine relay: connections made from the loop's
// sockets, readers that first read what the loop read and did not relay, and, for a
// message the loop relayed in part, the rest to relay first (resume).
func (sess *session) rebuild(ls *loopSession, oldClient, oldServer net.Conn) error {
	client, cerr := fileConn(ls.fd[0])
	server, serr := fileConn(ls.fd[1])
	if err := errors.Join(cerr, serr); err != nil {
		// Cannot happen short of running out of descriptors: the session ends.
		for _, c := range []net.Conn{client, server} {
			if c != nil {
				c.Close()
			}
		}
		sess.mu.Lock()
		sess.client, sess.server = oldClient, oldServer // closed: every use fails
		sess.mu.Unlock()
		sess.cr = wire.NewReader(bytes.NewReader(nil), 16, 0)
		sess.sr = wire.NewReader(bytes.NewReader(nil), 16, 0)
		sess.cw, sess.sw = newWriter(oldClient), newWriter(oldServer)
		return err
	}
	sess.mu.Lock() // serverConn's
	sess.client, sess.server = client, server
	sess.mu.Unlock()
	max := sess.srv.cfg.MaxMessageSize
	sess.cr = wire.NewReader(prefixed(ls.d[0].in, client), bufSize, max)
	sess.sr = wire.NewReader(prefixed(ls.d[1].in, server), bufSize, max)
	sess.cw, sess.sw = newWriter(client), newWriter(server)
	if rest := ls.d[0].rest; rest > 0 {
		sess.cr.Resume(rest)
	}
	if rest := ls.d[1].rest; rest > 0 {
		// The client has part of a message: nothing may be written to it before the
		// rest, which serverToClient relays first, holding cwMu from here (resume).
		sess.sr.Resume(rest)
		sess.cwMu.Lock()
		sess.resume = true
	}
	return nil
}

// fileConn makes a net.Conn of the loop's socket fd, and closes fd.
func fileConn(fd int) (net.Conn, error) {
	f := os.NewFile(uintptr(fd), "relay")
	defer f.Close()
	return net.FileConn(f)
}

// recall takes the session back from the event loop, if it has it, and returns when the
// goroutine relay has it: every path that ends a session or looks at its connections from
// another goroutine calls it first.
func (sess *session) recall() {
	if sess.loopState.CompareAndSwap(loopNever, loopRefused) || sess.loopState.Load() == loopRefused {
		return // never in the loop, and now it never will be
	}
	ls := sess.loop.Load()
	select {
	case <-ls.rebuilt:
		return
	default:
	}
	if !ls.recalled.Swap(true) {
		ls.loop.push(loopTask{ls: ls})
	}
	<-ls.rebuilt
}

// The session's loopState.
const (
	loopNever   = iota // not in the loop (yet)
	loopTaken          // relayInLoop took it: loop is set, and its rebuilt closes when relay has it back
	loopRefused        // recall ran first: the session never goes to the loop
)
