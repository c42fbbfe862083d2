package main_test

import (
	"context"
	"errors"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestServeChecksKeyFile: a --key-file that is not the key fenceproxy migrate stored fails
// serve at start when it has a control database (exit 1, naming the file, the database and
// what to do), as does a database with no key stored; the stored key starts it; without a
// control database serve cannot log in at start, so it starts, and the first fenced session
// is refused with ZF010 naming the key file and what to do.
func TestServeChecksKeyFile(t *testing.T) {
	bin := buildBinary(t)
	pg := testenv.StartPostgres(t)
	testenv.Migrate(t, pg.AdminURL()) // the fence schema and testenv.Key in database postgres
	pg.Exec(t, "CREATE DATABASE nokey")
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	if _, err := fence.Migrate(ctx, pg.URLWithPassword(testenv.AdminUser, testenv.AdminPassword, "nokey")); err != nil {
		t.Fatal(err) // the schema without a key
	}
	dir := t.TempDir()
	right, wrong := filepath.Join(dir, "right.key"), filepath.Join(dir, "wrong.key")
	if err := fence.WriteKeyFile(right, testenv.Key); err != nil {
		t.Fatal(err)
	}
	if err := fence.WriteKeyFile(wrong, fence.Key(strings.Repeat("w", 32))); err != nil {
		t.Fatal(err)
	}
	serve := func(t *testing.T, keyFile string, args ...string) (*exec.Cmd, *syncBuffer, string) {
		t.Helper()
		addr := freeAddr(t)
		argv := append([]string{"serve", "--listen", addr, "--upstream", "postgres://" + net.JoinHostPort(pg.Host, strconv.Itoa(pg.Port)),
			"--resource", "billing", "--key-file", keyFile, "--log-format", "console"}, args...)
		cmd := exec.CommandContext(ctx, bin, argv...)
		out := &syncBuffer{}
		cmd.Stdout, cmd.Stderr = out, out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		return cmd, out, addr
	}
	exits := func(t *testing.T, cmd *exec.Cmd, out *syncBuffer, wants ...string) {
		t.Helper()
		err := cmd.Wait()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 1 {
			t.Fatalf("serve: %v, want exit status 1\n%s", err, out)
		}
		t.Logf("serve:\n%s", out)
		for _, w := range wants {
			if !strings.Contains(out.String(), w) {
				t.Errorf("serve's output does not say %q:\n%s", w, out)
			}
		}
	}
	stop := func(cmd *exec.Cmd) {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}

	t.Run("a key file that is not the stored key fails the start", func(t *testing.T) {
		cmd, out, _ := serve(t, wrong, "--control-database", pg.AdminURL())
		exits(t, cmd, out, "the proxy key in --key-file "+wrong+" is not the proxy key stored in database \"postgres\"",
			"give fenceproxy serve the key file that fenceproxy migrate --key-file used", "fenceproxy migrate --database")
	})
	t.Run("a database without a stored key fails the start", func(t *testing.T) {
		cmd, out, _ := serve(t, right, "--control-database", pg.URLWithPassword(testenv.AdminUser, testenv.AdminPassword, "nokey"))
		exits(t, cmd, out, "no proxy key is stored in database \"nokey\"", "fenceproxy migrate --database <URL of nokey> --key-file "+right)
	})
	t.Run("the stored key starts", func(t *testing.T) {
		cmd, out, addr := serve(t, right, "--control-database", pg.AdminURL())
		defer stop(cmd)
		waitListening(t, addr)
		if !strings.Contains(out.String(), "proxy key checked") {
			t.Errorf("serve does not log the check:\n%s", out)
		}
	})
	t.Run("without a control database the first fenced session names the key file", func(t *testing.T) {
		cmd, out, addr := serve(t, wrong)
		defer stop(cmd)
		waitListening(t, addr)
		url := "postgres://" + testenv.AdminUser + ":" + testenv.AdminPassword + "@" + addr + "/postgres?sslmode=disable&fence.resource=billing&fence.token=1"
		for range 2 {
			_, err := pgx.Connect(ctx, url)
			var pe *pgconn.PgError
			if !errors.As(err, &pe) || pe.Code != fence.CodeProof {
				t.Fatalf("fenced session: %v, want SQLSTATE %s", err, fence.CodeProof)
			}
			for _, w := range []string{"--key-file " + wrong + " is not the proxy key stored in database \"postgres\"", "fenceproxy migrate --key-file used"} {
				if !strings.Contains(pe.Message, w) {
					t.Errorf("message %q does not say %q", pe.Message, w)
				}
			}
			if !strings.Contains(pe.Detail, "fencing proof invalid") {
				t.Errorf("detail %q does not give the database's answer", pe.Detail)
			}
		}
		time.Sleep(200 * time.Millisecond) // the log line is written before the session's error
		logged := out.String()
		if !strings.Contains(logged, "the proxy key cannot be checked at start") {
			t.Errorf("serve does not warn that it cannot check the key at start:\n%s", logged)
		}
		if n := strings.Count(logged, "the database refuses the proxy key"); n != 1 {
			t.Errorf("the refusal is logged %d times, want once per database:\n%s", n, logged)
		}
	})
}
