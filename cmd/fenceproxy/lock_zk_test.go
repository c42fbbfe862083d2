package main_test

import (
	"context"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestLockZooKeeper runs `fenceproxy lock --store zookeeper` end to end against a real
// ZooKeeper: the child gets its lock node's czxid as FENCE_TOKEN and a DATABASE_URL through
// the proxy; the node goes when the child exits; a leader frozen in the middle of a
// transaction is taken over after its session timeout, and when it wakes its commit is
// refused with ZF001.
func TestLockZooKeeper(t *testing.T) {
	bin, _, px, conn, env := lockSetup(t)
	z := testenv.StartZooKeeper(t)
	zc := z.Conn(t)

	// A session timeout of 4 s: the client drops a connection silent for 2/3 of it, which
	// a loaded machine must not turn into a lost lease in the middle of a step.
	lock := func(ctx context.Context, dir, holder, script string) *exec.Cmd {
		cmd := exec.CommandContext(ctx, bin, "lock", "--store", "zookeeper", "--zk-servers", z.Addr,
			"--resource", "billing", "--holder", holder, "--ttl", "4s", "--grace", "2s", "--on-lost", "exit",
			"--database-url", px.URL(testenv.AdminUser, "postgres"), "--", "/bin/sh", "-c", script)
		cmd.Env = append(env, "DIR="+dir)
		return cmd
	}
	rows := func(t *testing.T, token int64) int {
		t.Helper()
		var n int
		if err := conn.QueryRow(t.Context(), "SELECT count(*) FROM writes WHERE token = $1 AND store = 'zookeeper'", token).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	t.Run("the child writes with its lock node's czxid; the node goes when it exits", func(t *testing.T) {
		dir := t.TempDir()
		out, err := lock(t.Context(), dir, "one",
			`psql "$DATABASE_URL" -X -q -v ON_ERROR_STOP=1 -c "INSERT INTO writes VALUES ($FENCE_TOKEN, '$FENCE_STORE')" && env > "$DIR/env"`).CombinedOutput()
		if err != nil {
			t.Fatalf("fenceproxy lock: %v\n%s", err, out)
		}
		childEnv := readEnv(t, filepath.Join(dir, "env"))
		token, err := strconv.ParseInt(childEnv["FENCE_TOKEN"], 10, 64)
		if err != nil || token <= 0 || childEnv["FENCE_STORE"] != "zookeeper" || !strings.HasPrefix(childEnv["FENCE_KEY"], "/locks/billing/_c_") ||
			childEnv["FENCE_SESSION"] == "" {
			t.Fatalf("child env: FENCE_TOKEN=%q FENCE_STORE=%q FENCE_SESSION=%q FENCE_KEY=%q",
				childEnv["FENCE_TOKEN"], childEnv["FENCE_STORE"], childEnv["FENCE_SESSION"], childEnv["FENCE_KEY"])
		}
		if children, _, err := zc.Children("/locks/billing"); err != nil || len(children) != 0 {
			t.Errorf("nodes under /locks/billing after the child exited: %v, %v; want none", children, err)
		}
		if n := rows(t, token); n != 1 {
			t.Errorf("rows written with token %d: %d, want 1", token, n)
		}
		if !strings.Contains(string(out), `"store":"zookeeper"`) {
			t.Errorf("the logs do not name the store:\n%s", out)
		}
	})

	t.Run("a frozen leader's commit is refused after a takeover", func(t *testing.T) {
		frozenTakeover(t, "zookeeper", lock, rows)
	})

	t.Run("--store zookeeper needs --zk-servers", func(t *testing.T) {
		out, err := exec.Command(bin, "lock", "--store", "zookeeper", "--resource", "billing", "--", "true").CombinedOutput()
		if err == nil || !strings.Contains(string(out), "needs --zk-servers") {
			t.Errorf("lock --store zookeeper without --zk-servers: %v\n%s", err, out)
		}
	})
}
