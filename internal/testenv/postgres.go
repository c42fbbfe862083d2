package testenv

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	mathrand "math/rand/v2"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

const (
	// AdminUser is the cluster's superuser, who owns every cluster StartPostgres makes.
	AdminUser = "postgres"
	// AdminPassword is AdminUser's password. It matters only when WithAuth asks for a
	// password method; AdminURL always carries it.
	AdminPassword = "postgres"

	// DefaultBinDir is where Debian's postgresql-15 package puts the server binaries.
	// $FENCEPROXY_PG_BINDIR overrides it.
	DefaultBinDir = "/usr/lib/postgresql/15/bin"

	// dirPrefix names the temporary folders, so that a later run can find and remove
	// the folders of a test process that died before its cleanup ran.
	dirPrefix = "fenceproxy-pg-"

	startTimeout = 60 * time.Second // initdb excluded; crash recovery under a loaded CI included
	stopTimeout  = 30 * time.Second
	crashWait    = 3 * time.Second // Crash's wait between SIGQUIT and SIGKILL
	execTimeout  = 2 * time.Minute
	portAttempts = 10
)

// errPortInUse means postgres could not bind its port: somebody took it between
// FreePort and the bind. StartPostgres then tries another port.
var errPortInUse = errors.New("port already in use")

// Postgres is a running (or stopped, between Stop and Start) private PostgreSQL cluster.
// The exported fields are read-only for callers.
type Postgres struct {
	Host      string // "127.0.0.1": the only address the server listens on
	Port      int    // private TCP port; also the port of the unix socket in SocketDir
	SocketDir string // unix socket folder: use it as host=SocketDir in a URL
	DataDir   string // the cluster's data folder (PGDATA)
	BinDir    string // folder of initdb, postgres, pgbench, psql...
	CAFile    string // set when WithSSL: the CA that signed the server certificate
	LogFile   string // the server's stderr; its tail is logged when a test fails

	opts pgOptions
	base string              // temporary folder holding everything above; removed by cleanup
	cred *syscall.Credential // nil when the tests do not run as root
	env  []string

	mu     sync.Mutex
	proc   *os.Process   // nil while stopped
	exited chan struct{} // closed when proc has been reaped
}

type pgOptions struct {
	auth string
	ssl  bool
	conf [][2]string
	// standbyOf, when set, makes the cluster a streaming standby: its data folder is a base
	// backup of that primary (see StartStandby) instead of a new initdb.
	standbyOf *standbySource
}

// PGOption configures StartPostgres.
type PGOption func(*pgOptions)

// WithAuth sets the pg_hba.conf method for both TCP (host) and unix socket (local)
// connections: "trust" (the default), "password", "md5" or "scram-sha-256".
// Under "md5" the passwords CreateRole sets are stored as MD5 hashes, so that the
// server really runs the MD5 exchange; otherwise they are stored as SCRAM secrets.
func WithAuth(method string) PGOption {
	return func(o *pgOptions) { o.auth = method }
}

// WithSSL turns ssl on with a server certificate for 127.0.0.1, ::1 and localhost,
// signed by a CA generated for this cluster (Postgres.CAFile), so that clients can
// use sslmode=verify-full. Non-SSL connections are still accepted.
func WithSSL() PGOption {
	return func(o *pgOptions) { o.ssl = true }
}

// WithConf adds a postgresql.conf setting. It wins over the helper's own settings,
// except port, which the helper always chooses.
func WithConf(key, value string) PGOption {
	return func(o *pgOptions) { o.conf = append(o.conf, [2]string{key, value}) }
}

