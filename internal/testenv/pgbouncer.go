package testenv

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// PgBouncer is a pgbouncer process in front of one database of a Postgres, in a temporary
// folder of its own (configuration, log, unix socket) that Close removes.
type PgBouncer struct {
	*Process
	Host string // "127.0.0.1"
	Port int
	Dir  string // its folder: pgbouncer.ini, pgbouncer.log
}

// PgBouncerOptions tune LaunchPgBouncer; the zero value is a session-mode pool of 20.
type PgBouncerOptions struct {
	// PoolMode is session (""), transaction or statement.
	PoolMode string
	// PoolSize is default_pool_size, the server connections per user and database (0: 20).
	PoolSize int
	// MaxClientConn is max_client_conn (0: PoolSize + 100).
	MaxClientConn int
}

// StartPgBouncer is LaunchPgBouncer for tests: tb.Cleanup closes it.
func StartPgBouncer(tb testing.TB, pg *Postgres, db string, o PgBouncerOptions) *PgBouncer {
	NeedServers(tb)
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), listenTimeout)
	defer cancel()
	b, err := LaunchPgBouncer(ctx, pg, db, o)
	if err != nil {
		tb.Fatalf("testenv: %v", err)
	}
	tb.Cleanup(b.Close)
	return b
}

// LaunchPgBouncer starts pgbouncer (Debian's, on PATH) on a free loopback port in front of
// database db of pg over TCP, trusting every client as pg's cluster does (pg must use trust
// authentication), and waits until it accepts connections. It runs as the `postgres` OS user
// when the caller is root (pgbouncer refuses root). The caller must Close it.
func LaunchPgBouncer(ctx context.Context, pg *Postgres, db string, o PgBouncerOptions) (*PgBouncer, error) {
	bin, err := exec.LookPath("pgbouncer")
	if err != nil {
		return nil, fmt.Errorf("pgbouncer not found (%w): run `make deps`", err)
	}
	if o.PoolMode == "" {
		o.PoolMode = "session"
	}
	if o.PoolSize == 0 {
		o.PoolSize = 20
	}
	if o.MaxClientConn == 0 {
		o.MaxClientConn = o.PoolSize + 100
	}
	dir, err := os.MkdirTemp(tempRoot(pg.cred != nil), "fenceproxy-pgbouncer-")
	if err != nil {
		return nil, err
	}
	b := &PgBouncer{Host: "127.0.0.1", Dir: dir}
	// A port taken between PickFreePort and pgbouncer's bind makes it exit: try another.
	for attempt := 1; ; attempt++ {
		err = b.launch(ctx, pg, bin, db, o)
		if err == nil {
			return b, nil
		}
		taken := strings.Contains(b.logText(), "Address already in use")
		if b.Process != nil {
			b.Process.Close()
		}
		if ctx.Err() != nil || attempt == portAttempts || !taken {
			_ = os.RemoveAll(dir)
			return nil, err
		}
	}
}

func (b *PgBouncer) launch(ctx context.Context, pg *Postgres, bin, db string, o PgBouncerOptions) error {
	port, err := PickFreePort()
	if err != nil {
		return err
	}
	b.Port = port
	ini := fmt.Sprintf(`[databases]
%s = host=%s port=%d dbname=%s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir = %s
pidfile = %s
auth_type = trust
auth_file = %s
pool_mode = %s
max_client_conn = %d
default_pool_size = %d
log_connections = 0
log_disconnections = 0
`, db, pg.Host, pg.Port, db, port, b.Dir, filepath.Join(b.Dir, "pgbouncer.pid"),
		filepath.Join(b.Dir, "userlist.txt"), o.PoolMode, o.MaxClientConn, o.PoolSize)
	files := map[string]string{"pgbouncer.ini": ini, "userlist.txt": strconv.Quote(AdminUser) + ` ""` + "\n"}
	for name, text := range files {
		if err := os.WriteFile(filepath.Join(b.Dir, name), []byte(text), 0o644); err != nil {
			return err
		}
	}
	// A log of its own per attempt: the port check reads it.
	if err := os.Remove(filepath.Join(b.Dir, "pgbouncer.log")); err != nil && !os.IsNotExist(err) {
		return err
	}
	argv := []string{bin, filepath.Join(b.Dir, "pgbouncer.ini")}
	if pg.cred != nil {
		if err := os.Chmod(b.Dir, 0o755); err != nil {
			return err
		}
		if err := pg.chown(b.Dir); err != nil {
			return err
		}
		// setpriv execs pgbouncer: the process's pid is pgbouncer's, whose CPU and memory a
		// benchmark reads from /proc.
		argv = append([]string{"setpriv", "--reuid=" + strconv.Itoa(int(pg.cred.Uid)),
			"--regid=" + strconv.Itoa(int(pg.cred.Gid)), "--clear-groups", "--"}, argv...)
	}
	proc, err := LaunchProcess(b.Dir, "pgbouncer", argv, nil)
	if err != nil {
		return err
	}
	b.Process = proc
	wait := &ProxyProcess{Process: proc, Host: b.Host, Port: port}
	return wait.WaitListeningContext(ctx)
}

// Addr is host:port.
func (b *PgBouncer) Addr() string { return b.Host + ":" + strconv.Itoa(b.Port) }

// Close stops pgbouncer and removes its folder.
func (b *PgBouncer) Close() {
	if b.Process != nil {
		b.Process.Close()
	}
	_ = os.RemoveAll(b.Dir)
}

func (b *PgBouncer) logText() string {
	if b.Process == nil {
		return ""
	}
	text, err := os.ReadFile(b.LogFile)
	if err != nil {
		return ""
	}
	return string(text)
}
