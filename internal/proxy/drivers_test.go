package proxy_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Where scripts/deps.sh puts the drivers (Debian packages, and npm ci for
// node-postgres in the folder of its lockfile).
const (
	pgjdbcJar  = "/usr/share/java/postgresql.jar"    // libpostgresql-jdbc-java
	nodeFolder = "testdata/drivers/node"             // package.json, package-lock.json, client.js
	javaSource = "testdata/drivers/jdbc/Client.java" // compiled by the test with javac
)

// clientDriver is a client stack of TestTransparencyMatrix. Each but pgx (in
// this process, pgxCell) is a program that runs every check of a cell in one
// process: testdata/drivers/fencecell.py says how it is run and reports.
type clientDriver struct {
	name string
	// prepare checks the driver is installed (saying what to install when not)
	// and returns how a cell runs it.
	prepare func(t *testing.T, s *servers) cellRunner
}

// cellRunner runs a driver's checks for one cell and returns its report
// ("ok <check>", "FAIL <check>: <why>" lines) and what else it said.
type cellRunner func(ctx context.Context, c *cell) (report, diag string)

func clientDrivers() []clientDriver {
	return []clientDriver{
		{"pgx", func(*testing.T, *servers) cellRunner { return pgxCell }},
		{"psql", func(t *testing.T, s *servers) cellRunner {
			return program([]string{"sh", absPath(t, "testdata/drivers/psql_client.sh")}, "PSQL="+s.pg.Bin("psql"))
		}},
		{"psycopg 2", func(t *testing.T, _ *servers) cellRunner {
			return pythonProgram(t, "psycopg2", "python3-psycopg2", "testdata/drivers/psycopg2_client.py")
		}},
		{"psycopg 3", func(t *testing.T, _ *servers) cellRunner {
			return pythonProgram(t, "psycopg", "python3-psycopg", "testdata/drivers/psycopg_client.py")
		}},
		{"node-postgres", func(t *testing.T, _ *servers) cellRunner {
			for _, m := range []string{"pg", "pg-copy-streams"} {
				if _, err := os.Stat(filepath.Join(nodeFolder, "node_modules", m, "package.json")); err != nil {
					t.Fatalf("node-postgres is not installed (%v): run `make deps` (scripts/deps.sh: npm ci in internal/proxy/%s; needs node and npm)", err, nodeFolder)
				}
			}
			node := lookPath(t, "node", "node and npm (Debian nodejs, npm)")
			return program([]string{node, absPath(t, filepath.Join(nodeFolder, "client.js"))})
		}},
		{"pgjdbc", func(t *testing.T, _ *servers) cellRunner {
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
			return program([]string{java, "-XX:TieredStopAtLevel=1", "-Xshare:auto", "-cp", classes + string(os.PathListSeparator) + pgjdbcJar, "Client"})
		}},
	}
}

// pythonProgram runs script with Debian's python3, which has the module
// (a python earlier on PATH may not).
func pythonProgram(t *testing.T, module, pkg, script string) cellRunner {
	if out, err := exec.Command(psycopg2Python, "-c", "import "+module).CombinedOutput(); err != nil {
		t.Fatalf("%s is not installed (%v: %s): run `make deps` (Debian %s)", module, err, out, pkg)
	}
	return program([]string{psycopg2Python, absPath(t, script)}, "PYTHONIOENCODING=utf-8", "PYTHONDONTWRITEBYTECODE=1")
}

func lookPath(t *testing.T, name, what string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		t.Fatalf("%s not found: install %s (`make deps`)", name, what)
	}
	return p
}

func absPath(t *testing.T, p string) string {
	a, err := filepath.Abs(p)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// program runs command for a cell, in the cell's folder, as the role "app",
// and answers its stale token's handshake ("stale?": the new holder's
// "<token> <session>") with the cell's takeover.
func program(command []string, env ...string) cellRunner {
	return func(ctx context.Context, c *cell) (string, string) {
		cmd := exec.CommandContext(ctx, command[0], command[1:]...)
		cmd.Dir = c.dir
		sslmode := "disable"
		if c.tls {
			sslmode = "require"
		}
		cellEnv := []string{"PGHOST=" + c.proxy.Host, "PGPORT=" + strconv.Itoa(c.proxy.Port), "PGUSER=app", "PGDATABASE=postgres",
			"PGSSLMODE=" + sslmode, "PGSSLROOTCERT=" + c.caFile,
			// a channel of the cell's own: cells run side by side in one database
			"NOTIFY_CHANNEL=chan_" + c.resource}
		if c.fenced {
			cellEnv = append(cellEnv, "FENCE_RESOURCE="+c.resource, "FENCE_TOKEN="+strconv.FormatInt(c.first.token, 10), "FENCE_SESSION="+c.first.session)
		}
		cmd.Env = clientEnv(append(cellEnv, env...))
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		stdin, err := cmd.StdinPipe()
		if err != nil {
			return "", err.Error()
		}
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			return "", err.Error()
		}
		if err := cmd.Start(); err != nil {
			return "", err.Error()
		}
		var report strings.Builder
		var notes []string
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			line := sc.Text()
			if line != "stale?" {
				report.WriteString(line + "\n")
				continue
			}
			h, err := c.takeover()
			if err != nil {
				notes = append(notes, "takeover: "+err.Error())
			}
			session := h.session
			if session == "" {
				session = "-"
			}
			fmt.Fprintf(stdin, "%d %s\n", h.token, session)
		}
		_, _ = io.Copy(io.Discard, stdout)
		stdin.Close()
		if err := cmd.Wait(); err != nil {
			notes = append(notes, fmt.Sprintf("%s: %v", strings.Join(command, " "), err))
		}
		notes = append(notes, "stderr:\n"+stderr.String())
		return report.String(), strings.Join(notes, "\n")
	}
}
