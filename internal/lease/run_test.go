package lease_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/lease/consul"
	"github.com/fenceproxy/fenceproxy/internal/lease/leasetest"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// runLocked runs lease.RunLocked in the background; the returned channel gets its result.
func runLocked(t *testing.T, ctx context.Context, cfg lease.RunConfig) <-chan error {
	t.Helper()
	var out bytes.Buffer
	if cfg.Stdout == nil {
		cfg.Stdout, cfg.Stderr = &out, &out
	}
	res := make(chan error, 1)
	go func() { res <- lease.RunLocked(ctx, cfg) }()
	return res
}

// waitFile waits until path exists with content satisfying ok, and returns the content.
func waitFile(t *testing.T, path string, ok func(string) bool) string {
	t.Helper()
	var content string
	leasetest.Eventually(t, leasetest.WaitTimeout, filepath.Base(path)+" as expected", func() error {
		b, err := os.ReadFile(path)
		if content = string(b); err == nil && !ok(content) {
			err = fmt.Errorf("content %q", content)
		}
		return err
	})
	return content
}

func nonEmpty(s string) bool { return strings.TrimSpace(s) != "" }

func result(t *testing.T, res <-chan error, timeout time.Duration) error {
	t.Helper()
	select {
	case err := <-res:
		return err
	case <-time.After(timeout):
		t.Fatalf("RunLocked did not return within %v", timeout)
		return nil
	}
}

