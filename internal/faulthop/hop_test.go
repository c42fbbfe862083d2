package faulthop_test

import (
	"bufio"
	"context"
	"io"
	"net"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/faulthop"
)

// echo is a server that echoes each line.
func echo(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { defer c.Close(); _, _ = io.Copy(c, c) }()
		}
	}()
	return ln.Addr().String()
}

func start(t *testing.T) *faulthop.Hop {
	t.Helper()
	h, err := faulthop.Start("", echo(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := h.Close(ctx); err != nil {
			t.Error(err)
		}
	})
	return h
}

// roundTrip sends a line and reads it back, returning the time it took.
func roundTrip(t *testing.T, c net.Conn, r *bufio.Reader) (time.Duration, error) {
	t.Helper()
	begin := time.Now()
	if _, err := c.Write([]byte("ping\n")); err != nil {
		return 0, err
	}
	line, err := r.ReadString('\n')
	if err == nil && line != "ping\n" {
		t.Fatalf("echo: got %q", line)
	}
	return time.Since(begin), err
}

func dial(t *testing.T, h *faulthop.Hop) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := net.Dial("tcp", h.Addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	return c, bufio.NewReader(c)
}

func TestFaults(t *testing.T) {
	h := start(t)
	c, r := dial(t, h)
	if _, err := roundTrip(t, c, r); err != nil {
		t.Fatalf("no fault: %v", err)
	}

	h.SetDelay(100 * time.Millisecond)
	if d, err := roundTrip(t, c, r); err != nil || d < 200*time.Millisecond {
		t.Errorf("delay 100 ms each way: round trip %v, %v; want >= 200 ms", d, err)
	}
	h.Heal()

	h.Stall(300 * time.Millisecond)
	if d, err := roundTrip(t, c, r); err != nil || d < 250*time.Millisecond {
		t.Errorf("stall 300 ms: round trip %v, %v; want >= 250 ms", d, err)
	}

	h.Stall(time.Hour)
	go func() { time.Sleep(100 * time.Millisecond); h.Heal() }()
	if d, err := roundTrip(t, c, r); err != nil || d > 5*time.Second {
		t.Errorf("stall healed after 100 ms: round trip %v, %v", d, err)
	}

	h.Cut()
	if _, err := roundTrip(t, c, r); err == nil {
		t.Errorf("after Cut: the old connection still works")
	}
	c2, r2 := dial(t, h)
	if _, err := roundTrip(t, c2, r2); err != nil {
		t.Errorf("a new connection after Cut: %v", err)
	}

	h.SetLoss(1)
	if _, err := roundTrip(t, c2, r2); err == nil {
		t.Errorf("loss 1: the connection survived")
	}
	h.Heal()
	deadline := time.Now().Add(5 * time.Second)
	for h.Open() != 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := h.Open(); n != 0 {
		t.Errorf("%d connections still relayed after they all ended", n)
	}
}

func TestTargetDown(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	target := ln.Addr().String()
	ln.Close()
	h, err := faulthop.Start("", target)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close(context.Background())
	c, err := net.Dial("tcp", h.Addr)
	if err != nil {
		return // refused or reset at once: closed, as wanted
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := roundTrip(t, c, bufio.NewReader(c)); err == nil {
		t.Fatal("a target that is down: the client's connection was not closed")
	}
}

// TestHalfClose: a server that answers and shuts down its side stays readable, and the
// client's next write still reaches it (fenceproxy lingers so for a stale session).
func TestHalfClose(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	got := make(chan string, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = c.Write([]byte("bye\n"))
		_ = c.(*net.TCPConn).CloseWrite()
		line, _ := bufio.NewReader(c).ReadString('\n')
		got <- line
	}()
	h, err := faulthop.Start("", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close(context.Background())
	c, r := dial(t, h)
	if line, err := r.ReadString('\n'); err != nil || line != "bye\n" {
		t.Fatalf("read: %q, %v", line, err)
	}
	if _, err := r.ReadByte(); err != io.EOF {
		t.Fatalf("after the server's FIN: %v, want EOF", err)
	}
	time.Sleep(50 * time.Millisecond) // a hop that closed both sides would reset the write below
	if _, err := c.Write([]byte("commit\n")); err != nil {
		t.Fatalf("write after the server's FIN: %v", err)
	}
	select {
	case line := <-got:
		if line != "commit\n" {
			t.Fatalf("server read %q", line)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the server did not get the client's write")
	}
}
