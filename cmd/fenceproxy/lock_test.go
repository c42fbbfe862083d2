package main_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// lockSetup is what the tests of `fenceproxy lock` share: the binary, a PostgreSQL with the
// fence schema and a writes table, a proxy fencing resource billing, a connection to the
// database, and an environment whose PATH has psql.
func lockSetup(t *testing.T) (bin string, pg *testenv.Postgres, px *testenv.Proxy, conn *pgx.Conn, env []string) {
	t.Helper()
	bin = buildBinary(t)
	pg = testenv.StartPostgres(t)
	admin := pg.AdminURL()
	testenv.Migrate(t, admin)
	pg.Exec(t, "CREATE TABLE writes (token bigint NOT NULL, store text NOT NULL)")
	px = testenv.StartProxy(t, pg, proxy.Config{Resources: []string{"billing"}, ControlDatabase: admin})
	conn = testenv.Connect(t, admin)
	env = append(os.Environ(), "PATH="+filepath.Dir(pg.Bin("psql"))+":"+os.Getenv("PATH"))
	return bin, pg, px, conn, env
}

// TestLockPostgres runs `fenceproxy lock --store postgres` end to end with nothing but
// PostgreSQL and the proxy: the child gets its generation as FENCE_TOKEN and a DATABASE_URL
// through the proxy, writes with it, and the lease is released when it exits; a lease taken
// over while the child runs stops the child and, with --on-lost exit, the command.
func TestLockPostgres(t *testing.T) {
	bin, pg, px, conn, env := lockSetup(t)
	admin := pg.AdminURL()

	lock := func(ctx context.Context, dir, holder, script string) *exec.Cmd {
		cmd := exec.CommandContext(ctx, bin, "lock", "--store", "postgres", "--database", admin,
			"--resource", "billing", "--holder", holder, "--ttl", "2s", "--grace", "2s", "--on-lost", "exit",
			"--database-url", px.URL(testenv.AdminUser, "postgres"), "--", "/bin/sh", "-c", script)
		cmd.Env = append(env, "DIR="+dir)
		return cmd
	}

	t.Run("the child writes with its generation; the lease is released after it exits", func(t *testing.T) {
		dir := t.TempDir()
		out, err := lock(t.Context(), dir, "one",
			`psql "$DATABASE_URL" -X -q -v ON_ERROR_STOP=1 -c "INSERT INTO writes VALUES ($FENCE_TOKEN, '$FENCE_STORE')" && env > "$DIR/env"`).CombinedOutput()
		if err != nil {
			t.Fatalf("fenceproxy lock: %v\n%s", err, out)
		}
		b, _ := os.ReadFile(filepath.Join(dir, "env"))
		childEnv := map[string]string{}
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, "="); ok {
				childEnv[k] = v
			}
		}
		var generation int64
		var holder *string
		if err := conn.QueryRow(t.Context(), "SELECT generation, holder FROM fence.leases WHERE resource = 'billing'").Scan(&generation, &holder); err != nil {
			t.Fatal(err)
		}
		if holder != nil {
			t.Errorf("lease still held by %q after the child exited", *holder)
		}
		if childEnv["FENCE_TOKEN"] != strconv.FormatInt(generation, 10) || childEnv["FENCE_STORE"] != "postgres" ||
			childEnv["FENCE_SESSION"] != "one" || childEnv["FENCE_KEY"] != "fence.leases/billing" {
			t.Errorf("child env: FENCE_TOKEN=%q (generation %d) FENCE_STORE=%q FENCE_SESSION=%q FENCE_KEY=%q",
				childEnv["FENCE_TOKEN"], generation, childEnv["FENCE_STORE"], childEnv["FENCE_SESSION"], childEnv["FENCE_KEY"])
		}
		if u := childEnv["DATABASE_URL"]; !strings.Contains(u, "fence.token%3D"+childEnv["FENCE_TOKEN"]) || strings.Contains(u, "fence.session") {
			t.Errorf("DATABASE_URL %q: want fence.token=%s and no fence.session", u, childEnv["FENCE_TOKEN"])
		}
		var n int
		if err := conn.QueryRow(t.Context(), "SELECT count(*) FROM writes WHERE token = $1 AND store = 'postgres'", generation).Scan(&n); err != nil || n != 1 {
			t.Errorf("rows written with generation %d: %d, %v; want 1", generation, n, err)
		}
		if !strings.Contains(string(out), `"store":"postgres"`) {
			t.Errorf("the logs do not name the store:\n%s", out)
		}
	})

	t.Run("a takeover stops the child and the command", func(t *testing.T) {
		dir := t.TempDir()
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
		defer cancel()
		cmd := lock(ctx, dir, "two", `echo $$ > "$DIR/pid"; exec sleep 60`)
		var out syncBuffer // read while the command writes it
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		var pid int
		eventually(t, 20*time.Second, "the child starts", func() error {
			b, _ := os.ReadFile(filepath.Join(dir, "pid"))
			if pid, _ = strconv.Atoi(strings.TrimSpace(string(b))); pid == 0 {
				return errors.New(out.String())
			}
			return nil
		})
		var generation int64
		if err := conn.QueryRow(t.Context(), "SELECT generation FROM fence.leases WHERE resource = 'billing'").Scan(&generation); err != nil {
			t.Fatal(err)
		}
		// Another process takes the lease over.
		if _, err := conn.Exec(t.Context(), "SELECT fence.lease_release('billing', 'two', $1)", generation); err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Exec(t.Context(), "SELECT * FROM fence.lease_acquire('billing', 'thief', '10 seconds')"); err != nil {
			t.Fatal(err)
		}
		err := cmd.Wait()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 1 {
			t.Fatalf("fenceproxy lock after the takeover: %v, want exit status 1\n%s", err, out.String())
		}
		if !strings.Contains(out.String(), "lost leadership") || !strings.Contains(out.String(), "taken over by thief") {
			t.Errorf("the output does not say the lease was taken over:\n%s", out.String())
		}
		// One log line says the lock is lost and why (the exit message says it again, once).
		n := 0
		for _, line := range strings.Split(out.String(), "\n") {
			if strings.HasPrefix(line, "{") && strings.Contains(line, "lock lost") {
				n++
			}
		}
		if n != 1 {
			t.Errorf("%d log lines say \"lock lost\", want one:\n%s", n, out.String())
		}
		if !strings.Contains(out.String(), "child exited (") {
			t.Errorf("the output does not say how the child exited:\n%s", out.String())
		}
		if syscall.Kill(pid, 0) == nil {
			t.Errorf("child %d still running", pid)
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	})

	t.Run("the watchdog stops a stuck command and gives up the lease", func(t *testing.T) {
		dir := t.TempDir()
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, bin, "lock", "--store", "postgres", "--database", admin,
			"--resource", "watched", "--holder", "stuck", "--grace", "2s",
			"--watchdog-file", filepath.Join(dir, "progress"), "--watchdog-timeout", "1s",
			"--", "/bin/sh", "-c", `touch "$FENCE_WATCHDOG_FILE"; exec sleep 600`)
		cmd.Env = env
		out, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 124 {
			t.Fatalf("fenceproxy lock with a stuck command: %v, want exit status 124\n%s", err, out)
		}
		if !strings.Contains(string(out), "watchdog: the child made no progress") {
			t.Errorf("no watchdog log line:\n%s", out)
		}
		var holder *string
		if err := conn.QueryRow(t.Context(), "SELECT holder FROM fence.leases WHERE resource = 'watched'").Scan(&holder); err != nil || holder != nil {
			t.Errorf("lease holder after the watchdog fired: %v %v, want released", holder, err)
		}
		if out, err := exec.Command(bin, "lock", "--store", "postgres", "--database", admin, "--resource", "watched",
			"--watchdog-file", filepath.Join(dir, "progress"), "--", "true").CombinedOutput(); err == nil || !strings.Contains(string(out), "needs --watchdog-timeout") {
			t.Errorf("--watchdog-file without --watchdog-timeout: %v\n%s", err, out)
		}
	})

	t.Run("a database without the lease fails at once", func(t *testing.T) {
		pg.Exec(t, "CREATE DATABASE bare")
		bare := pg.URLWithPassword(testenv.AdminUser, testenv.AdminPassword, "bare")
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer cancel()
		started := time.Now()
		out, err := exec.CommandContext(ctx, bin, "lock", "--store", "postgres", "--database", bare,
			"--resource", "billing", "--", "true").CombinedOutput()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 1 || !strings.Contains(string(out), "campaign refused") ||
			!strings.Contains(string(out), "run fenceproxy migrate") {
			t.Errorf("lock on a database without migration 5: %v after %v\n%s", err, time.Since(started), out)
		}
	})

	t.Run("--store postgres needs --database", func(t *testing.T) {
		out, err := exec.Command(bin, "lock", "--store", "postgres", "--resource", "billing", "--", "true").CombinedOutput()
		if err == nil || !strings.Contains(string(out), "needs --database") {
			t.Errorf("lock --store postgres without --database: %v\n%s", err, out)
		}
	})
}