// StartPostgres creates a cluster in a new temporary folder, starts it and waits
// until it accepts connections. tb.Cleanup stops it and removes the folder. Any
// failure is fatal for the test (never a skip). Safe to call from parallel tests
// and parallel test processes. It is LaunchPostgres for tests.
func StartPostgres(tb testing.TB, opts ...PGOption) *Postgres {
	NeedServers(tb)
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	p, err := LaunchPostgres(ctx, opts...)
	if err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	tb.Cleanup(func() {
		err := p.Shutdown()
		if tb.Failed() && p.LogFile != "" {
			tb.Logf("testenv: PostgreSQL log tail (%s):\n%s", p.LogFile, p.logTail(0))
		}
		if err := errors.Join(err, p.Close()); err != nil {
			tb.Errorf("testenv: %v", err)
		}
	})
	tb.Logf("testenv: PostgreSQL on %s:%d (auth %s, ssl %t), folder %s", p.Host, p.Port, p.opts.auth, p.opts.ssl, p.base)
	return p
}

// LaunchPostgres is StartPostgres for programs that are not tests (a demo, a benchmark
// driver): it creates, starts and waits for a cluster, and returns an error instead of
// failing a test. The caller must Close it, also when a later step fails.
func LaunchPostgres(ctx context.Context, opts ...PGOption) (*Postgres, error) {
	p := &Postgres{Host: "127.0.0.1", opts: pgOptions{auth: "trust"}}
	for _, o := range opts {
		o(&p.opts)
	}
	if src := p.opts.standbyOf; src != nil {
		p.opts.auth = src.primary.opts.auth // the base backup copies pg_hba.conf
	}
	switch p.opts.auth {
	case "trust", "password", "md5", "scram-sha-256":
	default:
		return nil, fmt.Errorf("WithAuth(%q): want trust, password, md5 or scram-sha-256", p.opts.auth)
	}

	p.BinDir = os.Getenv("FENCEPROXY_PG_BINDIR")
	if p.BinDir == "" {
		p.BinDir = DefaultBinDir
	}
	for _, name := range []string{"initdb", "postgres"} {
		if _, err := os.Stat(p.Bin(name)); err != nil {
			return nil, fmt.Errorf("PostgreSQL 15 server binaries not found (%w): run `make deps` "+
				"(or set $FENCEPROXY_PG_BINDIR to the folder holding initdb and postgres)", err)
		}
	}

	var home string
	if os.Geteuid() == 0 {
		// initdb and postgres refuse to run as root.
		u, err := user.Lookup("postgres")
		if err != nil {
			return nil, fmt.Errorf("running as root needs the `postgres` OS user to run the cluster: %w: run `make deps`", err)
		}
		uid, _ := strconv.ParseUint(u.Uid, 10, 32)
		gid, _ := strconv.ParseUint(u.Gid, 10, 32)
		p.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}}
		home = u.HomeDir
	} else {
		home = os.Getenv("HOME")
	}
	// A clean environment: PG* variables of the caller must not reach initdb or
	// postgres, and messages must be in English for tests that read the log.
	p.env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + home, "LC_ALL=C"}

	root := tempRoot(p.cred != nil)
	sweepStale(root)
	base, err := os.MkdirTemp(root, dirPrefix)
	if err != nil {
		return nil, err
	}
	p.base = base
	if err := p.launch(ctx); err != nil {
		_ = p.Close()
		return nil, err
	}
	return p, nil
}

// launch prepares the cluster in p.base and starts it on a free port.
func (p *Postgres) launch(ctx context.Context) error {
	if err := os.WriteFile(filepath.Join(p.base, "owner"), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		return err
	}
	p.DataDir = filepath.Join(p.base, "data")
	p.SocketDir = filepath.Join(p.base, "sock")
	p.LogFile = filepath.Join(p.base, "postgres.log")
	if err := p.prepare(); err != nil {
		return err
	}
	for attempt := 1; ; attempt++ {
		port, err := PickFreePort()
		if err != nil {
			return err
		}
		p.Port = port
		err = p.start(ctx)
		if err == nil {
			break
		}
		if !errors.Is(err, errPortInUse) || attempt == portAttempts {
			return fmt.Errorf("start PostgreSQL: %w", err)
		}
	}
	if p.opts.auth == "md5" {
		// initdb stored the superuser's password as a SCRAM secret; store it as
		// MD5 like every other role of an md5 cluster.
		sql := passwordSQL(p.opts.auth, "ALTER ROLE "+pgx.Identifier{AdminUser}.Sanitize(), AdminPassword)
		if err := p.exec(ctx, sql); err != nil {
			return err
		}
	}
	return nil
}

