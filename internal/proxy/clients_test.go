package proxy_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// clientEnv is a clean environment for libpq programs: the caller's PG*
// variables must not leak in; env adds some.
func clientEnv(env []string) []string {
	return append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.TempDir(), "LC_ALL=C", "PGCONNECT_TIMEOUT=10", "PGAPPNAME=", "PGTZ=UTC"}, env...)
}

// runPsql runs psql (unaligned, tuples only, no psqlrc) on url with args.
func runPsql(t *testing.T, pg *testenv.Postgres, url string, env []string, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, pg.Bin("psql"), append([]string{"-X", "-A", "-t", "-d", url}, args...)...)
	cmd.Env = clientEnv(env)
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	err = cmd.Run()
	return o.String(), e.String(), err
}

var pidRE = regexp.MustCompile(`(PID|process) \d+`)

// testPsql runs a psql script of every feature through the proxy and
// directly: the outputs (stdout and stderr, interleaved) must be identical.
func testPsql(t *testing.T, s *suite) {
	pg, p, _ := s.setup(t)
	run := func(url string) string {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, pg.Bin("psql"), "-X", "-d", url, "-f", "testdata/psql_session.sql")
		cmd.Env = clientEnv(nil)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Run(); err != nil {
			t.Fatalf("psql: %v\n%s", err, out.String())
		}
		return pidRE.ReplaceAllString(out.String(), "$1 N")
	}
	direct := run(pg.URL(testenv.AdminUser, "postgres"))
	proxied := run(p.URL(testenv.AdminUser, "postgres"))
	for _, want := range []string{"Asynchronous notification \"psql_chan\" with payload \"hello through psql\"", "NOTICE:  a notice with a parameter",
		"ERROR:  division by zero", "doubled", "answer is 42", "duplicate key value violates unique constraint", " 3000 | kept", "psql through fenceproxy", "2024-01-01 13:45:00+13:45"} {
		if !strings.Contains(direct, want) {
			t.Errorf("the direct run lacks %q:\n%s", want, direct)
		}
	}
	if direct != proxied {
		d, q := strings.Split(direct, "\n"), strings.Split(proxied, "\n")
		t.Fatalf("psql output differs\n%s", diffLines(d, q))
	}
}

// testPgbench initialises pgbench's tables through the proxy (COPY) and runs
// its three query modes at once, four clients each.
func testPgbench(t *testing.T, s *suite) {
	pg, p, _ := s.setup(t)
	url := p.URL(testenv.AdminUser, "postgres")
	pgbench := func(args ...string) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, pg.Bin("pgbench"), args...)
		cmd.Env = clientEnv(nil)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	if out, err := pgbench("-i", "-s", "1", "-q", url); err != nil {
		t.Fatalf("pgbench -i: %v\n%s", err, out)
	}
	var wg sync.WaitGroup
	for _, mode := range []string{"simple", "extended", "prepared"} {
		wg.Go(func() {
			out, err := pgbench("-n", "-T", "3", "-c", "4", "-j", "2", "-M", mode, url)
			if err != nil || !strings.Contains(out, "number of failed transactions: 0 ") || !strings.Contains(out, "tps = ") {
				t.Errorf("pgbench -M %s: %v\n%s", mode, err, out)
				return
			}
			for _, l := range strings.Split(out, "\n") {
				if strings.HasPrefix(l, "tps = ") || strings.HasPrefix(l, "number of transactions actually processed") {
					t.Logf("-M %s: %s", mode, l)
				}
			}
		})
	}
	wg.Wait()
}

// testPsqlOptions: libpq carries the fence parameters in PGOPTIONS; the
// proxy takes them out and passes the other options on.
func testPsqlOptions(t *testing.T, s *suite) {
	// A database of its own: the fence schema stays out of the others' way.
	pg := s.pg
	pg.Exec(t, "CREATE DATABASE fenced")
	fenced := pg.URLWithPassword(testenv.AdminUser, testenv.AdminPassword, "fenced")
	testenv.Migrate(t, fenced)
	admin := connect(t, fenced)
	mustExec(t, admin, "CREATE TABLE runs (id serial PRIMARY KEY, token int NOT NULL)")
	p := testenv.StartProxy(t, pg, proxy.Config{Resources: []string{"billing"}})
	url := p.URL(testenv.AdminUser, "fenced")
	opts := func(token string) []string {
		return []string{"PGOPTIONS=-c fence.resource=billing -c fence.token=" + token + " -c statement_timeout=10s"}
	}
	psql := func(env []string, args ...string) (string, string, error) {
		return runPsql(t, pg, url, env, args...)
	}
	out, stderr, err := psql(opts("1"), "-c", "INSERT INTO runs (token) VALUES (1)", "-c", "BEGIN; INSERT INTO runs (token) VALUES (1); COMMIT", "-c", "SHOW statement_timeout")
	if err != nil || !strings.Contains(out, "10s") {
		t.Fatalf("token 1: %q %q %v", out, stderr, err)
	}
	if out, stderr, err := psql(opts("2"), "-c", "INSERT INTO runs (token) VALUES (2) RETURNING token"); err != nil || !strings.HasPrefix(out, "2\n") {
		t.Fatalf("token 2: %q %q %v", out, stderr, err)
	}
	_, stderr, err = psql(opts("1"), "-c", "INSERT INTO runs (token) VALUES (1)")
	if err == nil || !strings.Contains(stderr, "stale fencing token") {
		t.Fatalf("token 1 after 2: want a stale token error, got %q %v", stderr, err)
	}
	_, stderr, err = psql(nil, "-c", "SELECT 1")
	if err == nil || !strings.Contains(stderr, "ZF003") && !strings.Contains(stderr, "token") {
		t.Fatalf("no token: want a refusal, got %q %v", stderr, err)
	}
	var got []int
	rows, err := admin.Query(ctxT(t), "SELECT token FROM runs ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var tok int
		rows.Scan(&tok) //nolint:errcheck
		got = append(got, tok)
	}
	if len(got) != 3 || got[0] != 1 || got[1] != 1 || got[2] != 2 {
		t.Fatalf("rows %v, want [1 1 2]", got)
	}
}

// psycopg2Python is Debian's python3, which has python3-psycopg2 (a pyenv
// python earlier on PATH does not).
const psycopg2Python = "/usr/bin/python3"

// testPsycopg2 runs a psycopg2 script through the proxy and directly; both
// must pass with the same output.
func testPsycopg2(t *testing.T, s *suite) {
	if _, err := os.Stat(psycopg2Python); err != nil {
		t.Fatalf("%s not found: run `make deps` (python3-psycopg2)", psycopg2Python)
	}
	pg, p, _ := s.setup(t)
	run := func(dsn string) string {
		ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, psycopg2Python, "testdata/psycopg2_client.py", dsn)
		cmd.Env = clientEnv([]string{"PYTHONIOENCODING=utf-8"})
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.HasSuffix(string(out), "ALL OK\n") {
			t.Errorf("psycopg2 script on %s: %v\n%s", dsn, err, out)
		}
		return string(out)
	}
	var direct, proxied string
	var wg sync.WaitGroup
	wg.Go(func() { direct = run(pg.URL(testenv.AdminUser, "postgres")) })
	wg.Go(func() { proxied = run(p.URL(testenv.AdminUser, "postgres")) })
	wg.Wait()
	if t.Failed() {
		return
	}
	if direct != proxied {
		t.Fatalf("outputs differ:\n%s", diffLines(strings.Split(direct, "\n"), strings.Split(proxied, "\n")))
	}
	t.Logf("psycopg2 checks passed through the proxy: %d", strings.Count(proxied, "\nok ")+1)
}