// alive reports whether a process exists (and is not a zombie we could not reap: the
// grandchildren here are reparented to init, which reaps them).
func alive(pid int) bool {
	if syscall.Kill(pid, 0) != nil {
		return false
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	return err == nil && !strings.Contains(string(b), ") Z ")
}

func TestRunLocked(t *testing.T) {
	t.Parallel()
	c := testenv.StartConsul(t)
	client := c.Client(t)
	base := func(resource, dir string, script string) lease.RunConfig {
		return lease.RunConfig{
			Store:    &consul.Store{Client: client},
			Resource: resource,
			Command:  []string{"/bin/sh", "-c", script},
			Env:      []string{"PATH=" + os.Getenv("PATH"), "DIR=" + dir, "FENCE_TOKEN=stale-from-parent"},
			Grace:    2 * time.Second,
		}
	}

	t.Run("child gets its token and URL; lock released after it exits", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		cfg := base("billing", dir, `env > "$DIR/env"`)
		cfg.DatabaseURL = "postgres://app@127.0.0.1:7432/app?sslmode=disable&options=-c%20search_path%3Dapp%20-c%20fence.token%3D1"
		if err := result(t, runLocked(t, leasetest.Ctx(t), cfg), leasetest.WaitTimeout); err != nil {
			t.Fatalf("RunLocked: %v", err)
		}
		env := map[string]string{}
		b, _ := os.ReadFile(filepath.Join(dir, "env"))
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, "="); ok {
				env[k] = v
			}
		}
		p := leasetest.ReadKey(t, client, "locks/billing")
		if p == nil || p.Session != "" {
			t.Fatalf("lock after the child exited: %+v, want released", p)
		}
		token := strconv.FormatUint(p.LockIndex, 10)
		if env["FENCE_RESOURCE"] != "billing" || env["FENCE_TOKEN"] != token || env["FENCE_KEY"] != "locks/billing" || env["FENCE_SESSION"] == "" {
			t.Errorf("child env: FENCE_RESOURCE=%q FENCE_TOKEN=%q (LockIndex %s) FENCE_KEY=%q FENCE_SESSION=%q",
				env["FENCE_RESOURCE"], env["FENCE_TOKEN"], token, env["FENCE_KEY"], env["FENCE_SESSION"])
		}
		pc, err := pgconn.ParseConfig(env["DATABASE_URL"])
		if err != nil {
			t.Fatalf("DATABASE_URL %q: %v", env["DATABASE_URL"], err)
		}
		want := "-c search_path=app -c fence.resource=billing -c fence.token=" + token + " -c fence.session=" + env["FENCE_SESSION"]
		if got := pc.RuntimeParams["options"]; got != want {
			t.Errorf("options = %q, want %q", got, want)
		}
		// The session is destroyed too, not left to expire.
		if info, _, _ := client.Session().Info(env["FENCE_SESSION"], nil); info != nil {
			t.Errorf("session still exists after the child exited")
		}
	})

	t.Run("exit status is the child's", func(t *testing.T) {
		t.Parallel()
		for _, tt := range []struct {
			script string
			code   int
		}{{"exit 3", 3}, {"kill -KILL $$", 128 + 9}, {"exit 0", 0}} {
			cfg := base("status-"+strconv.Itoa(tt.code), t.TempDir(), tt.script)
			err := result(t, runLocked(t, leasetest.Ctx(t), cfg), leasetest.WaitTimeout)
			var ec interface{ ExitCode() int }
			switch {
			case tt.code == 0 && err != nil:
				t.Errorf("%s: %v, want nil", tt.script, err)
			case tt.code != 0 && (!errors.As(err, &ec) || ec.ExitCode() != tt.code):
				t.Errorf("%s: %v, want exit code %d", tt.script, err, tt.code)
			}
		}
	})

	t.Run("lost leadership stops the child's process group", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		// A grandchild in the group, and a TERM trap that records the signal.
		cfg := base("lost", dir, `echo "$FENCE_SESSION" > "$DIR/session"
			sleep 30 & echo $! > "$DIR/grandchild"
			trap 'echo term > "$DIR/term"; exit 0' TERM
			wait`)
		cfg.OnLost = lease.OnLostExit
		res := runLocked(t, leasetest.Ctx(t), cfg)
		session := strings.TrimSpace(waitFile(t, filepath.Join(dir, "session"), nonEmpty))
		grandchild, _ := strconv.Atoi(strings.TrimSpace(waitFile(t, filepath.Join(dir, "grandchild"), nonEmpty)))
		start := time.Now()
		if _, err := client.Session().Destroy(session, nil); err != nil {
			t.Fatal(err)
		}
		err := result(t, res, leasetest.WaitTimeout)
		t.Logf("lost leadership -> child stopped and RunLocked returned in %v: %v", time.Since(start).Round(time.Millisecond), err)
		if !errors.Is(err, lease.ErrLockLost) {
			t.Errorf("RunLocked = %v, want ErrLockLost", err)
		}
		if _, err := os.Stat(filepath.Join(dir, "term")); err != nil {
			t.Errorf("child did not get SIGTERM: %v", err)
		}
		if alive(grandchild) {
			t.Errorf("grandchild %d still running", grandchild)
			_ = syscall.Kill(grandchild, syscall.SIGKILL)
		}
	})

	t.Run("a child that fails as its lock is lost ends as lost leadership", func(t *testing.T) {
		t.Parallel()
		// As a frozen supervisor and child wake together: the child's write fails on its
		// stale token and it exits 3 while the supervisor learns the lock is lost. --on-lost
		// decides, whichever comes first (a newcomer saw exit 3 or a new campaign by timing).
		dir := t.TempDir()
		cfg := base("fails-as-lost", dir, `echo "$FENCE_SESSION" > "$DIR/session"
			while [ ! -f "$DIR/go" ]; do sleep 0.01; done; touch "$DIR/exiting"; exit 3`)
		cfg.OnLost = lease.OnLostExit
		res := runLocked(t, leasetest.Ctx(t), cfg)
		session := strings.TrimSpace(waitFile(t, filepath.Join(dir, "session"), nonEmpty))
		if err := os.WriteFile(filepath.Join(dir, "go"), nil, 0o644); err != nil {
			t.Fatal(err)
		}
		waitFile(t, filepath.Join(dir, "exiting"), func(string) bool { return true }) // the child exits first
		if _, err := client.Session().Destroy(session, nil); err != nil {
			t.Fatal(err)
		}
		if err := result(t, res, leasetest.WaitTimeout); !errors.Is(err, lease.ErrLockLost) {
			t.Errorf("RunLocked = %v, want ErrLockLost (--on-lost exit)", err)
		}
	})

	t.Run("SIGKILL after the grace period", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		cfg := base("stubborn", dir, `trap '' TERM; echo "$FENCE_SESSION" > "$DIR/session"
			while :; do sleep 0.05; done`)
		cfg.OnLost = lease.OnLostExit
		cfg.Grace = 500 * time.Millisecond
		res := runLocked(t, leasetest.Ctx(t), cfg)
		session := strings.TrimSpace(waitFile(t, filepath.Join(dir, "session"), nonEmpty))
		start := time.Now()
		if _, err := client.Session().Destroy(session, nil); err != nil {
			t.Fatal(err)
		}
		err := result(t, res, leasetest.WaitTimeout)
		took := time.Since(start)
		if !errors.Is(err, lease.ErrLockLost) || took < cfg.Grace {
			t.Errorf("RunLocked = %v after %v, want ErrLockLost after the %v grace", err, took, cfg.Grace)
		}
	})

	t.Run("retry: campaign again and restart the child with the next token", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		cfg := base("retry", dir, `echo "$FENCE_TOKEN" >> "$DIR/tokens"; echo "$FENCE_SESSION" > "$DIR/session"
			exec sleep 30`)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		res := runLocked(t, ctx, cfg)
		first := strings.TrimSpace(waitFile(t, filepath.Join(dir, "tokens"), nonEmpty))
		session := strings.TrimSpace(waitFile(t, filepath.Join(dir, "session"), nonEmpty))
		if _, err := client.Session().Destroy(session, nil); err != nil {
			t.Fatal(err)
		}
		tokens := waitFile(t, filepath.Join(dir, "tokens"), func(s string) bool { return strings.Count(s, "\n") >= 2 })
		f := strings.Fields(tokens)
		t1, _ := strconv.Atoi(first)
		if t2, _ := strconv.Atoi(f[1]); t2 != t1+1 {
			t.Errorf("tokens %q, want consecutive", tokens)
		}
		cancel()
		err := result(t, res, leasetest.WaitTimeout)
		var ec interface{ ExitCode() int }
		if !errors.As(err, &ec) || ec.ExitCode() != 128+int(syscall.SIGTERM) {
			t.Errorf("RunLocked after cancel = %v, want the child's SIGTERM status", err)
		}
		if p := leasetest.ReadKey(t, client, "locks/retry"); p.Session != "" {
			t.Errorf("lock not released: %+v", p)
		}
	})

	t.Run("the lock is released only after the child exited", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		marker := filepath.Join(dir, "exited")
		// The child takes a while to stop, and leaves a marker just before it exits.
		cfg := base("graceful", dir, `trap 'sleep 1; echo bye > "$DIR/exited"; exit 0' TERM
			echo started > "$DIR/started"
			sleep 30 & wait`)
		var releasedBeforeExit, sawRelease atomic.Bool
		_, rec := leasetest.Watch(t, client, consul.WatcherConfig{Keys: []string{"locks/graceful"}, OnChange: func(s consul.State) {
			if s.Known && s.Exists && !s.Held {
				sawRelease.Store(true)
				if _, err := os.Stat(marker); err != nil {
					releasedBeforeExit.Store(true)
				}
			}
		}})
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		res := runLocked(t, ctx, cfg)
		waitFile(t, filepath.Join(dir, "started"), nonEmpty)
		rec.WaitFor(t, "held", func(s consul.State) bool { return s.Held })
		start := time.Now()
		cancel() // what SIGTERM to `fenceproxy lock` does
		if err := result(t, res, leasetest.WaitTimeout); err != nil {
			t.Errorf("RunLocked = %v, want nil (the child exited 0)", err)
		}
		took := time.Since(start)
		rec.WaitFor(t, "released", func(s consul.State) bool { return s.Known && !s.Held })
		if !sawRelease.Load() || releasedBeforeExit.Load() {
			t.Errorf("lock released before the child exited")
		}
		if took < time.Second {
			t.Errorf("RunLocked returned %v after cancel, before the child's 1 s shutdown", took)
		}
	})

	t.Run("what the child left running is stopped before the release", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		cfg := base("stragglers", dir, `sleep 30 & echo $! > "$DIR/grandchild"; exit 0`)
		if err := result(t, runLocked(t, leasetest.Ctx(t), cfg), leasetest.WaitTimeout); err != nil {
			t.Errorf("RunLocked = %v, want nil", err)
		}
		grandchild, _ := strconv.Atoi(strings.TrimSpace(waitFile(t, filepath.Join(dir, "grandchild"), nonEmpty)))
		if alive(grandchild) {
			t.Errorf("grandchild %d still running after RunLocked returned", grandchild)
			_ = syscall.Kill(grandchild, syscall.SIGKILL)
		}
		if p := leasetest.ReadKey(t, client, "locks/stragglers"); p.Session != "" {
			t.Errorf("lock not released: %+v", p)
		}
	})

	t.Run("the exited child keeps its group's id until its group is stopped", func(t *testing.T) {
		t.Parallel()
		if runtime.GOOS != "linux" {
			t.Skip("the child's group id is pinned on Linux only (waitid WNOWAIT)")
		}
		// The child exits at once and leaves a process that ignores SIGTERM: the group is
		// stopped by SIGKILL after the 2 s grace period. All that time the child must stay
		// an unreaped zombie, so that its pid (the group's id) is not reused by a new
		// process that a signal to the group would then reach.
		dir := t.TempDir()
		cfg := base("pinned", dir, `(trap '' TERM; exec sleep 30) & echo $! > "$DIR/grandchild"; echo $$ > "$DIR/leader"; exit 0`)
		res := runLocked(t, leasetest.Ctx(t), cfg)
		leader, _ := strconv.Atoi(strings.TrimSpace(waitFile(t, filepath.Join(dir, "leader"), nonEmpty)))
		grandchild, _ := strconv.Atoi(strings.TrimSpace(waitFile(t, filepath.Join(dir, "grandchild"), nonEmpty)))
		leasetest.Eventually(t, leasetest.WaitTimeout, fmt.Sprintf("the child %d exits", leader), func() error {
			b, err := os.ReadFile("/proc/" + strconv.Itoa(leader) + "/stat")
			if err != nil {
				t.Fatalf("the exited child %d was reaped while its group still ran (grandchild alive: %v)", leader, alive(grandchild))
			}
			if !strings.Contains(string(b), ") Z ") {
				return errors.New("not a zombie")
			}
			return nil
		})
		if !alive(grandchild) {
			t.Fatalf("the grandchild %d ended before the grace period; the test needs it to ignore SIGTERM", grandchild)
		}
		if err := result(t, res, leasetest.WaitTimeout); err != nil {
			t.Errorf("RunLocked = %v, want nil", err)
		}
		if alive(grandchild) {
			t.Errorf("grandchild %d still running after RunLocked returned", grandchild)
			_ = syscall.Kill(grandchild, syscall.SIGKILL)
		}
		if _, err := os.Stat("/proc/" + strconv.Itoa(leader)); err == nil {
			t.Errorf("the child %d was not reaped after its group stopped", leader)
		}
	})

	t.Run("invalid configurations", func(t *testing.T) {
		t.Parallel()
		for _, cfg := range []lease.RunConfig{
			{Resource: "x", Command: []string{"true"}},
			{Store: &consul.Store{Client: client}, Command: []string{"true"}},
			{Store: &consul.Store{Client: client}, Resource: "x"},
			{Store: &consul.Store{Client: client}, Resource: "x", Command: []string{"true"}, OnLost: "later"},
			{Store: &consul.Store{Client: client}, Resource: "x", Command: []string{"true"}, DatabaseURL: "host=db dbname=app"},
			{Store: &consul.Store{Client: client}, Resource: "x", Command: []string{"no-such-command-here"}},
		} {
			if err := lease.RunLocked(leasetest.Ctx(t), cfg); err == nil {
				t.Errorf("RunLocked(%+v) = nil", cfg)
			}
		}
	})
}

