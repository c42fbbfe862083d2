package testenv

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
)

// ConsulVersion is the Consul release the tests run against: the last MPL-2.0 one we
// can build (see scripts/build-consul.sh).
const ConsulVersion = "1.16.3"

const (
	consulStartTimeout = 60 * time.Second
	consulStopTimeout  = 15 * time.Second
)

// Consul is a real single-server Consul agent on private loopback ports, with its state
// in a temporary folder. Stop and Start keep the ports and the data, so a restarted agent
// has the same keys, sessions and indexes: what an outage of a real cluster looks like.
// The exported fields are read-only for callers.
type Consul struct {
	Addr    string // HTTP address, 127.0.0.1:port
	DataDir string
	LogFile string
	Bin     string
	// ManagementToken is the ACL bootstrap token of an agent started with ACLs on
	// (StartConsulACL; "": ACLs off). Client and NewClient use it.
	ManagementToken string

	ports consulPorts
	base  string

	mu     sync.Mutex
	proc   *os.Process
	exited chan struct{}
	paused bool
}

type consulPorts struct{ http, serfLAN, serfWAN, server int }

// ConsulBinary returns the Consul 1.16.3 agent the tests use: $FENCEPROXY_CONSUL_BIN when
// set, else the binary scripts/build-consul.sh caches. A missing binary is a fatal error,
// never a skip: a suite that silently skips its Consul tests proves nothing.
func ConsulBinary(tb testing.TB) string {
	tb.Helper()
	bin, err := FindConsulBinary()
	if err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	return bin
}

// FindConsulBinary is ConsulBinary returning an error.
func FindConsulBinary() (string, error) {
	if bin := os.Getenv("FENCEPROXY_CONSUL_BIN"); bin != "" {
		if _, err := os.Stat(bin); err != nil {
			return "", fmt.Errorf("$FENCEPROXY_CONSUL_BIN: %w: run scripts/build-consul.sh (make deps)", err)
		}
		return bin, nil
	}
	bin, err := consulCachePath()
	if err != nil {
		return "", fmt.Errorf("locate the Consul binary: %w: run scripts/build-consul.sh (make deps)", err)
	}
	if _, err := os.Stat(bin); err != nil {
		return "", fmt.Errorf("no Consul %s agent (%w): run scripts/build-consul.sh (make deps), "+
			"or set $FENCEPROXY_CONSUL_BIN", ConsulVersion, err)
	}
	return bin, nil
}

// consulCachePath mirrors scripts/build-consul.sh:
// ${FENCEPROXY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fenceproxy}/consul-VERSION/consul.
func consulCachePath() (string, error) {
	root := os.Getenv("FENCEPROXY_CACHE")
	if root == "" {
		cache := os.Getenv("XDG_CACHE_HOME")
		if cache == "" {
			home, err := os.UserHomeDir()
			if err != nil {
				return "", err
			}
			cache = filepath.Join(home, ".cache")
		}
		root = filepath.Join(cache, "fenceproxy")
	}
	return filepath.Join(root, "consul-"+ConsulVersion, "consul"), nil
}

// StartConsul starts a single-server agent (not -dev: its state must survive Stop and
// Start) on private ports, waits until it has elected itself leader and serves consistent
// reads, and registers tb.Cleanup to stop it. DNS and gRPC are off.
//
// The agent allows session TTLs down to 1 s (session_ttl_min; Consul's default minimum is
// 10 s) so that tests of TTL expiry can be short; tests that measure production timings
// use 10 s like everyone else.
func StartConsul(tb testing.TB) *Consul {
	NeedServers(tb)
	tb.Helper()
	return startConsul(tb, false)
}

// StartConsulACL is StartConsul with ACLs on, as production clusters run: default policy
// deny, and a bootstrap (initial management) token in ManagementToken. Anonymous requests
// and tokens without a policy get 403.
func StartConsulACL(tb testing.TB) *Consul {
	NeedServers(tb)
	tb.Helper()
	return startConsul(tb, true)
}

