package lease_test

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/lease/leasetest"
	"github.com/fenceproxy/fenceproxy/internal/lease/pglease"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestWatchdog: a child that keeps touching its watchdog file keeps the PostgreSQL lease
// past the watchdog's timeout; one that stops is stopped, the lease released, and
// RunLocked says why with exit code 124.
func TestWatchdog(t *testing.T) {
	t.Parallel()
	_, url := leasetest.LeaseDB(t)
	conn := testenv.Connect(t, url)
	run := func(t *testing.T, resource, script string, timeout time.Duration) (string, error) {
		dir := t.TempDir()
		cfg := lease.RunConfig{
			Store:    &pglease.Store{URL: url, TTL: 10 * time.Second, Holder: "watched"},
			Resource: resource,
			Command:  []string{"/bin/sh", "-c", script},
			Env:      []string{"PATH=" + os.Getenv("PATH"), "DIR=" + dir},
			Grace:    5 * time.Second,
			Watchdog: &lease.Watchdog{File: filepath.Join(dir, "progress"), Timeout: timeout},
		}
		return dir, result(t, runLocked(t, leasetest.Ctx(t), cfg), 2*time.Minute)
	}

	t.Run("progress keeps the lease", func(t *testing.T) {
		t.Parallel()
		// 30 touches 0.2 s apart: twice the timeout and more, never 3 s without one.
		dir, err := run(t, "watched-busy", `i=0; while [ $i -lt 30 ]; do touch "$FENCE_WATCHDOG_FILE"; sleep 0.2; i=$((i+1)); done; echo done > "$DIR/done"`, 3*time.Second)
		if err != nil {
			t.Fatalf("RunLocked: %v, want nil", err)
		}
		if _, err := os.Stat(filepath.Join(dir, "done")); err != nil {
			t.Fatalf("the child did not finish: %v", err)
		}
	})

	t.Run("no progress: child stopped, lease released", func(t *testing.T) {
		t.Parallel()
		dir, err := run(t, "watched-stuck", `touch "$FENCE_WATCHDOG_FILE"; echo $$ > "$DIR/pid"; exec sleep 600`, time.Second)
		var we *lease.WatchdogError
		if !errors.As(err, &we) {
			t.Fatalf("RunLocked: %v, want a *WatchdogError", err)
		}
		var ec interface{ ExitCode() int }
		if !errors.As(err, &ec) || ec.ExitCode() != lease.WatchdogExitCode || lease.WatchdogExitCode != 124 {
			t.Errorf("exit code of %v: want 124", err)
		}
		var child *lease.ExitError
		if !errors.As(we.Exit, &child) || child.Code != 128+15 {
			t.Errorf("the child's result %v: want ended by SIGTERM (143)", we.Exit)
		}
		if !strings.Contains(err.Error(), "progress not touched for 1s") {
			t.Errorf("message %q", err)
		}
		b, _ := os.ReadFile(filepath.Join(dir, "pid"))
		if pid, perr := strconv.Atoi(strings.TrimSpace(string(b))); perr != nil || alive(pid) {
			t.Errorf("child pid %q: still running or never started (%v)", b, perr)
		}
		var released bool
		if err := conn.QueryRow(leasetest.Ctx(t), "SELECT holder IS NULL AND NOT coalesce(expires_at > clock_timestamp(), false) FROM fence.leases WHERE resource = 'watched-stuck'").Scan(&released); err != nil || !released {
			t.Errorf("lease row after the watchdog fired: released %t (%v), want released", released, err)
		}
	})

	t.Run("invalid", func(t *testing.T) {
		t.Parallel()
		// A file in a missing folder fails before the campaign: the lease is never won.
		missing := filepath.Join(t.TempDir(), "missing", "progress")
		for _, w := range []lease.Watchdog{{File: "", Timeout: time.Second}, {File: "x", Timeout: 0}, {File: missing, Timeout: time.Second}} {
			err := lease.RunLocked(leasetest.Ctx(t), lease.RunConfig{Store: &pglease.Store{URL: url}, Resource: "unwatched", Command: []string{"true"}, Watchdog: &w})
			if err == nil || !strings.Contains(err.Error(), "Watchdog") {
				t.Errorf("%+v: %v, want a configuration error", w, err)
			}
		}
		var n int
		if err := conn.QueryRow(leasetest.Ctx(t), "SELECT count(*) FROM fence.leases WHERE resource = 'unwatched'").Scan(&n); err != nil || n != 0 {
			t.Errorf("lease rows of unwatched after the refused starts: %d (%v), want none", n, err)
		}
	})
}