func TestFencedURL(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, base string
		session    string
		wantURL    string // "" : not checked
		wantOpts   string // options as pgx decodes them
		wantErr    bool
	}{
		{
			name:     "no query",
			base:     "postgres://app@127.0.0.1:7432/app",
			wantURL:  "postgres://app@127.0.0.1:7432/app?options=-c%20fence.resource%3Dbilling%20-c%20fence.token%3D34",
			wantOpts: "-c fence.resource=billing -c fence.token=34",
		},
		{
			name:     "other parameters kept byte for byte",
			base:     "postgresql://app:p%40ss@127.0.0.1:7432/app?sslmode=disable&application_name=a+b",
			session:  "0c7a",
			wantURL:  "postgresql://app:p%40ss@127.0.0.1:7432/app?sslmode=disable&application_name=a+b&options=-c%20fence.resource%3Dbilling%20-c%20fence.token%3D34%20-c%20fence.session%3D0c7a",
			wantOpts: "-c fence.resource=billing -c fence.token=34 -c fence.session=0c7a",
		},
		{
			name:     "existing options merged, old fence settings replaced",
			base:     "postgres://h/db?options=-c%20search_path%3Dapp%20-cfence.token%3D1%20--fence.resource%3Dold",
			wantOpts: "-c search_path=app -c fence.resource=billing -c fence.token=34",
		},
		{
			name:     "escaped space inside an existing option",
			base:     `postgres://h/db?options=-c%20application_name%3Da%5C%20b`,
			wantOpts: `-c application_name=a\ b -c fence.resource=billing -c fence.token=34`,
		},
		{
			name:    "multi-host URL and fragment",
			base:    "postgres://h1:5432,h2:5432/db?target_session_attrs=read-write#x",
			wantURL: "postgres://h1:5432,h2:5432/db?target_session_attrs=read-write&options=-c%20fence.resource%3Dbilling%20-c%20fence.token%3D34#x",
		},
		{name: "keyword/value string", base: "host=h dbname=db", wantErr: true},
		{name: "other scheme", base: "mysql://h/db", wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := lease.FencedURL(tt.base, "billing", 34, tt.session)
			if tt.wantErr {
				if err == nil {
					t.Errorf("FencedURL = %q, want an error", got)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if tt.wantURL != "" && got != tt.wantURL {
				t.Errorf("FencedURL =\n  %s\nwant\n  %s", got, tt.wantURL)
			}
			if tt.wantOpts != "" {
				pc, err := pgconn.ParseConfig(got)
				if err != nil {
					t.Fatalf("pgx cannot parse %q: %v", got, err)
				}
				if pc.RuntimeParams["options"] != tt.wantOpts {
					t.Errorf("options = %q, want %q", pc.RuntimeParams["options"], tt.wantOpts)
				}
			}
		})
	}
}