func startConsul(tb testing.TB, acl bool) *Consul {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), consulStartTimeout)
	defer cancel()
	c, err := launchConsul(ctx, acl)
	if err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	tb.Cleanup(func() {
		err := c.Shutdown()
		if tb.Failed() {
			tb.Logf("testenv: Consul log (%s):\n%s", c.LogFile, consulLogTail(c.LogFile, 0))
		}
		if err := errors.Join(err, c.Close()); err != nil {
			tb.Errorf("testenv: %v", err)
		}
	})
	tb.Logf("testenv: Consul %s on %s, folder %s", ConsulVersion, c.Addr, c.base)
	return c
}

// LaunchConsul is StartConsul for programs that are not tests: it returns an error instead
// of failing a test, and the caller must Close the agent.
func LaunchConsul(ctx context.Context) (*Consul, error) {
	return launchConsul(ctx, false)
}

func launchConsul(ctx context.Context, acl bool) (*Consul, error) {
	bin, err := FindConsulBinary()
	if err != nil {
		return nil, err
	}
	c := &Consul{Bin: bin}
	if acl {
		if c.ManagementToken, err = randomUUID(); err != nil {
			return nil, err
		}
	}
	base, err := os.MkdirTemp("", "fenceproxy-consul-")
	if err != nil {
		return nil, err
	}
	c.base = base
	c.DataDir = filepath.Join(base, "data")
	c.LogFile = filepath.Join(base, "consul.log")
	for attempt := 1; ; attempt++ {
		if err := c.pickPorts(); err != nil {
			_ = c.Close()
			return nil, err
		}
		err = c.start(ctx)
		if err == nil {
			return c, nil
		}
		if !errors.Is(err, errPortInUse) || attempt == portAttempts {
			_ = c.Close()
			return nil, fmt.Errorf("start Consul: %w", err)
		}
		// A half-started agent may have written a node ID bound to the old ports.
		_ = os.RemoveAll(c.DataDir)
	}
}

// pickPorts picks four distinct free ports: PickFreePort draws each at random and closes it
// again, so two draws can return the same port (the agent then refuses to start: "Serf
// Advertise WAN address ... already configured for Serf Advertise LAN").
func (c *Consul) pickPorts() error {
	var ports [4]int
	for i := range ports {
		for {
			port, err := PickFreePort()
			if err != nil {
				return err
			}
			if !slices.Contains(ports[:i], port) {
				ports[i] = port
				break
			}
		}
	}
	c.ports = consulPorts{http: ports[0], serfLAN: ports[1], serfWAN: ports[2], server: ports[3]}
	c.Addr = "127.0.0.1:" + strconv.Itoa(c.ports.http)
	return nil
}

func (c *Consul) args() []string {
	var acl []string
	if c.ManagementToken != "" {
		acl = []string{"-hcl", fmt.Sprintf(`acl { enabled = true
			default_policy = "deny"
			enable_token_persistence = true
			tokens { initial_management = %q } }`, c.ManagementToken)}
	}
	return append([]string{
		"agent",
		"-server", "-bootstrap-expect=1",
		"-node=fenceproxy-test",
		"-data-dir=" + c.DataDir,
		"-bind=127.0.0.1", "-advertise=127.0.0.1", "-client=127.0.0.1",
		"-http-port=" + strconv.Itoa(c.ports.http),
		"-serf-lan-port=" + strconv.Itoa(c.ports.serfLAN),
		"-serf-wan-port=" + strconv.Itoa(c.ports.serfWAN),
		"-server-port=" + strconv.Itoa(c.ports.server),
		"-dns-port=-1", "-grpc-port=-1", "-grpc-tls-port=-1",
		"-log-level=warn",
		"-disable-host-node-id",
		// raft_multiplier 1 is the fastest timing Consul accepts (production default 5):
		// leader election after a restart takes about a second instead of five.
		"-hcl", `performance { raft_multiplier = 1 }`,
		"-hcl", `session_ttl_min = "1s"`,
		"-hcl", `disable_update_check = true`,
	}, acl...)
}

// randomUUID is a random (version 4) UUID, the form Consul wants for ACL tokens.
func randomUUID() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:]), nil
}

