package main

import (
	"bufio"
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// The reporters, written into the work folder and loaded into each suite's runner: they
// record every test's outcome and the connections it opened as JSON lines (a record) in
// $FENCE_SUITE_LOG.
var (
	//go:embed node_reporter.js
	nodeReporter []byte
	//go:embed pytest_plugin.py
	pytestPlugin []byte
)

// readRecords reads a reporter's JSON lines into results.
func readRecords(path string) (*results, error) {
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return &results{}, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	r := &results{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 4*1024*1024)
	for sc.Scan() {
		var rec record
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		r.add(rec)
	}
	return r, sc.Err()
}

// command runs argv in dir with env (nothing of this process's environment but PATH and HOME)
// until it ends or timeout passes, its output in logFile. It returns the exit code; a
// command that cannot start or that times out is an error.
func command(ctx context.Context, dir string, env []string, logFile string, timeout time.Duration, argv ...string) (int, error) {
	out, err := os.Create(logFile)
	if err != nil {
		return 0, err
	}
	defer out.Close()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Dir = dir
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME"), "LANG=C.UTF-8", "TZ=UTC"}, env...)
	cmd.Stdout, cmd.Stderr = out, out
	// Its own process group, ended as a whole: a suite's helpers must not outlive it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 10 * time.Second
	err = cmd.Run()
	var ee *exec.ExitError
	switch {
	case ctx.Err() != nil:
		return 0, fmt.Errorf("%s: not done after %s (output in %s): %w", strings.Join(argv, " "), timeout, logFile, ctx.Err())
	case errors.As(err, &ee):
		return ee.ExitCode(), nil
	case err != nil:
		return 0, err
	}
	return 0, nil
}

// nodeSuite is node-postgres's integration tests (packages/pg/test/integration/**/*-tests.js),
// each file run by node as its Makefile does, with its lib/ as the driver under test. A file's
// tests run one after another and the file stops at the first failure; each file is also a
// record of its own, its exit status (some files are plain scripts without named tests).
type nodeSuite struct{ c config }

func (n *nodeSuite) name() string { return "node-postgres" }
func (n *nodeSuite) db() string   { return "node" }

func (n *nodeSuite) check() error {
	if n.c.NodeDir == "" {
		return errors.New("no --node-dir (NODE_SUITE_DIR): scripts/driver-suites.sh gets it")
	}
	for _, p := range []string{"lib/index.js", "test/integration/test-helper.js", "node_modules/async", "node_modules/pg-protocol"} {
		if _, err := os.Stat(filepath.Join(n.c.NodeDir, p)); err != nil {
			return fmt.Errorf("%s is not node-postgres's package folder with its test dependencies installed: %w", n.c.NodeDir, err)
		}
	}
	if _, err := exec.LookPath(n.c.Node); err != nil {
		return fmt.Errorf("node not found (run make deps): %w", err)
	}
	return nil
}

// files are the integration test files, relative to the package folder.
func (n *nodeSuite) files() ([]string, error) {
	var filter *regexp.Regexp
	if n.c.NodeFiles != "" {
		var err error
		if filter, err = regexp.Compile(n.c.NodeFiles); err != nil {
			return nil, err
		}
	}
	var files []string
	err := filepath.WalkDir(filepath.Join(n.c.NodeDir, "test", "integration"), func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, "-tests.js") {
			return err
		}
		rel, err := filepath.Rel(n.c.NodeDir, path)
		if err == nil && (filter == nil || filter.MatchString(rel)) {
			files = append(files, rel)
		}
		return err
	})
	slices.Sort(files)
	return files, err
}

func (n *nodeSuite) run(ctx context.Context, t target, only []string, dir, tag string) (*results, error) {
	files, err := n.files()
	if err != nil {
		return nil, err
	}
	if only != nil {
		// A test is "file" or "file::name": the file runs whole.
		var want []string
		for _, test := range only {
			f, _, _ := strings.Cut(test, "::")
			if !slices.Contains(want, f) {
				want = append(want, f)
			}
		}
		files = want
	}
	if len(files) == 0 {
		return nil, errors.New("no integration test files")
	}
	logs := filepath.Join(dir, tag)
	if err := os.MkdirAll(logs, 0o755); err != nil {
		return nil, err
	}
	reporter := filepath.Join(dir, "node_reporter.js")
	if err := os.WriteFile(reporter, nodeReporter, 0o644); err != nil {
		return nil, err
	}
	recs := filepath.Join(logs, "records.jsonl")
	for i, f := range files {
		logFile := filepath.Join(logs, fmt.Sprintf("%03d-%s.log", i, strings.NewReplacer("/", "_").Replace(f)))
		env := append(t.pgEnv(), "FENCE_SUITE_LOG="+recs, "FENCE_SUITE_FILE="+f)
		code, err := command(ctx, n.c.NodeDir, env, logFile, 5*n.c.TestTimeout, n.c.Node, "-r", reporter, f)
		if err != nil {
			// A file that hangs fails; the others still run.
			code = -1
			if ctx.Err() != nil {
				return nil, err
			}
		}
		rec := record{Test: f, Outcome: "passed"}
		if code != 0 {
			rec.Outcome = "failed"
			rec.Message = fmt.Sprintf("exit status %d: %s", code, tail(logFile, 6))
		}
		if err := appendRecord(recs, rec); err != nil {
			return nil, err
		}
	}
	return readRecords(recs)
}

