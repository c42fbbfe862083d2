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

	"github.com/fenceproxy/fenceproxy/internal/procgroup"
)

// BuildGo builds the main packages pkgs (import paths below the module, e.g.
// "./cmd/fenceproxy") into dir and returns the paths of the binaries, named after the last
// element of each package path. Go's build cache makes a second build cheap.
func BuildGo(tb testing.TB, dir string, pkgs ...string) []string {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	bins, err := BuildGoContext(ctx, dir, pkgs...)
	if err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	return bins
}

// BuildGoContext is BuildGo returning an error. It must run inside the module (any folder
// below go.mod).
func BuildGoContext(ctx context.Context, dir string, pkgs ...string) ([]string, error) {
	root, err := ModuleRoot()
	if err != nil {
		return nil, err
	}
	var bins []string
	for _, pkg := range pkgs {
		bin := filepath.Join(dir, filepath.Base(pkg))
		cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, pkg)
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			return nil, fmt.Errorf("go build %s: %w\n%s", pkg, err, out)
		}
		bins = append(bins, bin)
	}
	return bins, nil
}

// ModuleRoot is the folder holding go.mod, the working folder or above it: where a program
// run from the source tree finds the files beside its code (the demo's SQL).
func ModuleRoot() (string, error) {
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
	pid    int               // 0 while not running
	leader *procgroup.Leader // the current run
	exited chan struct{}     // closed when pid has been reaped
	status error             // Wait's result, once exited
}

// StartProcess starts argv as name, its stdout and stderr appended to dir/name.log.
// tb.Cleanup kills what is left of its group.
func StartProcess(tb testing.TB, dir, name string, argv, env []string) *Process {
	NeedServers(tb)
	tb.Helper()
	p, err := LaunchProcess(dir, name, argv, env)
	if err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	tb.Cleanup(p.Close)
	return p
}

// LaunchProcess is StartProcess for programs that are not tests: the caller must Close the
// process.
func LaunchProcess(dir, name string, argv, env []string) (*Process, error) {
	p := &Process{Name: name, Argv: argv, Env: env, LogFile: filepath.Join(dir, name+".log")}
	if err := p.Launch(); err != nil {
		return nil, err
	}
	return p, nil
}

// Close kills what is left of the process's group and waits (up to 10 s) for the process.
func (p *Process) Close() {
	p.kill()
	p.Wait(10 * time.Second)
}

// Start starts the process again (it must not be running).
func (p *Process) Start(tb testing.TB) {
	tb.Helper()
	if err := p.Launch(); err != nil {
		tb.Fatalf("testenv: %v", err)
	}
}

// Launch is Start returning an error.
func (p *Process) Launch() error {
	if err := p.start(); err != nil {
		return fmt.Errorf("start %s: %w", p.Name, err)
	}
	return nil
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
	leader := procgroup.Watch(cmd)
	exited := make(chan struct{})
	p.pid, p.leader, p.exited, p.status = cmd.Process.Pid, leader, exited, nil
	go func() {
		<-leader.Exited()
		// What the process started in its group may outlive it for a while (the workers of
		// a killed server). The group's id stays taken until they are gone (or killed by
		// Kill or Close), so that a signal to the group never reaches another program's.
		for leader.Live() {
			time.Sleep(50 * time.Millisecond)
		}
		err := leader.Reap()
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
	p.mu.Lock()
	leader := p.leader
	p.mu.Unlock()
	return leader.Signal(sig)
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
	p.mu.Lock()
	leader := p.leader
	p.mu.Unlock()
	if leader != nil {
		// The group may outlive its leader (the workers of a killed server); Signal
		// reaches it until the leader is reaped, which waits for the group to be empty.
		_ = leader.Signal(syscall.SIGCONT)
		_ = leader.Signal(syscall.SIGKILL)
	}
}

// Kill sends SIGKILL to the whole group and waits for the process to exit.
func (p *Process) Kill(tb testing.TB) {
	tb.Helper()
	if err := p.KillWait(30 * time.Second); err != nil {
		tb.Fatalf("testenv: %v", err)
	}
}

// KillWait is Kill returning an error when the process has not exited within timeout.
func (p *Process) KillWait(timeout time.Duration) error {
	p.kill()
	if !p.Wait(timeout) {
		return fmt.Errorf("%s (pid %d) did not exit within %v of SIGKILL", p.Name, p.Pid(), timeout)
	}
	return nil
}

// Stop sends SIGTERM (after SIGCONT, in case it is frozen) and waits up to grace, then
// kills the group.
func (p *Process) Stop(tb testing.TB, grace time.Duration) {
	tb.Helper()
	if err := p.Terminate(grace); err != nil {
		tb.Fatalf("testenv: %v", err)
	}
}

// Terminate is Stop returning an error.
func (p *Process) Terminate(grace time.Duration) error {
	_ = p.Signal(syscall.SIGCONT)
	_ = p.Signal(syscall.SIGTERM)
	if p.Wait(grace) {
		return nil
	}
	return p.KillWait(30 * time.Second)
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
	NeedServers(tb)
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), listenTimeout)
	defer cancel()
	p, err := LaunchProxyProcess(ctx, dir, name, bin, flags...)
	if err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	tb.Cleanup(p.Close)
	return p
}

// LaunchProxyProcess is StartProxyProcess for programs that are not tests: the caller must
// Close the process.
func LaunchProxyProcess(ctx context.Context, dir, name, bin string, flags ...string) (*ProxyProcess, error) {
	port, err := PickFreePort()
	if err != nil {
		return nil, err
	}
	argv := append([]string{bin, "serve", "--listen", "127.0.0.1:" + strconv.Itoa(port), "--log-format", "console"}, flags...)
	proc, err := LaunchProcess(dir, name, argv, nil)
	if err != nil {
		return nil, err
	}
	p := &ProxyProcess{Process: proc, Host: "127.0.0.1", Port: port}
	if err := p.WaitListeningContext(ctx); err != nil {
		p.Close()
		return nil, err
	}
	return p, nil
}

// listenTimeout bounds WaitListening.
const listenTimeout = 30 * time.Second

// Addr is host:port.
func (p *ProxyProcess) Addr() string { return p.Host + ":" + strconv.Itoa(p.Port) }

// WaitListening polls until the proxy accepts TCP connections (within 30 s).
func (p *ProxyProcess) WaitListening(tb testing.TB) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), listenTimeout)
	defer cancel()
	if err := p.WaitListeningContext(ctx); err != nil {
		tb.Fatalf("testenv: %v", err)
	}
}

// WaitListeningContext is WaitListening until ctx is done, returning an error.
func (p *ProxyProcess) WaitListeningContext(ctx context.Context) error {
	for {
		if c, err := dialTCP(p.Addr()); err == nil {
			c.Close()
			return nil
		}
		if !p.Running() {
			return fmt.Errorf("%s exited before listening; see %s", p.Name, p.LogFile)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s not listening on %s: %w; see %s", p.Name, p.Addr(), ctx.Err(), p.LogFile)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func dialTCP(addr string) (interface{ Close() error }, error) {
	return (&net.Dialer{Timeout: time.Second}).Dial("tcp", addr)
}