// prepare runs initdb and writes the configuration, the certificates and the
// folders the server needs, all owned by the user the server runs as.
func (p *Postgres) prepare() error {
	pwfile := filepath.Join(p.base, "pwfile")
	if err := os.WriteFile(pwfile, []byte(AdminPassword+"\n"), 0o600); err != nil {
		return err
	}
	if err := os.Mkdir(p.SocketDir, 0o700); err != nil {
		return err
	}
	if err := p.chown(p.base, pwfile, p.SocketDir); err != nil {
		return err
	}
	if src := p.opts.standbyOf; src != nil {
		if err := os.Remove(pwfile); err != nil {
			return err
		}
		return p.prepareStandby(src)
	}
	initdb := p.command(p.Bin("initdb"), "-D", p.DataDir, "-U", AdminUser, "--pwfile", pwfile,
		"-A", "trust", "--locale=C", "-E", "UTF8", "--no-sync", "--no-instructions")
	if out, err := initdb.CombinedOutput(); err != nil {
		return fmt.Errorf("initdb: %w\n%s", err, out)
	}
	if err := os.Remove(pwfile); err != nil {
		return err
	}

	method := p.opts.auth
	// Replication connections (a standby's base backup and its WAL stream, StartStandby) are
	// the superuser's, with the same method.
	hba := fmt.Sprintf("local all all %[1]s\nhost all all 127.0.0.1/32 %[1]s\nhost all all ::1/128 %[1]s\n"+
		"local replication all %[1]s\nhost replication all 127.0.0.1/32 %[1]s\n", method)
	if err := os.WriteFile(filepath.Join(p.DataDir, "pg_hba.conf"), []byte(hba), 0o600); err != nil {
		return err
	}

	conf := [][2]string{
		{"listen_addresses", "127.0.0.1"},
		{"unix_socket_directories", p.SocketDir},
		{"max_connections", "200"},
		{"max_prepared_transactions", "10"}, // tests use PREPARE TRANSACTION
		{"shared_buffers", "16MB"},
		{"huge_pages", "off"},
		{"fsync", "off"},
		{"synchronous_commit", "off"},
		{"full_page_writes", "off"},
		{"password_encryption", passwordEncryption(method)},
		{"log_line_prefix", "%m [%p] %q%u@%d "},
		{"wal_level", "replica"}, // PostgreSQL 15's default, said: StartStandby needs it
		{"max_wal_senders", "10"},
	}
	if p.opts.ssl {
		ca, err := p.writeCerts()
		if err != nil {
			return fmt.Errorf("certificates: %w", err)
		}
		p.CAFile = ca
		conf = append(conf, [2]string{"ssl", "on"},
			[2]string{"ssl_cert_file", "server.crt"}, [2]string{"ssl_key_file", "server.key"})
	}
	conf = append(conf, p.opts.conf...)
	return p.appendConf(conf)
}