func appendRecord(path string, rec record) error {
	b, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	_, err = f.Write(append(b, '\n'))
	return errors.Join(err, f.Close())
}

// tail is the last lines of a log file, joined.
func tail(path string, lines int) string {
	b, _ := os.ReadFile(path)
	all := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(all) > lines {
		all = all[len(all)-lines:]
	}
	return strings.Join(all, " | ")
}

// pytestSuite is psycopg 3's test suite (tests/ of its source tree), run by pytest with the
// test DSN in PSYCOPG_TEST_DSN.
type pytestSuite struct{ c config }

func (p *pytestSuite) name() string { return "psycopg" }
func (p *pytestSuite) db() string   { return "psycopg" }

func (p *pytestSuite) check() error {
	if p.c.PsycopgDir == "" {
		return errors.New("no --psycopg-dir (PSYCOPG_SUITE_DIR): scripts/driver-suites.sh gets it")
	}
	for _, f := range []string{"tests/conftest.py", "tests/fix_db.py", "pyproject.toml"} {
		if _, err := os.Stat(filepath.Join(p.c.PsycopgDir, f)); err != nil {
			return fmt.Errorf("%s is not psycopg's source tree: %w", p.c.PsycopgDir, err)
		}
	}
	cmd := exec.Command(p.c.Python, "-c", "import psycopg, psycopg_pool, pytest, pytest_asyncio, pytest_timeout")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s cannot import psycopg, psycopg_pool, pytest and its plugins (run scripts/driver-suites.sh): %w\n%s", p.c.Python, err, out)
	}
	return nil
}

func (p *pytestSuite) run(ctx context.Context, t target, only []string, dir, tag string) (*results, error) {
	plugins := filepath.Join(dir, "plugins")
	// pytest makes --basetemp itself, not its parent.
	for _, d := range []string{plugins, filepath.Join(dir, "tmp")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}
	if err := os.WriteFile(filepath.Join(plugins, "fence_suite_plugin.py"), pytestPlugin, 0o644); err != nil {
		return nil, err
	}
	recs := filepath.Join(dir, tag+".jsonl")
	_ = os.Remove(recs)
	args := []string{p.c.Python, "-bb", "-m", "pytest", "-p", "fence_suite_plugin", "-p", "no:cacheprovider",
		"-p", "no:randomly", fmt.Sprintf("--timeout=%d", int(p.c.TestTimeout.Seconds())), "-m", p.c.Markers,
		"--basetemp=" + filepath.Join(dir, "tmp", tag), "-q", "-rfE", "--no-header"}
	if only != nil {
		args = append(args, only...)
	} else {
		args = append(args, p.c.PytestArgs...)
	}
	env := []string{"PYTHONPATH=" + plugins, "PYTHONDONTWRITEBYTECODE=1", "PSYCOPG_TEST_DSN=" + t.dsn(), "FENCE_SUITE_LOG=" + recs}
	logFile := filepath.Join(dir, tag+".log")
	code, err := command(ctx, p.c.PsycopgDir, env, logFile, 2*time.Hour, args...)
	if err != nil {
		return nil, err
	}
	// 0: all passed, 1: some failed; anything else (no tests, usage, internal error,
	// interrupted) means the run itself did not work.
	if code > 1 {
		return nil, fmt.Errorf("pytest exited %d: %s", code, tail(logFile, 20))
	}
	return readRecords(recs)
}

// pgxSuite is pgx's own tests: the pgx module the proxy is built with (its version in go.mod),
// copied from the module cache into the work folder, run by go test -json in the packages
// that talk to a server, with PGX_TEST_DATABASE the run's URL (the fencing parameters in its
// options). Tests that need another server setup (PGX_TEST_TLS_CONN_STRING,
// PGX_TEST_PGBOUNCER_CONN_STRING...) skip themselves. A record is a top-level test; pgx's
// tests are not instrumented, so their connections are not counted.
type pgxSuite struct {
	c   config
	src string // the copy of the module
}

func (p *pgxSuite) name() string { return "pgx" }
func (p *pgxSuite) uncounted()   {} // its connections are not counted
func (p *pgxSuite) db() string   { return "pgx" }

func (p *pgxSuite) check() error {
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "github.com/jackc/pgx/v5").Output()
	if err != nil {
		return fmt.Errorf("go list -m github.com/jackc/pgx/v5 (run make deps): %w", err)
	}
	if dir := strings.TrimSpace(string(out)); dir == "" {
		return errors.New("pgx's module is not in the module cache (run make deps)")
	}
	return nil
}

