package proxy_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// Where scripts/deps.sh puts the drivers (Debian packages, and npm ci for
// node-postgres in the folder of its lockfile).
const (
	pgjdbcJar  = "/usr/share/java/postgresql.jar"    // libpostgresql-jdbc-java
	nodeFolder = "testdata/drivers/node"             // package.json, package-lock.json, client.js
	javaSource = "testdata/drivers/jdbc/Client.java" // compiled by the test with javac
)

// driver is a client stack's test program: each prints "ok <check>" lines
// and "ALL OK" on success.
type driver struct {
	name string
	// prepare checks the driver is installed (saying what to install when
	// not) and returns the command that runs the program.
	prepare func(t *testing.T) []string
}

func clientDrivers() []driver {
	return []driver{
		{"node-postgres", func(t *testing.T) []string {
			for _, m := range []string{"pg", "pg-copy-streams"} {
				if _, err := os.Stat(filepath.Join(nodeFolder, "node_modules", m, "package.json")); err != nil {
					t.Fatalf("node-postgres is not installed (%v): run `make deps` (scripts/deps.sh: npm ci in internal/proxy/%s; needs node and npm)", err, nodeFolder)
				}
			}
			node := lookPath(t, "node", "node and npm (Debian nodejs, npm)")
			return []string{node, filepath.Join(nodeFolder, "client.js")}
		}},
		{"pgjdbc", func(t *testing.T) []string {
			if _, err := os.Stat(pgjdbcJar); err != nil {
				t.Fatalf("pgjdbc is not installed (%v): run `make deps` (Debian libpostgresql-jdbc-java)", err)
			}
			javac := lookPath(t, "javac", "a JDK (Debian default-jdk-headless)")
			java := lookPath(t, "java", "a JDK (Debian default-jdk-headless)")
			classes := t.TempDir()
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			if out, err := exec.CommandContext(ctx, javac, "-cp", pgjdbcJar, "-d", classes, javaSource).CombinedOutput(); err != nil {
				t.Fatalf("javac %s: %v\n%s", javaSource, err, out)
			}
			return []string{java, "-XX:TieredStopAtLevel=1", "-Xshare:auto", "-cp", classes + string(os.PathListSeparator) + pgjdbcJar, "Client"}
		}},
		{"psycopg 3", func(t *testing.T) []string {
			// Debian's python3, which has python3-psycopg (a python earlier on
			// PATH may not).
			if out, err := exec.Command(psycopg2Python, "-c", "import psycopg").CombinedOutput(); err != nil {
				t.Fatalf("psycopg 3 is not installed (%v: %s): run `make deps` (Debian python3-psycopg)", err, out)
			}
			return []string{psycopg2Python, "testdata/drivers/psycopg_client.py"}
		}},
	}
}

func lookPath(t *testing.T, name, what string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		t.Fatalf("%s not found: install %s (`make deps`)", name, what)
	}
	return p
}

// TestDrivers runs node-postgres, pgjdbc and psycopg 3 programs through the
// proxy, fenced (a token in the driver's own way of passing startup
// options, and a stale token surfacing as ZF001 in the driver's error type)
// and unfenced: prepared statements, transactions, COPY, LISTEN/NOTIFY,
// cancel. pgx, libpq (psql, pgbench) and psycopg2 are in TestTransparency.
func TestDrivers(t *testing.T) {
	t.Parallel()
	drivers := clientDrivers()
	pg, _ := fencedDB(t)
	var resources []string
	for i := range drivers {
		resources = append(resources, "driver"+strconv.Itoa(i))
	}
	// The control database lets the proxy tell a backend ended by a raise
	// (ZF001) at once, however slow the machine (without it, it waits up to
	// a second to hear of the raise).
	fenced := fencedProxy(t, pg, func(c *proxy.Config) {
		c.Resources = resources
		c.ControlDatabase = pg.AdminURL()
	})
	unfenced := plainProxy(t, pg)
	for i, d := range drivers {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			cmd := d.prepare(t)
			t.Run("fenced", func(t *testing.T) {
				t.Parallel()
				runDriver(t, cmd, fenced, "FENCE_RESOURCE="+resources[i], "FENCE_TOKEN=1")
			})
			t.Run("unfenced", func(t *testing.T) {
				t.Parallel()
				runDriver(t, cmd, unfenced)
			})
		})
	}
}

// runDriver runs a driver's program against p as the role "app" and checks
// its report.
func runDriver(t *testing.T, command []string, p *testenv.Proxy, env ...string) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, command[0], command[1:]...)
	cmd.Env = clientEnv(append([]string{"PGHOST=" + p.Host, "PGPORT=" + strconv.Itoa(p.Port), "PGUSER=app", "PGDATABASE=postgres", "PYTHONIOENCODING=utf-8"}, env...))
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	out := stdout.String()
	if err != nil || !strings.HasSuffix(out, "ALL OK\n") {
		t.Fatalf("%s: %v\nstdout:\n%s\nstderr:\n%s", strings.Join(command, " "), err, out, stderr.String())
	}
	t.Log(strings.TrimSpace(fmt.Sprintf("%d checks passed; %s", strings.Count(out, "ok "), lineWith(out, "stale: "))))
}

// lineWith returns the first line of s that starts with prefix.
func lineWith(s, prefix string) string {
	for _, l := range strings.Split(s, "\n") {
		if strings.HasPrefix(l, prefix) {
			return l
		}
	}
	return ""
}
