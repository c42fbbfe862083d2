package testenv_test

import (
	"strings"
	"testing"

	"github.com/go-zookeeper/zk"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestZooKeeper checks what the ZooKeeper tests rely on: a private port, data kept across
// Stop and Start with zxids still growing, and Restore and Wipe moving zxids back.
func TestZooKeeper(t *testing.T) {
	t.Parallel()
	z := testenv.StartZooKeeper(t)
	if !strings.HasPrefix(z.Addr, "127.0.0.1:") || strings.HasSuffix(z.Addr, ":2181") {
		t.Errorf("Addr = %s, want a private loopback port", z.Addr)
	}
	create := func(c *zk.Conn, path string) int64 {
		t.Helper()
		if _, err := c.Create(path, nil, 0, zk.WorldACL(zk.PermAll)); err != nil {
			t.Fatalf("create %s: %v", path, err)
		}
		_, st, err := c.Get(path)
		if err != nil {
			t.Fatalf("get %s: %v", path, err)
		}
		return st.Czxid
	}
	c := z.Conn(t)
	first := create(c, "/a")
	backup := z.Backup(t)
	c = z.Conn(t)
	second := create(c, "/b")
	z.Stop(t)
	z.Start(t)
	c = z.Conn(t)
	if ok, _, err := c.Exists("/b"); err != nil || !ok {
		t.Fatalf("/b after a restart: %v, %v; want it kept", ok, err)
	}
	third := create(c, "/c")
	t.Logf("czxids %#x, %#x, after a restart %#x", first, second, third)
	if !(first < second && second < third) {
		t.Errorf("czxids %#x, %#x, %#x: want growing across a restart", first, second, third)
	}

	z.Restore(t, backup)
	c = z.Conn(t)
	if ok, _, err := c.Exists("/b"); err != nil || ok {
		t.Fatalf("/b after the restore: %v, %v; want gone", ok, err)
	}
	if again := create(c, "/d"); again >= third {
		t.Errorf("czxid after the restore %#x, want below %#x", again, third)
	}
	z.Wipe(t)
	c = z.Conn(t)
	if ok, _, err := c.Exists("/a"); err != nil || ok {
		t.Fatalf("/a after the wipe: %v, %v; want gone", ok, err)
	}
	if again := create(c, "/e"); again > first {
		t.Errorf("czxid after the wipe %#x, want back at the start (%#x or below)", again, first)
	}
}