// start launches the agent and waits until it serves consistent reads.
func (c *Consul) start(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.reapLocked()
	if c.proc != nil {
		return errors.New("already running")
	}
	logf, err := os.OpenFile(c.LogFile, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close() // the child keeps its own descriptor
	logStart, err := logf.Seek(0, io.SeekEnd)
	if err != nil {
		return err
	}
	cmd := exec.Command(c.Bin, c.args()...)
	// A clean environment: CONSUL_* variables of the caller must not reach the agent.
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}
	cmd.Stdout, cmd.Stderr = logf, logf
	// Own process group so a ^C in the terminal reaches the test, not the agent; Pdeathsig
	// so that an agent never outlives a test process killed before its cleanup.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("consul: %w", err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait() // the log says why
		close(exited)
	}()
	c.proc, c.exited, c.paused = cmd.Process, exited, false

	if err := c.waitReady(ctx, exited); err != nil {
		_ = c.signalLocked(syscall.SIGKILL)
		tail := consulLogTail(c.LogFile, logStart)
		if strings.Contains(tail, "address already in use") {
			return fmt.Errorf("%w: %s", errPortInUse, tail)
		}
		return fmt.Errorf("%w; agent log:\n%s", err, tail)
	}
	return nil
}

// waitReady polls until the agent knows a leader and a consistent KV read succeeds: a
// leader is elected some time before it has established its barrier and serves reads.
func (c *Consul) waitReady(ctx context.Context, exited <-chan struct{}) error {
	client, err := api.NewClient(&api.Config{Address: c.Addr, Scheme: "http", Token: c.ManagementToken})
	if err != nil {
		return err
	}
	for {
		var last error
		leader, err := client.Status().Leader()
		switch {
		case err != nil:
			last = err
		case leader == "":
			last = errors.New("no leader yet")
		default:
			q := (&api.QueryOptions{RequireConsistent: true}).WithContext(ctx)
			if _, _, err := client.KV().Get("fenceproxy-testenv/ready", q); err != nil {
				last = err
			} else {
				return nil
			}
		}
		select {
		case <-exited:
			return errors.New("consul exited during startup")
		case <-ctx.Done():
			return fmt.Errorf("not ready after %v: %w", consulStartTimeout, last)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Start starts a stopped agent again with the same ports and data, and waits until it
// serves consistent reads.
func (c *Consul) Start(tb testing.TB) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), consulStartTimeout)
	defer cancel()
	if err := c.StartContext(ctx); err != nil {
		tb.Fatalf("testenv: %v", err)
	}
}

// StartContext is Start returning an error.
func (c *Consul) StartContext(ctx context.Context) error {
	if err := c.start(ctx); err != nil {
		return fmt.Errorf("start Consul on %s: %w", c.Addr, err)
	}
	return nil
}

// Stop shuts the agent down (SIGTERM: a server does not leave the cluster, so its state
// is intact for Start). Stopping a stopped agent does nothing.
func (c *Consul) Stop(tb testing.TB) {
	tb.Helper()
	if err := c.Shutdown(); err != nil {
		tb.Fatalf("testenv: %v", err)
	}
}

// Shutdown is Stop returning an error.
func (c *Consul) Shutdown() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.signalLocked(syscall.SIGTERM); err != nil {
		return fmt.Errorf("stop Consul: %w", err)
	}
	return nil
}

// Pause freezes the agent (SIGSTOP): its sockets stay open but nothing answers, the way a
// hung or partitioned server looks to clients. Resume undoes it.
func (c *Consul) Pause(tb testing.TB) {
	tb.Helper()
	if err := c.Freeze(); err != nil {
		tb.Fatalf("testenv: %v", err)
	}
}

// Freeze is Pause returning an error.
func (c *Consul) Freeze() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.proc == nil {
		return errors.New("pause Consul: not running")
	}
	if err := syscall.Kill(c.proc.Pid, syscall.SIGSTOP); err != nil {
		return fmt.Errorf("pause Consul: %w", err)
	}
	c.paused = true
	// SIGSTOP is delivered asynchronously: wait until every thread of the
	// agent is stopped, or a request sent right after Pause may still be
	// answered.
	deadline := time.Now().Add(5 * time.Second)
	for !allStopped(c.proc.Pid) {
		if time.Now().After(deadline) {
			return fmt.Errorf("pause Consul: process %d not stopped after 5 s", c.proc.Pid)
		}
		time.Sleep(time.Millisecond)
	}
	return nil
}

