package testenv

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

const (
	etcdStartTimeout = 60 * time.Second
	etcdStopTimeout  = 15 * time.Second
)

// Etcd is a real single-member etcd server (go.etcd.io/etcd/server/v3/embed, the same
// server code as the etcd binary) running in the test process, on private loopback ports,
// with its data in a temporary folder. Stop and Start keep the ports and the data, so a
// restarted server has the same keys, leases and revisions; Backup and Restore put an
// earlier data folder back, which moves every revision back as a snapshot restore does.
// The exported fields are read-only for callers.
type Etcd struct {
	Endpoint string // client URL, http://127.0.0.1:port
	DataDir  string
	LogFile  string

	base       string
	clientPort int
	peerPort   int

	mu     sync.Mutex
	server *embed.Etcd
}

// StartEtcd starts a single-member etcd server on private ports (LaunchEtcd) and registers
// tb.Cleanup to stop it and remove its folder (kept when the test failed).
func StartEtcd(tb testing.TB) *Etcd {
	NeedServers(tb)
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), etcdStartTimeout)
	defer cancel()
	e, err := LaunchEtcd(ctx)
	if err != nil {
		tb.Fatalf("testenv: start etcd: %v", err)
	}
	tb.Cleanup(func() {
		if err := e.stop(); err != nil {
			tb.Errorf("testenv: %v", err)
		}
		if tb.Failed() {
			tb.Logf("testenv: etcd folder kept: %s", e.base)
			return
		}
		_ = os.RemoveAll(e.base)
	})
	tb.Logf("testenv: etcd on %s, folder %s", e.Endpoint, e.base)
	return e
}

// LaunchEtcd starts a single-member etcd server on private ports and waits until it serves
// linearizable reads; Close stops it and removes its folder. Its heartbeat and election
// timeouts are short (a single member elects itself at once anyway) and fsync is off: a
// Stop is a clean shutdown, not a power loss.
func LaunchEtcd(ctx context.Context) (*Etcd, error) {
	base, err := os.MkdirTemp("", "fenceproxy-etcd-")
	if err != nil {
		return nil, err
	}
	e := &Etcd{base: base, DataDir: filepath.Join(base, "data"), LogFile: filepath.Join(base, "etcd.log")}
	for attempt := 1; ; attempt++ {
		if e.clientPort, err = PickFreePort(); err == nil {
			// two random draws can be the same port
			for e.peerPort = e.clientPort; err == nil && e.peerPort == e.clientPort; {
				e.peerPort, err = PickFreePort()
			}
		}
		if err == nil {
			e.Endpoint = "http://127.0.0.1:" + strconv.Itoa(e.clientPort)
			err = e.start(ctx)
		}
		if err == nil {
			return e, nil
		}
		if !errors.Is(err, errPortInUse) || attempt == portAttempts {
			_ = os.RemoveAll(base)
			return nil, err
		}
		// A member that failed to bind may have written a data folder for the old ports.
		_ = os.RemoveAll(e.DataDir)
	}
}

// Close stops the server and removes its folder.
func (e *Etcd) Close() error {
	return errors.Join(e.stop(), os.RemoveAll(e.base))
}

func (e *Etcd) config() *embed.Config {
	cfg := embed.NewConfig()
	cfg.Name = "fenceproxy-test"
	cfg.Dir = e.DataDir
	client := url.URL{Scheme: "http", Host: "127.0.0.1:" + strconv.Itoa(e.clientPort)}
	peer := url.URL{Scheme: "http", Host: "127.0.0.1:" + strconv.Itoa(e.peerPort)}
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{client}, []url.URL{client}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{peer}, []url.URL{peer}
	cfg.InitialCluster = cfg.Name + "=" + peer.String()
	cfg.InitialClusterToken = "fenceproxy-test"
	cfg.TickMs, cfg.ElectionMs = 50, 500
	cfg.UnsafeNoFsync = true
	cfg.EnableGRPCGateway = false
	cfg.LogLevel = "warn"
	cfg.LogOutputs = []string{e.LogFile}
	return cfg
}

// start starts the server on e's ports and data folder and waits until it answers a
// linearizable read. It returns errPortInUse when a port was taken.
func (e *Etcd) start(ctx context.Context) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.server != nil {
		return errors.New("etcd is running already")
	}
	srv, err := embed.StartEtcd(e.config())
	if err != nil {
		if strings.Contains(err.Error(), "address already in use") {
			return fmt.Errorf("%w: %v", errPortInUse, err)
		}
		return err
	}
	select {
	case <-srv.Server.ReadyNotify():
	case err := <-srv.Err():
		srv.Close()
		return fmt.Errorf("etcd failed while starting: %w", err)
	case <-ctx.Done():
		srv.Close()
		return fmt.Errorf("etcd not ready: %w (log: %s)", ctx.Err(), e.LogFile)
	}
	e.server = srv
	// Ready means the member published itself; a linearizable read also needs the
	// leader's confirmation, which is what every test's first read asks for.
	cli, err := e.newClient()
	if err != nil {
		return err
	}
	defer cli.Close()
	for {
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		_, err := cli.Get(rctx, "fenceproxy-testenv-ready")
		cancel()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("etcd not answering: %w", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Start starts a stopped server again, on the same ports and data.
func (e *Etcd) Start(tb testing.TB) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), etcdStartTimeout)
	defer cancel()
	if err := e.start(ctx); err != nil {
		tb.Fatalf("testenv: start etcd again: %v", err)
	}
}

// Stop shuts the server down; its clients see connection errors until Start. Stopping a
// stopped server does nothing.
func (e *Etcd) Stop(tb testing.TB) {
	tb.Helper()
	if err := e.stop(); err != nil {
		tb.Fatalf("testenv: stop etcd: %v", err)
	}
}

func (e *Etcd) stop() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.server == nil {
		return nil
	}
	srv := e.server
	e.server = nil
	closed := make(chan struct{})
	go func() { srv.Close(); close(closed) }()
	select {
	case <-closed:
		return nil
	case <-time.After(etcdStopTimeout):
		return fmt.Errorf("etcd did not stop within %v", etcdStopTimeout)
	}
}

// Backup stops the server, copies its data folder, and starts it again; Restore puts the
// copy back. The copy is what a snapshot taken at that moment holds.
func (e *Etcd) Backup(tb testing.TB) string {
	tb.Helper()
	e.Stop(tb)
	dst := copyData(tb, e.base, e.DataDir)
	e.Start(tb)
	return dst
}

// Restore stops the server, replaces its data with backup (from Backup), and starts it
// again: every key, lease and revision is back where it was when the backup was taken,
// as after `etcdutl snapshot restore` of a snapshot taken then (without --bump-revision).
func (e *Etcd) Restore(tb testing.TB, backup string) {
	tb.Helper()
	e.Stop(tb)
	replaceData(tb, e.DataDir, backup)
	e.Start(tb)
}

// Client returns a client of the server, closed at cleanup.
func (e *Etcd) Client(tb testing.TB) *clientv3.Client {
	tb.Helper()
	cli, err := e.newClient()
	if err != nil {
		tb.Fatalf("testenv: etcd client: %v", err)
	}
	tb.Cleanup(func() { _ = cli.Close() })
	return cli
}

func (e *Etcd) newClient() (*clientv3.Client, error) {
	return clientv3.New(clientv3.Config{
		Endpoints:   []string{e.Endpoint},
		DialTimeout: 5 * time.Second,
		// Its retries after a Stop would flood the test's output.
		Logger: zap.NewNop(),
	})
}

// Running reports whether the server is started.
func (e *Etcd) Running() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.server != nil
}