// appendConf appends settings to the cluster's postgresql.conf (later lines win).
func (p *Postgres) appendConf(conf [][2]string) error {
	var b strings.Builder
	b.WriteString("\n# testenv\n")
	for _, kv := range conf {
		fmt.Fprintf(&b, "%s = %s\n", kv[0], quoteLiteral(kv[1]))
	}
	f, err := os.OpenFile(filepath.Join(p.DataDir, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	if _, err := f.WriteString(b.String()); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// start launches postgres on p.Port and waits until it accepts connections.
// It returns errPortInUse when the port was taken.
func (p *Postgres) start(ctx context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.reapLocked()
	if p.proc != nil {
		return errors.New("already running")
	}
	logf, err := os.OpenFile(p.LogFile, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close() // the child keeps its own descriptor
	logStart, err := logf.Seek(0, io.SeekEnd)
	if err != nil {
		return err
	}
	cmd := p.command(p.Bin("postgres"), "-D", p.DataDir, "-p", strconv.Itoa(p.Port))
	cmd.Stdout, cmd.Stderr = logf, logf
	// Own process group: a ^C to the test's terminal does not reach the server
	// directly. Pdeathsig: if the test process dies without its cleanup (a go test
	// timeout), the postmaster gets SIGQUIT, PostgreSQL's immediate shutdown.
	// (Pdeathsig follows the forking OS thread; the Go runtime only retires threads
	// of goroutines that exit while locked with runtime.LockOSThread.)
	cmd.SysProcAttr.Setpgid = true
	cmd.SysProcAttr.Pdeathsig = syscall.SIGQUIT
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("postgres: %w", err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait() // the exit status says nothing the log does not
		close(exited)
	}()
	p.proc, p.exited = cmd.Process, exited

	if err := p.waitReady(ctx, exited); err != nil {
		_ = p.signalLocked(syscall.SIGQUIT, stopTimeout)
		tail := p.logTail(logStart)
		if errors.Is(err, errPortInUse) {
			return err
		}
		if strings.Contains(tail, "Address already in use") {
			return fmt.Errorf("%w: %d", errPortInUse, p.Port)
		}
		return fmt.Errorf("%w; server log:\n%s", err, tail)
	}
	return nil
}

// waitReady polls with real connections: a log line or a pid file could say
// "ready" before authentication works. The answering server must be ours: when
// another test's server took the port, ours exits and the other one answers.
func (p *Postgres) waitReady(ctx context.Context, exited <-chan struct{}) error {
	cfg, err := pgx.ParseConfig(p.AdminURL())
	if err != nil {
		return err
	}
	cfg.ConnectTimeout = 2 * time.Second
	// Whatever answers on the port, stop asking once our server has exited.
	connCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-exited:
			cancel()
		case <-connCtx.Done():
		}
	}()
	errExited := errors.New("postgres exited during startup")
	for {
		conn, err := pgx.ConnectConfig(connCtx, cfg)
		if err == nil {
			var dataDir string
			err = conn.QueryRow(connCtx, "SELECT current_setting('data_directory')").Scan(&dataDir)
			conn.Close(context.Background())
			if err == nil && dataDir != p.DataDir {
				return fmt.Errorf("%w: %d answers with data folder %s", errPortInUse, p.Port, dataDir)
			}
			return err
		}
		select {
		case <-exited:
			return errExited
		default:
		}
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code != "57P03" { // 57P03: starting up, recovering
			return fmt.Errorf("connect as %s: %w", AdminUser, err)
		}
		select {
		case <-exited:
			return errExited
		case <-ctx.Done():
			return fmt.Errorf("not accepting connections after %v: %w", startTimeout, err)
		case <-time.After(25 * time.Millisecond):
		}
	}
}

// Start starts a stopped cluster again on the same port and socket.
func (p *Postgres) Start(tb testing.TB) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	if err := p.StartContext(ctx); err != nil {
		tb.Fatalf("testenv: %v", err)
	}
}

// StartContext is Start returning an error.
func (p *Postgres) StartContext(ctx context.Context) error {
	if err := p.start(ctx); err != nil {
		return fmt.Errorf("start PostgreSQL on port %d: %w", p.Port, err)
	}
	return nil
}

// Stop shuts the cluster down cleanly (fast shutdown: clients are disconnected,
// open transactions roll back, prepared ones survive). Stopping a stopped
// cluster does nothing.
func (p *Postgres) Stop(tb testing.TB) {
	tb.Helper()
	if err := p.Shutdown(); err != nil {
		tb.Fatalf("testenv: %v", err)
	}
}

// Shutdown is Stop returning an error.
func (p *Postgres) Shutdown() error {
	if err := p.signal(syscall.SIGINT); err != nil {
		return fmt.Errorf("stop PostgreSQL: %w", err)
	}
	return nil
}

// Kill stops the cluster the way a crash does (immediate shutdown, what
// `pg_ctl stop -m immediate` sends): every backend exits at once, nothing is
// checkpointed, and the next Start runs crash recovery.
func (p *Postgres) Kill(tb testing.TB) {
	tb.Helper()
	if err := p.Crash(); err != nil {
		tb.Fatalf("testenv: %v", err)
	}
}

// Crash is Kill returning an error. An immediate shutdown does not signal a "dead-end"
// child (one forked for a connection that arrived during the shutdown), and the postmaster
// waits for it: up to authentication_timeout (60 s) when the connection sends no startup
// packet, as a standby's walreceiver does through a stalled relay (CutReplication). A crash
// does not wait for its children, so neither does Crash: SIGKILL follows after crashWait,
// and the children exit when they see the postmaster gone.
func (p *Postgres) Crash() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	err := p.signalLocked(syscall.SIGQUIT, crashWait)
	if err != nil && p.proc != nil {
		return fmt.Errorf("kill PostgreSQL: %w", err)
	}
	return nil
}

