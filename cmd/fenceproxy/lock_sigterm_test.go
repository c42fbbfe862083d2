package main_test

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestLockSIGTERMIsANormalExit: SIGTERM is how a service manager stops `fenceproxy lock`:
// while it campaigns (another holder has the lease) it exits 0 and logs the stop at INFO, not
// an ERROR "context canceled"; while the child runs, the child is stopped and its status is
// the command's, again without an ERROR.
func TestLockSIGTERMIsANormalExit(t *testing.T) {
	t.Parallel()
	bin := buildBinary(t)
	pg := testenv.StartPostgres(t)
	admin := pg.AdminURL()
	testenv.Migrate(t, admin)
	// Another holder has the lease for a minute: the command campaigns.
	pg.Exec(t, "SELECT fence.lease_acquire('held', 'someone else', '60 s')")

	stop := func(t *testing.T, sig syscall.Signal, resource, script string, started func() bool) (int, string) {
		t.Helper()
		var logs syncBuffer // read while the command writes it
		cmd := exec.Command(bin, "lock", "--store", "postgres", "--database", admin, "--resource", resource,
			"--ttl", "5s", "--grace", "5s", "--", "/bin/sh", "-c", script)
		cmd.Stdout, cmd.Stderr = &logs, &logs
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		eventually(t, 60*time.Second, "started", func() error {
			if !started() {
				return errors.New(logs.String())
			}
			return nil
		})
		if err := cmd.Process.Signal(sig); err != nil {
			t.Fatal(err)
		}
		err := cmd.Wait()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return code, logs.String()
	}
	noError := func(t *testing.T, logs string) {
		t.Helper()
		if strings.Contains(logs, `"level":"error"`) || strings.Contains(logs, "context canceled") {
			t.Errorf("a SIGTERM was logged as an error:\n%s", logs)
		}
	}

	t.Run("while campaigning", func(t *testing.T) {
		conn := testenv.Connect(t, admin)
		code, logs := stop(t, syscall.SIGTERM, "held", "exit 3", func() bool {
			// Its campaign's connection: its signal handler is installed by then.
			var n int
			err := conn.QueryRow(t.Context(), "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'fenceproxy lock held'").Scan(&n)
			return err == nil && n > 0
		})
		if code != 0 {
			t.Errorf("exit %d, want 0:\n%s", code, logs)
		}
		noError(t, logs)
		if !strings.Contains(logs, "stopped by SIGTERM or SIGINT before the lock was acquired") || !strings.Contains(logs, `"level":"info"`) {
			t.Errorf("want the stop logged at INFO:\n%s", logs)
		}
	})
	t.Run("while the child runs", func(t *testing.T) {
		mark := filepath.Join(t.TempDir(), "started")
		code, logs := stop(t, syscall.SIGTERM, "free", `trap 'exit 0' TERM; touch "`+mark+`"; sleep 300 & wait`, func() bool {
			_, err := os.Stat(mark)
			return err == nil
		})
		if code != 0 {
			t.Errorf("exit %d, want the child's 0:\n%s", code, logs)
		}
		noError(t, logs)
	})
	// SIGHUP (a terminal that closed) stops it the same way, the lock released: it killed
	// the supervisor silently, the child with it, and left the lock held until its TTL (a
	// newcomer's).
	t.Run("SIGHUP while the child runs", func(t *testing.T) {
		mark := filepath.Join(t.TempDir(), "started")
		code, logs := stop(t, syscall.SIGHUP, "hup", `trap 'exit 0' TERM; touch "`+mark+`"; sleep 300 & wait`, func() bool {
			_, err := os.Stat(mark)
			return err == nil
		})
		if code != 0 {
			t.Errorf("exit %d, want the child's 0:\n%s", code, logs)
		}
		noError(t, logs)
		var held bool
		if err := testenv.Connect(t, admin).QueryRow(t.Context(), "SELECT holder IS NOT NULL FROM fence.leases WHERE resource = 'hup'").Scan(&held); err != nil || held {
			t.Errorf("the lease after SIGHUP: held %v, %v; want released", held, err)
		}
	})
}
