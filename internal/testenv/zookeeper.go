package testenv

import (
	"bufio"
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

	"github.com/go-zookeeper/zk"
)

const (
	zkStartTimeout = 90 * time.Second // a JVM on a loaded 2-core machine
	zkStopTimeout  = 15 * time.Second

	// ZooKeeperTick is the test server's tickTime: sessions are expired within a tick of
	// their timeout. Session timeouts from 1 s to 60 s are allowed (ZooKeeper's default
	// bounds are 2 and 20 ticks).
	ZooKeeperTick = 200 * time.Millisecond
)

// zkClasspath is Debian's ZooKeeper (the zookeeper package, through libzookeeper-java):
// the server jar (whose manifest names its dependencies) and slf4j's simple logger, which
// writes the server's log to its stderr.
func zkClasspath() []string {
	return []string{"/usr/share/java/zookeeper.jar", "/usr/share/java/slf4j-simple.jar"}
}

// ZooKeeper is a real standalone ZooKeeper server (Debian's package, run as a plain JVM
// process from its jars, not the system service) on a private loopback port, with its data
// in a temporary folder. Stop and Start keep the port and the data, so a restarted server
// has the same znodes, sessions and zxids, and later zxids are higher; Backup and Restore put an earlier data folder back, and Wipe
// empties it, which moves zxids back as a restore from an old snapshot does. The exported
// fields are read-only for callers.
type ZooKeeper struct {
	Addr    string // client address, 127.0.0.1:port
	DataDir string
	LogFile string

	base string
	port int

	mu     sync.Mutex
	proc   *os.Process
	exited chan struct{}
}

// StartZooKeeper starts a standalone server on a private port, waits until it serves
// requests, and registers tb.Cleanup to stop it and remove its folder.
func StartZooKeeper(tb testing.TB) *ZooKeeper {
	NeedServers(tb)
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), zkStartTimeout)
	defer cancel()
	z, err := LaunchZooKeeper(ctx)
	if err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	tb.Cleanup(func() {
		if tb.Failed() {
			tb.Logf("testenv: ZooKeeper log (%s):\n%s", z.LogFile, consulLogTail(z.LogFile, 0))
		}
		if err := z.Close(); err != nil {
			tb.Errorf("testenv: %v", err)
		}
	})
	tb.Logf("testenv: ZooKeeper on %s, folder %s", z.Addr, z.base)
	return z
}

// LaunchZooKeeper is StartZooKeeper for programs that are not tests: the caller must Close
// the server.
func LaunchZooKeeper(ctx context.Context) (*ZooKeeper, error) {
	for _, jar := range zkClasspath() {
		if _, err := os.Stat(jar); err != nil {
			return nil, fmt.Errorf("no ZooKeeper (%w): install Debian's zookeeper package (make deps)", err)
		}
	}
	if _, err := exec.LookPath("java"); err != nil {
		return nil, fmt.Errorf("no java for ZooKeeper (%w): make deps", err)
	}
	base, err := os.MkdirTemp("", "fenceproxy-zookeeper-")
	if err != nil {
		return nil, err
	}
	z := &ZooKeeper{base: base, DataDir: filepath.Join(base, "data"), LogFile: filepath.Join(base, "zookeeper.log")}
	for attempt := 1; ; attempt++ {
		if z.port, err = PickFreePort(); err != nil {
			_ = z.Close()
			return nil, err
		}
		z.Addr = "127.0.0.1:" + strconv.Itoa(z.port)
		err = z.start(ctx)
		if err == nil {
			return z, nil
		}
		if !errors.Is(err, errPortInUse) || attempt == portAttempts {
			_ = z.Close()
			return nil, fmt.Errorf("start ZooKeeper: %w", err)
		}
	}
}

// config writes zoo.cfg: standalone, no admin server, the four-letter words the readiness
// check uses.
func (z *ZooKeeper) config() (string, error) {
	if err := os.MkdirAll(z.DataDir, 0o755); err != nil {
		return "", err
	}
	cfg := fmt.Sprintf(`tickTime=%d
dataDir=%s
clientPort=%d
clientPortAddress=127.0.0.1
minSessionTimeout=1000
maxSessionTimeout=60000
maxClientCnxns=0
admin.enableServer=false
4lw.commands.whitelist=srvr,ruok
forceSync=no
`, ZooKeeperTick.Milliseconds(), z.DataDir, z.port)
	path := filepath.Join(z.base, "zoo.cfg")
	return path, os.WriteFile(path, []byte(cfg), 0o644)
}