// Restart is Stop then Start.
func (p *Postgres) Restart(tb testing.TB) {
	tb.Helper()
	p.Stop(tb)
	p.Start(tb)
}

// Freeze stops the server and every process it started (SIGSTOP), as a paused VM: its
// sockets stay open and accept connections that nothing answers. It returns thaw (SIGCONT),
// which tb.Cleanup also runs, before the server is stopped.
func (p *Postgres) Freeze(tb testing.TB) (thaw func()) {
	tb.Helper()
	p.mu.Lock()
	proc := p.proc
	p.mu.Unlock()
	if proc == nil {
		tb.Fatalf("testenv: Freeze: the server at %s:%d is not running", p.Host, p.Port)
	}
	pids := append([]int{proc.Pid}, Children(proc.Pid)...)
	for _, pid := range pids {
		syscall.Kill(pid, syscall.SIGSTOP) //nolint:errcheck // a backend that exited meanwhile
	}
	var once sync.Once
	thaw = func() {
		once.Do(func() {
			for _, pid := range pids {
				syscall.Kill(pid, syscall.SIGCONT) //nolint:errcheck
			}
		})
	}
	tb.Cleanup(thaw)
	return thaw
}

// Children lists the live processes whose parent is pid (from /proc).
func Children(pid int) []int {
	entries, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range entries {
		child, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...: comm may hold spaces and parentheses.
		f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
		if len(f) > 1 && f[1] == strconv.Itoa(pid) {
			out = append(out, child)
		}
	}
	return out
}

func (p *Postgres) signal(sig syscall.Signal) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.signalLocked(sig, stopTimeout)
}

// signalLocked sends sig to the postmaster and waits for it to exit, escalating
// to SIGQUIT and then SIGKILL when it takes longer than timeout.
func (p *Postgres) signalLocked(sig syscall.Signal, timeout time.Duration) error {
	if p.proc == nil {
		return nil
	}
	proc, exited := p.proc, p.exited
	var slow error
	for _, s := range []syscall.Signal{sig, syscall.SIGQUIT, syscall.SIGKILL} {
		if err := proc.Signal(s); err != nil && !errors.Is(err, os.ErrProcessDone) {
			return fmt.Errorf("signal %v: %w", s, err)
		}
		select {
		case <-exited:
			p.proc, p.exited = nil, nil
			return slow
		case <-time.After(timeout):
			slow = fmt.Errorf("postgres did not exit within %v of %v", timeout, sig)
		}
	}
	return slow
}