// allStopped reports whether every thread of pid is in state T (stopped).
func allStopped(pid int) bool {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil || len(tasks) == 0 {
		return false
	}
	for _, task := range tasks {
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", pid, task.Name()))
		if err != nil {
			return false
		}
		// The state follows the command name in parentheses, which may hold spaces.
		i := bytes.LastIndexByte(stat, ')')
		if i < 0 || i+2 >= len(stat) || stat[i+2] != 'T' {
			return false
		}
	}
	return true
}

// Resume continues an agent that Pause froze.
func (c *Consul) Resume(tb testing.TB) {
	tb.Helper()
	if err := c.Thaw(); err != nil {
		tb.Fatalf("testenv: %v", err)
	}
}

// Thaw is Resume returning an error.
func (c *Consul) Thaw() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.proc == nil {
		return errors.New("resume Consul: not running")
	}
	if err := syscall.Kill(c.proc.Pid, syscall.SIGCONT); err != nil {
		return fmt.Errorf("resume Consul: %w", err)
	}
	c.paused = false
	return nil
}

// Client returns a client for the agent's HTTP API. It ignores the CONSUL_* environment
// variables of the test process.
func (c *Consul) Client(tb testing.TB) *api.Client {
	tb.Helper()
	client, err := c.NewClient()
	if err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	return client
}

// NewClient is Client returning an error.
func (c *Consul) NewClient() (*api.Client, error) {
	client, err := api.NewClient(&api.Config{Address: c.Addr, Scheme: "http", Token: c.ManagementToken})
	if err != nil {
		return nil, fmt.Errorf("consul client: %w", err)
	}
	return client, nil
}

// signalLocked sends sig and waits for the agent to exit, escalating to SIGKILL.
func (c *Consul) signalLocked(sig syscall.Signal) error {
	if c.proc == nil {
		return nil
	}
	proc, exited := c.proc, c.exited
	if c.paused {
		// A stopped process only acts on SIGKILL; let it see sig too.
		_ = syscall.Kill(proc.Pid, syscall.SIGCONT)
	}
	var slow error
	for _, s := range []syscall.Signal{sig, syscall.SIGKILL} {
		if err := proc.Signal(s); err != nil && !errors.Is(err, os.ErrProcessDone) {
			return fmt.Errorf("signal %v: %w", s, err)
		}
		select {
		case <-exited:
			c.proc, c.exited, c.paused = nil, nil, false
			return slow
		case <-time.After(consulStopTimeout):
			slow = fmt.Errorf("consul did not exit within %v of %v", consulStopTimeout, sig)
		}
	}
	return slow
}

// Close stops the agent and removes its folder. StartConsul's cleanup calls it; callers of
// LaunchConsul call it themselves.
func (c *Consul) Close() error {
	err := c.Shutdown()
	if rmErr := os.RemoveAll(c.base); rmErr != nil {
		err = errors.Join(err, rmErr)
	}
	return err
}

// LogTail is the end of the agent's log, for an error report.
func (c *Consul) LogTail() string { return consulLogTail(c.LogFile, 0) }

// consulLogTail returns the last lines of the file written after offset from.
func consulLogTail(path string, from int64) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return "(no log: " + err.Error() + ")"
	}
	if from > 0 && from <= int64(len(b)) {
		b = b[from:]
	}
	const max = 4000
	if len(b) > max {
		b = b[len(b)-max:]
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			b = b[i+1:]
		}
	}
	return string(b)
}

// Running reports whether the agent is started (between Start and Stop) and has not exited
// on its own.
func (c *Consul) Running() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.reapLocked()
	return c.proc != nil
}

// reapLocked forgets an agent that exited without Stop, so that Start can start it again.
func (c *Consul) reapLocked() {
	if c.proc == nil {
		return
	}
	select {
	case <-c.exited:
		c.proc, c.exited, c.paused = nil, nil, false
	default:
	}
}