// TestLockSupervisorKilled: SIGKILL of the `fenceproxy lock` supervisor stops its child at
// once (Linux's parent-death signal), instead of leaving it writing with its token until the
// next holder fences it.
func TestLockSupervisorKilled(t *testing.T) {
	t.Parallel()
	bin := buildBinary(t)
	pg := testenv.StartPostgres(t)
	admin := pg.AdminURL()
	testenv.Migrate(t, admin)
	dir := t.TempDir()
	pidFile := filepath.Join(dir, "pid")
	cmd := exec.Command(bin, "lock", "--store", "postgres", "--database", admin, "--resource", "billing",
		"--ttl", "5s", "--", "/bin/sh", "-c", `echo $$ > "$PIDFILE.tmp" && mv "$PIDFILE.tmp" "$PIDFILE" && exec sleep 300`)
	cmd.Env = append(os.Environ(), "PIDFILE="+pidFile)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	var child int
	eventually(t, 60*time.Second, "the child starts", func() error {
		b, err := os.ReadFile(pidFile)
		if err == nil {
			child, _ = strconv.Atoi(strings.TrimSpace(string(b)))
		}
		if child == 0 {
			return fmt.Errorf("no pid: %v", err)
		}
		return nil
	})
	t.Cleanup(func() { _ = syscall.Kill(child, syscall.SIGKILL) })
	if !running(child) {
		t.Fatalf("child %d not running", child)
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	eventually(t, 30*time.Second, fmt.Sprintf("child %d ends after its supervisor was killed", child), func() error {
		if running(child) {
			return errors.New("still running")
		}
		return nil
	})
}

// running reports whether process pid exists and is not a zombie (a reaper that does not reap
// leaves the dead child listed).
func running(pid int) bool {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return false
	}
	// pid (comm) state ...: the state follows the last ')'.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i >= 0 && i+2 < len(s) && s[i+2] != 'Z' && s[i+2] != 'X'
}

