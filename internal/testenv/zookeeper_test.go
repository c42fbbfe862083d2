package testenv_test

import (
	"strings"
	"testing"

	"github.com/go-zookeeper/zk"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestZooKeeper checks what the ZooKeeper tests rely on: a private port, data kept across
// a restart with zxids still growing, and Restore putting the data back.
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
	backup := z.Backup(t) // a restart
	c = z.Conn(t)
	if ok, _, err := c.Exists("/a"); err != nil || !ok {
		t.Fatalf("/a after a restart: %v, %v; want it kept", ok, err)
	}
	second := create(c, "/b")
	t.Logf("czxids %#x, after a restart %#x", first, second)
	if second <= first {
		t.Errorf("czxids %#x, %#x: want growing across a restart", first, second)
	}

	// The proxy's tests rely on Restore and Wipe moving zxids back (they check the tokens
	// they get); here only that the data goes back.
	z.Restore(t, backup)
	c = z.Conn(t)
	if ok, _, err := c.Exists("/b"); err != nil || ok {
		t.Fatalf("/b after the restore: %v, %v; want gone", ok, err)
	}
}
