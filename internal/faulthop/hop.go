package faulthop

import (
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"time"
)

// Hop relays connections from Addr to a target, with faults.
type Hop struct {
	// Addr is where clients connect (127.0.0.1:port).
	Addr   string
	target string
	ln     net.Listener

	mu      sync.Mutex
	conns   map[*pair]struct{}
	delay   time.Duration // added before each chunk is written
	stalled time.Time     // nothing is written before this instant
	loss    float64       // probability that a chunk resets its connection
	closed  bool
	wg      sync.WaitGroup
}

type pair struct{ client, server net.Conn }

// chunk is the largest read relayed at once: a delay applies per chunk.
const chunk = 32 << 10

// Start listens on a free loopback port (addr "" or "127.0.0.1:0") or on addr, and relays
// each connection to target.
func Start(addr, target string) (*Hop, error) {
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	h := &Hop{Addr: ln.Addr().String(), target: target, ln: ln, conns: map[*pair]struct{}{}}
	h.wg.Add(1)
	go h.accept()
	return h, nil
}

// Port is the port of Addr.
func (h *Hop) Port() int { return h.ln.Addr().(*net.TCPAddr).Port }

func (h *Hop) accept() {
	defer h.wg.Done()
	for {
		c, err := h.ln.Accept()
		if err != nil {
			return
		}
		h.wg.Add(1)
		go h.serve(c)
	}
}

func (h *Hop) serve(client net.Conn) {
	defer h.wg.Done()
	d := net.Dialer{Timeout: 5 * time.Second}
	h.mu.Lock()
	target := h.target
	h.mu.Unlock()
	server, err := d.Dial("tcp", target)
	if err != nil {
		reset(client)
		return
	}
	p := &pair{client, server}
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		reset(client)
		reset(server)
		return
	}
	h.conns[p] = struct{}{}
	h.mu.Unlock()
	// A direction that ends with the peer's FIN is half-closed onward (CloseWrite), as a
	// network passes a FIN: a server that sends its last message and shuts its side down
	// (fenceproxy does so for a stale session, lingering for the client's next message)
	// must still be readable, and the other direction keeps flowing. A direction that ends
	// with an error, or a fault, ends both.
	done := make(chan error, 2)
	go func() { done <- h.clientToServer(p) }()
	go func() { done <- h.serverToClient(p) }()
	for range 2 {
		if err := <-done; err != nil {
			client.Close()
			server.Close()
		}
	}
	client.Close()
	server.Close()
	h.mu.Lock()
	delete(h.conns, p)
	h.mu.Unlock()
}

// Two named methods so that a stack trace says which direction is stuck.
func (h *Hop) clientToServer(p *pair) error { return h.copy(p, p.server, p.client) }
func (h *Hop) serverToClient(p *pair) error { return h.copy(p, p.client, p.server) }

var errLoss = errors.New("faulthop: connection dropped")

// copy relays src to dst until src's EOF (nil: dst is half-closed) or an error.
func (h *Hop) copy(p *pair, dst, src net.Conn) error {
	buf := make([]byte, chunk)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if !h.pass() {
				reset(p.client)
				reset(p.server)
				return errLoss
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return werr
			}
		}
		if errors.Is(err, io.EOF) {
			if tc, ok := dst.(*net.TCPConn); ok {
				if cerr := tc.CloseWrite(); cerr != nil {
					return cerr
				}
			}
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// pass waits for the stall and the delay in force, and reports whether the chunk goes
// through (false: loss struck, the connection is reset).
func (h *Hop) pass() bool {
	for {
		h.mu.Lock()
		until, delay, loss, closed := h.stalled, h.delay, h.loss, h.closed
		h.mu.Unlock()
		if closed {
			return false
		}
		if wait := time.Until(until); wait > 0 {
			// In steps, so that Heal ends a stall at once.
			time.Sleep(min(wait, 10*time.Millisecond))
			continue
		}
		if loss > 0 && rand.Float64() < loss {
			return false
		}
		if delay > 0 {
			time.Sleep(delay)
		}
		return true
	}
}

// SetDelay adds d before every chunk in both directions (0: none).
func (h *Hop) SetDelay(d time.Duration) {
	h.mu.Lock()
	h.delay = d
	h.mu.Unlock()
}

// Stall holds every byte in both directions for d from now; connections stay open and new
// ones are accepted (and held too).
func (h *Hop) Stall(d time.Duration) {
	h.mu.Lock()
	h.stalled = time.Now().Add(d)
	h.mu.Unlock()
}

// SetLoss makes each chunk reset its connection with probability p (0: none).
func (h *Hop) SetLoss(p float64) {
	h.mu.Lock()
	h.loss = p
	h.mu.Unlock()
}

// Cut resets every open connection now. New connections are relayed as before.
func (h *Hop) Cut() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for p := range h.conns {
		reset(p.client)
		reset(p.server)
	}
}

// Retarget relays new connections to target from now on (a virtual IP or a DNS name moving
// to another server, as at a failover); open connections keep their server: Cut them.
func (h *Hop) Retarget(target string) {
	h.mu.Lock()
	h.target = target
	h.mu.Unlock()
}

// Heal removes every fault: no delay, no stall, no loss.
func (h *Hop) Heal() {
	h.mu.Lock()
	h.delay, h.stalled, h.loss = 0, time.Time{}, 0
	h.mu.Unlock()
}

// Open is the number of connections being relayed.
func (h *Hop) Open() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.conns)
}

// Close stops listening, resets every connection and waits until the relays have ended.
func (h *Hop) Close(ctx context.Context) error {
	h.mu.Lock()
	h.closed = true
	h.mu.Unlock()
	err := h.ln.Close()
	h.Cut()
	done := make(chan struct{})
	go func() { h.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
		return errors.Join(err, ctx.Err())
	}
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}

// reset closes c with an RST (SO_LINGER 0), as a lost connection looks to its peer.
func reset(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = c.Close()
}
