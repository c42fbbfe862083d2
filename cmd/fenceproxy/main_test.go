package main_test

import (
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// buildBinary builds fenceproxy once per test binary run.
func buildBinary(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "fenceproxy")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

func freeAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

func waitListening(t *testing.T, addr string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("nothing listens on %s", addr)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestServeBinary runs the real binary: configuration from a file, the
// environment and flags (flag over file over environment), a session
// through it, migrate, and SIGTERM: the session in a transaction may finish,
// then the process exits 0.
func TestServeBinary(t *testing.T) {
	bin := buildBinary(t)
	pg := testenv.StartPostgres(t)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()

	out, err := exec.CommandContext(ctx, bin, "migrate", "--database", pg.AdminURL()).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "applied migration 1") {
		t.Fatalf("migrate: %v\n%s", err, out)
	}
	out, err = exec.CommandContext(ctx, bin, "migrate", "--database", pg.AdminURL()).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "up to date") {
		t.Fatalf("migrate again: %v\n%s", err, out)
	}

	addr := freeAddr(t)
	cfg := filepath.Join(t.TempDir(), "fenceproxy.json")
	os.WriteFile(cfg, []byte(`{"listen": "127.0.0.1:1", "resource": ["billing"], "unfenced": "reject", "shutdown-grace": "20s"}`), 0o600) //nolint:errcheck
	cmd := exec.CommandContext(ctx, bin, "serve", "--config", cfg, "--listen", addr, "--log-format", "console")
	cmd.Env = append(os.Environ(),
		"FENCEPROXY_UPSTREAM=postgres://"+net.JoinHostPort(pg.Host, strconv.Itoa(pg.Port)),
		"FENCEPROXY_UNFENCED=allow", // the file says reject, and wins
	)
	var logs strings.Builder
	cmd.Stderr = &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waitListening(t, addr)

	url := "postgres://postgres:postgres@" + addr + "/postgres?sslmode=disable"
	if _, err := pgx.Connect(ctx, url); err == nil {
		t.Fatal("a session without a token was admitted: the config file's unfenced=reject was not applied")
	}
	conn, err := pgx.Connect(ctx, url+"&fence.resource=billing&fence.token=3")
	if err != nil {
		t.Fatalf("fenced session: %v\n%s", err, logs.String())
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "CREATE TABLE bin_test (x int)"); err != nil {
		t.Fatal(err)
	}
	// SIGTERM while the session is inside a transaction: it may still commit.
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if _, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		t.Error("still accepting connections after SIGTERM")
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("commit during the grace period: %v", err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		var ee *exec.ExitError
		if errors.As(err, &ee) || err != nil {
			t.Fatalf("exit: %v\n%s", err, logs.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("did not exit after SIGTERM\n%s", logs.String())
	}
	if !strings.Contains(logs.String(), "fenceproxy stopped") {
		t.Errorf("no shutdown log line:\n%s", logs.String())
	}
}

// TestUsageErrors: bad flags and configuration fail with exit status 2 or
// 1 and a message, never a panic.
func TestUsageErrors(t *testing.T) {
	bin := buildBinary(t)
	tests := []struct {
		name string
		args []string
		code int
		msg  string
	}{
		{"unknown flag", []string{"serve", "--nope"}, 2, "unknown flag"},
		{"missing upstream", []string{"serve"}, 2, "upstream"},
		{"bad resource", []string{"serve", "--upstream", "postgres://127.0.0.1:1", "--resource", "Bad Name"}, 1, "resource"},
		{"bad unfenced", []string{"serve", "--upstream", "postgres://127.0.0.1:1", "--unfenced", "sometimes"}, 2, "unfenced"},
		{"upstream with a database", []string{"serve", "--upstream", "postgres://127.0.0.1:1/app"}, 1, "user and database come from each client"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, err := exec.Command(bin, tt.args...).CombinedOutput()
			var ee *exec.ExitError
			if !errors.As(err, &ee) || ee.ExitCode() != tt.code {
				t.Fatalf("exit %v, want %d\n%s", err, tt.code, out)
			}
			if !strings.Contains(strings.ToLower(string(out)), strings.ToLower(tt.msg)) {
				t.Fatalf("output does not mention %q:\n%s", tt.msg, out)
			}
		})
	}
}