// TestConsulMisconfigured: a wrong scheme or a dead Consul port makes `fenceproxy serve` exit at
// start with the cause (instead of logging a warning and refusing every session), and
// `fenceproxy lock` stops campaigning on a refusal that retrying cannot change.
func TestConsulMisconfigured(t *testing.T) {
	t.Parallel()
	bin := buildBinary(t)
	c := testenv.StartConsul(t)
	keyFile := filepath.Join(t.TempDir(), "proxy.key")
	if err := fence.WriteKeyFile(keyFile, testenv.Key); err != nil {
		t.Fatal(err)
	}
	dead := "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t))
	run := func(args ...string) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		out, err := exec.CommandContext(ctx, bin, args...).CombinedOutput()
		if ctx.Err() != nil {
			t.Fatalf("%v still running after 60 s:\n%s", args, out)
		}
		return string(out), err
	}
	serve := func(consul string, more ...string) []string {
		return append([]string{"serve", "--upstream", "postgres://127.0.0.1:1", "--listen", "127.0.0.1:0",
			"--resource", "billing=locks/billing", "--key-file", keyFile, "--consul-addr", consul}, more...)
	}
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"serve, https to an http port", serve("https://" + c.Addr), "HTTP response to HTTPS client"},
		{"serve, dead port", serve(dead, "--consul-start-timeout", "2s"), "consul did not answer"},
		{"lock, https to an http port", []string{"lock", "--resource", "billing", "--consul-addr", "https://" + c.Addr, "--", "true"},
			"campaign refused"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := run(tc.args...)
			var ee *exec.ExitError
			if !errors.As(err, &ee) || !strings.Contains(out, tc.want) {
				t.Fatalf("want a failed exit saying %q; got %v:\n%s", tc.want, err, out)
			}
			t.Logf("exit %d: %s", ee.ExitCode(), lastLine(out))
		})
	}
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}