// prepare creates in db what pgx's tests expect of their database (its
// testsetup/postgresql_setup.sql, the part that is not roles or server settings).
func (p *pgxSuite) prepare(ctx context.Context, url string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	for _, q := range []string{"CREATE EXTENSION IF NOT EXISTS hstore", "CREATE EXTENSION IF NOT EXISTS ltree", "CREATE DOMAIN uint64 AS numeric(20,0)"} {
		if _, err := conn.Exec(ctx, q); err != nil {
			return fmt.Errorf("pgx's test setup: %s: %w", q, err)
		}
	}
	return nil
}

// source copies the module once into dir (the cache's copy is read-only).
func (p *pgxSuite) source(ctx context.Context, dir string) (string, error) {
	if p.src != "" {
		return p.src, nil
	}
	out, err := exec.CommandContext(ctx, "go", "list", "-m", "-f", "{{.Dir}}", "github.com/jackc/pgx/v5").Output()
	if err != nil {
		return "", err
	}
	src := filepath.Join(dir, "pgx-src")
	if out, err := exec.CommandContext(ctx, "cp", "-r", strings.TrimSpace(string(out)), src).CombinedOutput(); err != nil {
		return "", fmt.Errorf("copying pgx's module: %w: %s", err, out)
	}
	if out, err := exec.CommandContext(ctx, "chmod", "-R", "u+w", src).CombinedOutput(); err != nil {
		return "", fmt.Errorf("chmod: %w: %s", err, out)
	}
	p.src = src
	return src, nil
}

func (p *pgxSuite) run(ctx context.Context, t target, only []string, dir, tag string) (*results, error) {
	src, err := p.source(ctx, dir)
	if err != nil {
		return nil, err
	}
	q := url.Values{"sslmode": {"disable"}}
	if o := t.options(); o != "" {
		q.Set("options", o)
	}
	u := url.URL{Scheme: "postgres", User: url.UserPassword(t.user, t.password), Host: fmt.Sprintf("%s:%d", t.host, t.port), Path: "/" + t.db,
		RawQuery: strings.ReplaceAll(q.Encode(), "+", "%20")}
	env := []string{"PGX_TEST_DATABASE=" + u.String()}
	// Runs: the configured packages, or, for only, each test's package with -run.
	type goTest struct{ pkg, run string }
	var runs []goTest
	if only == nil {
		for _, pkg := range p.c.PgxPackages {
			runs = append(runs, goTest{pkg, p.c.PgxRun})
		}
	} else {
		for _, test := range only {
			pkg, name, _ := strings.Cut(test, "::")
			runs = append(runs, goTest{pkg, "^" + regexp.QuoteMeta(name) + "$"})
		}
	}
	r := &results{}
	for i, gt := range runs {
		logFile := filepath.Join(dir, fmt.Sprintf("%s-%d.jsonl", tag, i))
		args := []string{"go", "test", "-json", "-count=1", "-p", "1", "-timeout", (10 * p.c.TestTimeout).String()}
		if gt.run != "" {
			args = append(args, "-run", gt.run)
		}
		code, err := command(ctx, src, env, logFile, 2*time.Hour, append(args, gt.pkg)...)
		if err != nil {
			return nil, err
		}
		n, err := readGoTestJSON(logFile, gt.pkg, r)
		if err != nil {
			return nil, err
		}
		if n == 0 && code != 0 {
			return nil, fmt.Errorf("go test %s exited %d without a test result: %s", gt.pkg, code, tail(logFile, 10))
		}
	}
	return r, nil
}

// readGoTestJSON adds the top-level tests of go test -json's output (of package pkg, as the
// command line named it) to r, each with its last lines of output when it failed, and returns
// how many it added.
func readGoTestJSON(path, pkg string, r *results) (int, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	output := map[string][]string{}
	n := 0
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 16*1024*1024)
	for sc.Scan() {
		var ev struct{ Action, Test, Output string }
		if json.Unmarshal(sc.Bytes(), &ev) != nil || ev.Test == "" || strings.Contains(ev.Test, "/") {
			continue // go's own lines (a build failure), package events, subtests
		}
		switch ev.Action {
		case "output":
			lines := append(output[ev.Test], strings.TrimRight(ev.Output, "\n"))
			output[ev.Test] = lines[max(0, len(lines)-8):]
		case "pass", "fail", "skip":
			outcome := map[string]string{"pass": "passed", "fail": "failed", "skip": "skipped"}[ev.Action]
			rec := record{Test: pkg + "::" + ev.Test, Outcome: outcome}
			if outcome == "failed" {
				rec.Message = strings.Join(output[ev.Test], " | ")
			}
			r.add(rec)
			n++
		}
	}
	return n, sc.Err()
}