// start launches the server and waits until it serves requests.
func (z *ZooKeeper) start(ctx context.Context) error {
	z.mu.Lock()
	defer z.mu.Unlock()
	if z.proc != nil {
		return errors.New("already running")
	}
	cfg, err := z.config()
	if err != nil {
		return err
	}
	logf, err := os.OpenFile(z.LogFile, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close() // the child keeps its own descriptor
	logStart, err := logf.Seek(0, 2)
	if err != nil {
		return err
	}
	// A small heap and the client compiler only: the server holds a few znodes, and the
	// JVM starts faster.
	cmd := exec.Command("java", "-Xmx128m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
		"-Dorg.slf4j.simpleLogger.defaultLogLevel=warn", "-Dzookeeper.jmx.log4j.disable=true",
		"-cp", strings.Join(zkClasspath(), ":"), "org.apache.zookeeper.server.ZooKeeperServerMain", cfg)
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}
	cmd.Stdout, cmd.Stderr = logf, logf
	// Own process group, and Pdeathsig: a server never outlives a test process killed
	// before its cleanup.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("java: %w", err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait() // the log says why
		close(exited)
	}()
	z.proc, z.exited = cmd.Process, exited
	if err := z.waitReady(ctx, exited); err != nil {
		z.stopLocked(syscall.SIGKILL)
		tail := consulLogTail(z.LogFile, logStart)
		if strings.Contains(tail, "Address already in use") {
			return fmt.Errorf("%w: %s", errPortInUse, tail)
		}
		return fmt.Errorf("%w; server log:\n%s", err, tail)
	}
	return nil
}

// waitReady polls the `srvr` four-letter word until the server says it serves (it answers
// "not currently serving requests" while it loads its data).
func (z *ZooKeeper) waitReady(ctx context.Context, exited <-chan struct{}) error {
	var last error
	for {
		out, err := z.fourLetters(ctx, "srvr")
		switch {
		case err != nil:
			last = err
		case strings.Contains(out, "Mode: standalone"):
			return nil
		default:
			last = fmt.Errorf("srvr: %q", strings.TrimSpace(out))
		}
		select {
		case <-exited:
			return errors.New("ZooKeeper exited during startup")
		case <-ctx.Done():
			return fmt.Errorf("not ready: %w (last: %v)", ctx.Err(), last)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// fourLetters sends a four-letter word and returns the server's whole answer.
func (z *ZooKeeper) fourLetters(ctx context.Context, word string) (string, error) {
	d := net.Dialer{Timeout: time.Second}
	c, err := d.DialContext(ctx, "tcp", z.Addr)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write([]byte(word)); err != nil {
		return "", err
	}
	var b strings.Builder
	sc := bufio.NewScanner(c)
	for sc.Scan() {
		b.WriteString(sc.Text())
		b.WriteByte('\n')
	}
	return b.String(), sc.Err()
}

// Start starts a stopped server again, on the same port and data.
func (z *ZooKeeper) Start(tb testing.TB) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), zkStartTimeout)
	defer cancel()
	if err := z.StartContext(ctx); err != nil {
		tb.Fatalf("testenv: %v", err)
	}
}

// StartContext is Start returning an error.
func (z *ZooKeeper) StartContext(ctx context.Context) error {
	if err := z.start(ctx); err != nil {
		return fmt.Errorf("start ZooKeeper on %s: %w", z.Addr, err)
	}
	return nil
}

// Stop shuts the server down (SIGTERM); its clients see connection errors until Start.
// Stopping a stopped server does nothing.
func (z *ZooKeeper) Stop(tb testing.TB) {
	tb.Helper()
	if err := z.Shutdown(); err != nil {
		tb.Fatalf("testenv: %v", err)
	}
}

// Shutdown is Stop returning an error.
func (z *ZooKeeper) Shutdown() error {
	z.mu.Lock()
	defer z.mu.Unlock()
	return z.stopLocked(syscall.SIGTERM)
}