// TestFencedURLReachesPostgres connects with the URL through libpq (psql) and pgx to a
// real PostgreSQL, which takes fence.* as placeholder settings: what the server (or the
// proxy in front of it) receives is exactly the fence parameters.
func TestFencedURLReachesPostgres(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPostgres(t)
	base := pg.AdminURL()
	if strings.Contains(base, "?") {
		base += "&options=-c%20search_path%3Dpublic"
	} else {
		base += "?options=-c%20search_path%3Dpublic"
	}
	u, err := lease.FencedURL(base, "billing", 34, "0c7a-session")
	if err != nil {
		t.Fatal(err)
	}
	const query = "SELECT current_setting('fence.resource') || '|' || current_setting('fence.token') || '|' || " +
		"current_setting('fence.session') || '|' || current_setting('search_path')"
	const want = "billing|34|0c7a-session|public"

	out, err := exec.Command(pg.Bin("psql"), "-X", "-A", "-t", "-d", u, "-c", query).CombinedOutput()
	if err != nil {
		t.Fatalf("psql (libpq) with %s: %v: %s", u, err, out)
	}
	if got := strings.TrimSpace(string(out)); got != want {
		t.Errorf("libpq: server saw %q, want %q", got, want)
	}

	conn, err := pgx.Connect(leasetest.Ctx(t), u)
	if err != nil {
		t.Fatalf("pgx with %s: %v", u, err)
	}
	defer conn.Close(context.Background())
	var got string
	if err := conn.QueryRow(leasetest.Ctx(t), query).Scan(&got); err != nil {
		t.Fatal(err)
	}
	if got != want {
		t.Errorf("pgx: server saw %q, want %q", got, want)
	}
}
