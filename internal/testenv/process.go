package testenv

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// BuildGo builds the main packages pkgs (import paths below the module, e.g.
// "./cmd/fenceproxy") into dir and returns the paths of the binaries, named after the last
// element of each package path. Go's build cache makes a second build cheap.
func BuildGo(tb testing.TB, dir string, pkgs ...string) []string {
	tb.Helper()
	root, err := moduleRoot()
	if err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	var bins []string
	for _, pkg := range pkgs {
		bin := filepath.Join(dir, filepath.Base(pkg))
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, pkg)
		cmd.Dir = root
		out, err := cmd.CombinedOutput()
		cancel()
		if err != nil {
			tb.Fatalf("testenv: go build %s: %v\n%s", pkg, err, out)
		}
		bins = append(bins, bin)
	}
	return bins
}

// moduleRoot is the folder holding go.mod, above the working folder.
func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("go.mod not found above the working folder")
		}
		dir = parent
	}
}

// Process is a program started in its own process group (so that a signal reaches it and
// everything it started, and a terminal's ^C reaches only the test), with its output in
// LogFile. It can be stopped, killed, frozen and started again with the same command.
// tb.Cleanup kills what is left of its group.
type Process struct {
	Name    string
	Argv    []string
	Env     []string // nil: the test's environment
	LogFile string

	mu     sync.Mutex
	pid    int           // 0 while not running
	exited chan struct{} // closed when pid has been reaped
	status error         // Wait's result, once exited
}

// StartProcess starts argv as name, its stdout and stderr appended to dir/name.log.
func StartProcess(tb testing.TB, dir, name string, argv, env []string) *Process {
	tb.Helper()
	p := &Process{Name: name, Argv: argv, Env: env, LogFile: filepath.Join(dir, name+".log")}
	tb.Cleanup(func() { p.kill(); p.Wait(10 * time.Second) })
	p.Start(tb)
	return p
}

// Start starts the process again (it must not be running).
func (p *Process) Start(tb testing.TB) {
	tb.Helper()
	if err := p.start(); err != nil {
		tb.Fatalf("testenv: start %s: %v", p.Name, err)
	}
}

func (p *Process) start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pid != 0 {
		select {
		case <-p.exited:
		default:
			return errors.New("already running")
		}
	}
	logf, err := os.OpenFile(p.LogFile, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	fmt.Fprintf(logf, "--- testenv: start %s: %s\n", time.Now().UTC().Format(time.RFC3339Nano), strings.Join(p.Argv, " "))
	cmd := exec.Command(p.Argv[0], p.Argv[1:]...)
	cmd.Env = p.Env
	cmd.Stdout, cmd.Stderr = logf, logf
	// Pdeathsig: a process never outlives a test process killed before its cleanup.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return err
	}
	exited := make(chan struct{})
	p.pid, p.exited, p.status = cmd.Process.Pid, exited, nil
	go func() {
		err := cmd.Wait()
		p.mu.Lock()
		p.status = err
		p.mu.Unlock()
		close(exited)
	}()
	return nil
}

// Pid is the process's pid (also its process group's id), 0 if it never started.
func (p *Process) Pid() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.pid
}

// Running reports whether the process has not exited.
func (p *Process) Running() bool {
	p.mu.Lock()
	exited := p.exited
	p.mu.Unlock()
	if exited == nil {
		return false
	}
	select {
	case <-exited:
		return false
	default:
		return true
	}
}

// Exited is closed when the current run of the process has exited.
func (p *Process) Exited() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.exited
}

// Status is the current run's Wait result once it exited (nil for status 0).
func (p *Process) Status() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.status
}

// Signal sends sig to the process's whole group.
func (p *Process) Signal(sig syscall.Signal) error {
	if !p.Running() {
		return os.ErrProcessDone
	}
	err := syscall.Kill(-p.Pid(), sig)
	if errors.Is(err, syscall.ESRCH) {
		return os.ErrProcessDone
	}
	return err
}

// Wait waits up to timeout for the process to exit and reports whether it did.
func (p *Process) Wait(timeout time.Duration) bool {
	exited := p.Exited()
	if exited == nil {
		return true
	}
	select {
	case <-exited:
		return true
	case <-time.After(timeout):
		return false
	}
}

func (p *Process) kill() {
	pid := p.Pid()
	if pid != 0 {
		// The group may outlive its leader (children of a killed supervisor).
		_ = syscall.Kill(-pid, syscall.SIGCONT)
		_ = syscall.Kill(-pid, syscall.SIGKILL)
	}
}

// Kill sends SIGKILL to the whole group and waits for the process to exit.
func (p *Process) Kill(tb testing.TB) {
	tb.Helper()
	p.kill()
	if !p.Wait(30 * time.Second) {
		tb.Fatalf("testenv: %s (pid %d) did not exit within 30 s of SIGKILL", p.Name, p.Pid())
	}
}

// Stop sends SIGTERM (after SIGCONT, in case it is frozen) and waits up to grace, then
// kills the group.
func (p *Process) Stop(tb testing.TB, grace time.Duration) {
	tb.Helper()
	_ = p.Signal(syscall.SIGCONT)
	_ = p.Signal(syscall.SIGTERM)
	if !p.Wait(grace) {
		p.Kill(tb)
	}
}

// ProxyProcess is a `fenceproxy serve` process listening on a fixed loopback port, so that
// it can be killed and started again at the same address.
type ProxyProcess struct {
	*Process
	Host string
	Port int
}

// StartProxyProcess runs bin (a fenceproxy binary) as `serve` on a free loopback port with
// the given flags (--upstream, --resource, --key-file, ...), and waits until it accepts
// connections.
func StartProxyProcess(tb testing.TB, dir, name, bin string, flags ...string) *ProxyProcess {
	tb.Helper()
	port := FreePort(tb)
	argv := append([]string{bin, "serve", "--listen", "127.0.0.1:" + strconv.Itoa(port), "--log-format", "console"}, flags...)
	p := &ProxyProcess{Process: StartProcess(tb, dir, name, argv, nil), Host: "127.0.0.1", Port: port}
	p.WaitListening(tb)
	return p
}

// Addr is host:port.
func (p *ProxyProcess) Addr() string { return p.Host + ":" + strconv.Itoa(p.Port) }

// WaitListening polls until the proxy accepts TCP connections (within 30 s).
func (p *ProxyProcess) WaitListening(tb testing.TB) {
	tb.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if c, err := dialTCP(p.Addr()); err == nil {
			c.Close()
			return
		}
		if !p.Running() {
			tb.Fatalf("testenv: %s exited before listening; see %s", p.Name, p.LogFile)
		}
		if time.Now().After(deadline) {
			tb.Fatalf("testenv: %s not listening on %s after 30 s; see %s", p.Name, p.Addr(), p.LogFile)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func dialTCP(addr string) (interface{ Close() error }, error) {
	return (&net.Dialer{Timeout: time.Second}).Dial("tcp", addr)
}
