package main_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestLockEtcd runs `fenceproxy lock --store etcd` end to end against a real etcd: the child
// gets the leader key's CreateRevision as FENCE_TOKEN and a DATABASE_URL through the proxy;
// a leader frozen in the middle of a transaction is taken over after its session's TTL, and
// when it wakes its commit is refused with ZF001.
func TestLockEtcd(t *testing.T) {
	bin, _, px, conn, env := lockSetup(t)
	etcd := testenv.StartEtcd(t)
	cli := etcd.Client(t)

	lock := func(ctx context.Context, dir, holder, script string) *exec.Cmd {
		cmd := exec.CommandContext(ctx, bin, "lock", "--store", "etcd", "--etcd-endpoints", etcd.Endpoint,
			"--resource", "billing", "--holder", holder, "--ttl", "2s", "--grace", "2s", "--on-lost", "exit",
			"--database-url", px.URL(testenv.AdminUser, "postgres"), "--", "/bin/sh", "-c", script)
		cmd.Env = append(env, "DIR="+dir)
		return cmd
	}
	rows := func(t *testing.T, token int64) int {
		t.Helper()
		var n int
		if err := conn.QueryRow(t.Context(), "SELECT count(*) FROM writes WHERE token = $1 AND store = 'etcd'", token).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	t.Run("the child writes with the leader key's CreateRevision; the key goes when it exits", func(t *testing.T) {
		dir := t.TempDir()
		out, err := lock(t.Context(), dir, "one",
			`psql "$DATABASE_URL" -X -q -v ON_ERROR_STOP=1 -c "INSERT INTO writes VALUES ($FENCE_TOKEN, '$FENCE_STORE')" && env > "$DIR/env"`).CombinedOutput()
		if err != nil {
			t.Fatalf("fenceproxy lock: %v\n%s", err, out)
		}
		childEnv := readEnv(t, filepath.Join(dir, "env"))
		token, err := strconv.ParseInt(childEnv["FENCE_TOKEN"], 10, 64)
		if err != nil || childEnv["FENCE_STORE"] != "etcd" || childEnv["FENCE_KEY"] != "locks/billing/"+childEnv["FENCE_SESSION"] {
			t.Fatalf("child env: FENCE_TOKEN=%q FENCE_STORE=%q FENCE_SESSION=%q FENCE_KEY=%q",
				childEnv["FENCE_TOKEN"], childEnv["FENCE_STORE"], childEnv["FENCE_SESSION"], childEnv["FENCE_KEY"])
		}
		// The key is gone (released), so read the revision it was created at from history.
		resp, err := cli.Get(t.Context(), childEnv["FENCE_KEY"], clientv3.WithRev(token))
		if err != nil || len(resp.Kvs) != 1 || resp.Kvs[0].CreateRevision != token || string(resp.Kvs[0].Value) != "one" {
			t.Errorf("leader key at revision %d: %v, %v; want created there with value one", token, resp, err)
		}
		if now, err := cli.Get(t.Context(), "locks/billing/", clientv3.WithPrefix()); err != nil || len(now.Kvs) != 0 {
			t.Errorf("keys under locks/billing/ after the child exited: %v, %v; want none", now, err)
		}
		if n := rows(t, token); n != 1 {
			t.Errorf("rows written with token %d: %d, want 1", token, n)
		}
		if !strings.Contains(string(out), `"store":"etcd"`) {
			t.Errorf("the logs do not name the store:\n%s", out)
		}
	})

	t.Run("a frozen leader's commit is refused after a takeover", func(t *testing.T) {
		frozenTakeover(t, "etcd", lock, rows)
	})

	t.Run("--store etcd needs --etcd-endpoints", func(t *testing.T) {
		out, err := exec.Command(bin, "lock", "--store", "etcd", "--resource", "billing", "--", "true").CombinedOutput()
		if err == nil || !strings.Contains(string(out), "needs --etcd-endpoints") {
			t.Errorf("lock --store etcd without --etcd-endpoints: %v\n%s", err, out)
		}
	})
}

// lockCmd starts `fenceproxy lock` for holder with script as its child (DIR=dir in its
// environment).
type lockCmd func(ctx context.Context, dir, holder, script string) *exec.Cmd

// frozenTakeover freezes a leader (its supervisor and child) in the middle of a
// transaction, lets another take over after the lease's TTL, and checks that the frozen
// leader's COMMIT, once it wakes, is refused with ZF001 and its supervisor exits with an
// error. rows counts the rows written with a token.
func frozenTakeover(t *testing.T, store string, lock lockCmd, rows func(*testing.T, int64) int) {
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	// The old leader opens a transaction, writes, says ready and waits for "go"
	// before its COMMIT.
	old := lock(ctx, dir, "old", `echo $$ > "$DIR/pid"; echo $FENCE_TOKEN > "$DIR/token"
psql "$DATABASE_URL" -X -q -v ON_ERROR_STOP=1 -v VERBOSITY=verbose > "$DIR/psql.out" 2>&1 <<EOF
BEGIN;
INSERT INTO writes VALUES ($FENCE_TOKEN, '$FENCE_STORE');
\! touch "$DIR/ready"; while [ ! -e "$DIR/go" ]; do sleep 0.05; done
COMMIT;
EOF`)
	// A file, not a buffer: the test reads it while the process writes.
	oldOut, err := os.Create(filepath.Join(dir, "lock.out"))
	if err != nil {
		t.Fatal(err)
	}
	defer oldOut.Close()
	old.Stdout, old.Stderr = oldOut, oldOut
	if err := old.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = old.Process.Signal(syscall.SIGCONT)
	})
	waitPath(t, filepath.Join(dir, "ready"), oldOut.Name())
	pgid, _ := strconv.Atoi(strings.TrimSpace(readFile(t, filepath.Join(dir, "pid"))))
	oldToken, _ := strconv.ParseInt(strings.TrimSpace(readFile(t, filepath.Join(dir, "token"))), 10, 64)
	if pgid <= 0 || oldToken <= 0 {
		t.Fatalf("child group %d, token %d", pgid, oldToken)
	}
	// Freeze the supervisor and its child's whole group.
	if err := syscall.Kill(old.Process.Pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(-pgid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Kill(-pgid, syscall.SIGCONT) })
	frozen := time.Now()

	newDir := t.TempDir()
	out, err := lock(ctx, newDir, "new",
		`psql "$DATABASE_URL" -X -q -v ON_ERROR_STOP=1 -c "INSERT INTO writes VALUES ($FENCE_TOKEN, '$FENCE_STORE')" && echo $FENCE_TOKEN > "$DIR/token"`).CombinedOutput()
	if err != nil {
		t.Fatalf("the new leader: %v\n%s", err, out)
	}
	newToken, _ := strconv.ParseInt(strings.TrimSpace(readFile(t, filepath.Join(newDir, "token"))), 10, 64)
	t.Logf("%s: frozen leader (token %d) -> new leader's commit (token %d) after %v", store,
		oldToken, newToken, time.Since(frozen).Round(time.Millisecond))
	if newToken <= oldToken {
		t.Fatalf("new token %d, old %d: want higher", newToken, oldToken)
	}

	// Wake the child first (its supervisor would stop it on waking): its COMMIT is
	// refused.
	if err := os.WriteFile(filepath.Join(dir, "go"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(-pgid, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(readFile(t, filepath.Join(dir, "psql.out")), "ZF001") && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if got := readFile(t, filepath.Join(dir, "psql.out")); !strings.Contains(got, "ZF001") {
		t.Errorf("the old leader's psql: %q, want ZF001", got)
	}
	if err := syscall.Kill(old.Process.Pid, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	// On waking, the supervisor sees two things at once: its lease lost (exit status 1
	// with --on-lost exit) and its child exited after the refused COMMIT (psql's status,
	// passed on: 2, the connection ended after the FATAL ZF001 as after a terminated
	// backend's, or 3, the error of a script). Either may come first; all end it with an error.
	err = old.Wait()
	var ee *exec.ExitError
	if got := readFile(t, oldOut.Name()); !errors.As(err, &ee) || !slices.Contains([]int{1, 2, 3}, ee.ExitCode()) {
		t.Errorf("the old supervisor: %v, want exit status 1 (lost leadership), or psql's 2 or 3\n%s", err, got)
	}
	if n := rows(t, oldToken); n != 0 {
		t.Errorf("%d rows of the frozen leader committed, want 0", n)
	}
	if n := rows(t, newToken); n != 1 {
		t.Errorf("%d rows of the new leader, want 1", n)
	}
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	return string(b)
}

func readEnv(t *testing.T, path string) map[string]string {
	t.Helper()
	env := map[string]string{}
	for _, line := range strings.Split(readFile(t, path), "\n") {
		if k, v, ok := strings.Cut(line, "="); ok {
			env[k] = v
		}
	}
	return env
}

// waitPath waits until path exists; the file out is what to show if it never does.
func waitPath(t *testing.T, path, out string) {
	t.Helper()
	eventually(t, 30*time.Second, path+" appears", func() error {
		if _, err := os.Stat(path); err != nil {
			return fmt.Errorf("%v; %s:\n%s", err, out, readFile(t, out))
		}
		return nil
	})
}