// Close shuts the cluster down and removes its folder. StartPostgres's cleanup calls it;
// callers of LaunchPostgres call it themselves.
func (p *Postgres) Close() error {
	err := p.Shutdown()
	if rmErr := os.RemoveAll(p.base); rmErr != nil {
		err = errors.Join(err, rmErr)
	}
	return err
}

// LogTail is the end of the server's log (its last 40 lines), for an error report.
func (p *Postgres) LogTail() string { return p.logTail(0) }

// URL is a connection URL for user over TCP without a password and with
// sslmode=disable unless params (each "key=value", e.g. "sslmode=verify-full")
// say otherwise.
func (p *Postgres) URL(user, db string, params ...string) string {
	return p.url(url.User(user), db, params)
}

// URLWithPassword is URL with a password.
func (p *Postgres) URLWithPassword(user, password, db string, params ...string) string {
	return p.url(url.UserPassword(user, password), db, params)
}

// AdminURL reaches database postgres as the superuser over TCP, whatever the auth method.
func (p *Postgres) AdminURL() string {
	return p.URLWithPassword(AdminUser, AdminPassword, "postgres")
}

func (p *Postgres) url(user *url.Userinfo, db string, params []string) string {
	return connURL(p.Host, p.Port, user, db, params)
}

// connURL is a postgres:// URL for host:port. params are "key=value"; sslmode
// defaults to disable.
func connURL(host string, port int, user *url.Userinfo, db string, params []string) string {
	q := url.Values{}
	for _, kv := range params {
		k, v, _ := strings.Cut(kv, "=")
		q.Set(k, v)
	}
	if !q.Has("sslmode") {
		q.Set("sslmode", "disable")
	}
	u := url.URL{
		Scheme: "postgres",
		User:   user,
		Host:   net.JoinHostPort(host, strconv.Itoa(port)),
		Path:   "/" + db,
		// libpq and pgx decode %XX but read '+' literally: spaces must be %20.
		RawQuery: strings.ReplaceAll(q.Encode(), "+", "%20"),
	}
	return u.String()
}

// Bin is the path of a PostgreSQL program, e.g. p.Bin("pgbench").
func (p *Postgres) Bin(name string) string {
	return filepath.Join(p.BinDir, name)
}

// Exec runs sql (one or more statements, simple protocol) as the superuser in
// database postgres. Errors are fatal. Call it from the test's goroutine.
func (p *Postgres) Exec(tb testing.TB, sql string) {
	tb.Helper()
	// Not tb.Context(): that is cancelled before cleanups run, and cleanups call Exec too.
	ctx, cancel := context.WithTimeout(context.Background(), execTimeout)
	defer cancel()
	if err := p.ExecContext(ctx, sql); err != nil {
		tb.Fatalf("testenv: %v", err)
	}
}

// ExecContext is Exec returning an error.
func (p *Postgres) ExecContext(ctx context.Context, sql string) error {
	return p.exec(ctx, sql)
}