// stopLocked signals the server and waits for it to exit (SIGKILL after zkStopTimeout).
func (z *ZooKeeper) stopLocked(sig syscall.Signal) error {
	if z.proc == nil {
		return nil
	}
	proc, exited := z.proc, z.exited
	z.proc, z.exited = nil, nil
	_ = syscall.Kill(-proc.Pid, syscall.SIGCONT)
	_ = syscall.Kill(-proc.Pid, sig)
	select {
	case <-exited:
		return nil
	case <-time.After(zkStopTimeout):
	}
	_ = syscall.Kill(-proc.Pid, syscall.SIGKILL)
	select {
	case <-exited:
		return fmt.Errorf("stop ZooKeeper: no exit within %v of %v; killed", zkStopTimeout, sig)
	case <-time.After(zkStopTimeout):
		return fmt.Errorf("stop ZooKeeper: pid %d survived SIGKILL", proc.Pid)
	}
}

// Backup stops the server, copies its data folder, and starts it again; Restore puts the
// copy back. The copy is what a snapshot taken at that moment holds.
func (z *ZooKeeper) Backup(tb testing.TB) string {
	tb.Helper()
	z.Stop(tb)
	dst := copyData(tb, z.base, z.DataDir)
	z.Start(tb)
	return dst
}

// Restore stops the server, replaces its data with backup (from Backup), and starts it
// again: every znode, session and zxid is back where it was when the backup was taken.
func (z *ZooKeeper) Restore(tb testing.TB, backup string) {
	tb.Helper()
	z.Stop(tb)
	replaceData(tb, z.DataDir, backup)
	z.Start(tb)
}

// copyData copies a stopped server's data folder into a new folder under base.
func copyData(tb testing.TB, base, data string) string {
	tb.Helper()
	dst := filepath.Join(base, "backup-"+strconv.FormatInt(time.Now().UnixNano(), 10))
	if out, err := exec.Command("cp", "-a", data, dst).CombinedOutput(); err != nil {
		tb.Fatalf("testenv: back up %s: %v: %s", data, err, out)
	}
	return dst
}

// replaceData puts a stopped server's data folder back to backup (copyData's).
func replaceData(tb testing.TB, data, backup string) {
	tb.Helper()
	if err := os.RemoveAll(data); err != nil {
		tb.Fatalf("testenv: restore %s: %v", data, err)
	}
	if out, err := exec.Command("cp", "-a", backup, data).CombinedOutput(); err != nil {
		tb.Fatalf("testenv: restore %s: %v: %s", data, err, out)
	}
}

// Wipe stops the server, deletes its data and starts it again, empty: zxids start over.
func (z *ZooKeeper) Wipe(tb testing.TB) {
	tb.Helper()
	z.Stop(tb)
	if err := os.RemoveAll(z.DataDir); err != nil {
		tb.Fatalf("testenv: wipe ZooKeeper: %v", err)
	}
	z.Start(tb)
}

// Conn returns a client session with the server (session timeout 10 s), closed at
// cleanup. It does not wait for the session: the first request does.
func (z *ZooKeeper) Conn(tb testing.TB) *zk.Conn {
	tb.Helper()
	c, _, err := zk.Connect([]string{z.Addr}, 10*time.Second, zk.WithLogInfo(false), zk.WithLogger(quietZK{}))
	if err != nil {
		tb.Fatalf("testenv: ZooKeeper client: %v", err)
	}
	tb.Cleanup(c.Close)
	return c
}

// quietZK drops the client's logs: its reconnection attempts after a Stop would flood the
// test's output.
type quietZK struct{}

func (quietZK) Printf(string, ...any) {}

// Running reports whether the server is started.
func (z *ZooKeeper) Running() bool {
	z.mu.Lock()
	defer z.mu.Unlock()
	return z.proc != nil
}

// Close stops the server and removes its folder.
func (z *ZooKeeper) Close() error {
	z.mu.Lock()
	err := z.stopLocked(syscall.SIGTERM)
	z.mu.Unlock()
	return errors.Join(err, os.RemoveAll(z.base))
}