func (p *Postgres) exec(ctx context.Context, sql string) error {
	conn, err := pgx.Connect(ctx, p.AdminURL())
	if err != nil {
		return fmt.Errorf("connect as %s: %w", AdminUser, err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, sql); err != nil {
		if len(sql) > 200 {
			sql = sql[:200] + "..."
		}
		return fmt.Errorf("exec %q: %w", sql, err)
	}
	return nil
}

// CreateRole creates a login role. Its password is stored the way the cluster's
// auth method needs (MD5 hash under md5, SCRAM secret otherwise); an empty
// password creates a role without one. The role gets no privileges beyond login:
// grant what the test needs with Exec.
func (p *Postgres) CreateRole(tb testing.TB, name, password string) {
	tb.Helper()
	p.Exec(tb, p.createRoleSQL(name, password))
}

// CreateRoleContext is CreateRole returning an error.
func (p *Postgres) CreateRoleContext(ctx context.Context, name, password string) error {
	return p.exec(ctx, p.createRoleSQL(name, password))
}

func (p *Postgres) createRoleSQL(name, password string) string {
	sql := "CREATE ROLE " + pgx.Identifier{name}.Sanitize() + " LOGIN"
	if password != "" {
		sql = passwordSQL(p.opts.auth, sql, password)
	}
	return sql
}

// passwordSQL appends a PASSWORD clause to a CREATE or ALTER ROLE statement,
// after setting the encryption the auth method needs for the session.
func passwordSQL(method, roleStmt, password string) string {
	return fmt.Sprintf("SET password_encryption = %s; %s PASSWORD %s",
		quoteLiteral(passwordEncryption(method)), roleStmt, quoteLiteral(password))
}

// passwordEncryption is how passwords are stored for an auth method: an md5
// cluster must store MD5 hashes, or the server would run SCRAM instead.
func passwordEncryption(method string) string {
	if method == "md5" {
		return "md5"
	}
	return "scram-sha-256"
}

// quoteLiteral quotes s for SQL with standard_conforming_strings on (the
// default) and for postgresql.conf, which both double a single quote.
func quoteLiteral(s string) string {
	return "'" + strings.ReplaceAll(s, "'", "''") + "'"
}

// FreePort returns a TCP port on 127.0.0.1 that nobody listened on a moment ago.
// It picks ports below the kernel's ephemeral range, so that the source ports of
// the suite's own outgoing connections never take a test server's port (a
// stopped server must get its port back on Start). Another test process can
// still take the port before the caller binds it: callers retry on a bind failure.
func FreePort(tb testing.TB) int {
	tb.Helper()
	port, err := PickFreePort()
	if err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	return port
}

// PickFreePort is FreePort returning an error.
func PickFreePort() (int, error) {
	lo, hi := 20000, 32768
	if elo, ehi, ok := ephemeralRange(); ok && elo < hi && ehi >= lo {
		// The ephemeral range overlaps ours: let the kernel choose instead.
		lo, hi = 0, 0
	}
	for range 100 {
		port := 0
		if hi > lo {
			port = lo + mathrand.IntN(hi-lo)
		}
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			continue
		}
		port = l.Addr().(*net.TCPAddr).Port
		if err := l.Close(); err != nil {
			return 0, err
		}
		return port, nil
	}
	return 0, fmt.Errorf("no free port found in [%d, %d)", lo, hi)
}

func ephemeralRange() (lo, hi int, ok bool) {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 0, 0, false
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return 0, 0, false
	}
	lo, err1 := strconv.Atoi(f[0])
	hi, err2 := strconv.Atoi(f[1])
	return lo, hi, err1 == nil && err2 == nil
}

// command runs name as the server's OS user, in the cluster's folder (the
// caller's working folder may be closed to that user), with a clean environment.
func (p *Postgres) command(name string, args ...string) *exec.Cmd {
	cmd := exec.Command(name, args...)
	cmd.Dir = p.base
	cmd.Env = p.env
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: p.cred}
	return cmd
}

func (p *Postgres) chown(paths ...string) error {
	if p.cred == nil {
		return nil
	}
	for _, path := range paths {
		if err := os.Chown(path, int(p.cred.Uid), int(p.cred.Gid)); err != nil {
			return err
		}
	}
	return nil
}

// writeCerts writes a CA (returned, for clients) and a server certificate and key
// for 127.0.0.1, ::1 and localhost into the data folder.
func (p *Postgres) writeCerts() (caFile string, err error) {
	now := time.Now()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", err
	}
	caTmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "fenceproxy testenv CA"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(7 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return "", err
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return "", err
	}

	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: "localhost"},
		DNSNames:     []string{"localhost"},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(7 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return "", err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return "", err
	}

	caFile = filepath.Join(p.base, "ca.crt")
	files := []struct {
		path  string
		block *pem.Block
		mode  os.FileMode // postgres refuses a key that others can read
	}{
		{caFile, &pem.Block{Type: "CERTIFICATE", Bytes: caDER}, 0o644},
		{filepath.Join(p.DataDir, "server.crt"), &pem.Block{Type: "CERTIFICATE", Bytes: der}, 0o644},
		{filepath.Join(p.DataDir, "server.key"), &pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}, 0o600},
	}
	for _, f := range files {
		if err := os.WriteFile(f.path, pem.EncodeToMemory(f.block), f.mode); err != nil {
			return "", err
		}
		if err := p.chown(f.path); err != nil {
			return "", err
		}
	}
	return caFile, nil
}

func serial() *big.Int {
	return new(big.Int).SetUint64(mathrand.Uint64() >> 1)
}

// logTail returns the last lines of the server log written after offset.
func (p *Postgres) logTail(offset int64) string {
	b, err := os.ReadFile(p.LogFile)
	if err != nil {
		return fmt.Sprintf("(no server log: %v)", err)
	}
	if offset > 0 && offset <= int64(len(b)) {
		b = b[offset:]
	}
	lines := bytes.Split(bytes.TrimRight(b, "\n"), []byte("\n"))
	if len(lines) > 40 {
		lines = lines[len(lines)-40:]
	}
	return string(bytes.Join(lines, []byte("\n")))
}

// tempRoot is the folder for cluster folders: os.TempDir unless the server's user
// could not reach it or a socket path in it would be too long (sun_path holds 107
// bytes), then /tmp.
func tempRoot(otherUser bool) string {
	dir := os.TempDir()
	if len(dir)+len("/"+dirPrefix+"1234567890/sock/.s.PGSQL.65535.lock") > 107 {
		return "/tmp"
	}
	if otherUser {
		for d := dir; ; d = filepath.Dir(d) {
			if fi, err := os.Stat(d); err != nil || fi.Mode().Perm()&0o001 == 0 {
				return "/tmp"
			}
			if d == filepath.Dir(d) {
				break
			}
		}
	}
	return dir
}

// sweepStale removes cluster folders left behind by test processes that died
// before their cleanup (a go test timeout kills the process): folders whose
// owner process and postmaster are both gone.
func sweepStale(root string) {
	entries, err := os.ReadDir(root)
	if err != nil {
		return
	}
	for _, e := range entries {
		if !e.IsDir() || !strings.HasPrefix(e.Name(), dirPrefix) {
			continue
		}
		dir := filepath.Join(root, e.Name())
		// No owner file yet: a folder being made right now.
		if !pidFileDead(filepath.Join(dir, "owner"), false) ||
			!pidFileDead(filepath.Join(dir, "data", "postmaster.pid"), true) {
			continue
		}
		_ = os.RemoveAll(dir) // best effort: another process may be sweeping too
	}
}

// pidFileDead reports whether the process whose pid is the first line of path is
// gone; a missing or unreadable file counts as dead only if missingIsDead.
func pidFileDead(path string, missingIsDead bool) bool {
	b, err := os.ReadFile(path)
	if err != nil {
		return missingIsDead && errors.Is(err, os.ErrNotExist)
	}
	first, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(first))
	if err != nil || pid <= 0 {
		return false
	}
	return errors.Is(syscall.Kill(pid, 0), syscall.ESRCH)
}

// Running reports whether the cluster is started (between Start and Stop or Kill) and has
// not exited on its own.
func (p *Postgres) Running() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.reapLocked()
	return p.proc != nil
}

// reapLocked forgets a postmaster that exited without Stop or Kill, so that Start can start
// it again.
func (p *Postgres) reapLocked() {
	if p.proc == nil {
		return
	}
	select {
	case <-p.exited:
		p.proc, p.exited = nil, nil
	default:
	}
}
