package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/consul/api"
	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/lease/consul"
	"github.com/fenceproxy/fenceproxy/internal/lease/pglease"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// The resources of the fenced modes, one a path of admission: a bare resource (the
// database orders the tokens clients bring; the token is bareToken), a Consul-validated one
// (the token is the LockIndex of a Consul lock this program holds, as fenceproxy lock
// does) and a PostgreSQL lease resource (the token is the generation of a lease this program
// holds in the mode's database, as fenceproxy lock --store postgres does). The last two are
// named after their suite (<db>_consul, <db>_lease): a suite's test that binds in template1
// (node-postgres's psql) records its Consul holder there, which every database created
// afterwards copies, and the next suite's lock, of another key, holds the same LockIndex
// with another session (the database would rightly call that a regression).
const (
	bareResource = "suite"
	bareToken    = 1
)

// modes are the runs of a suite: direct is the reference, the others go through a proxy of
// their own.
var modes = []string{"direct", "unfenced", "bare", "consul", "lease"}

// target is where one run of a suite connects: the server itself or the proxy, with the
// fencing parameters of its path in the options or without.
type target struct {
	mode     string // one of modes
	host     string
	port     int
	db       string
	user     string
	password string
	// The fenced modes' parameters (resource empty: none); session is the lock's holder,
	// fence.session (Consul only, as fenceproxy lock passes it).
	resource string
	token    int64
	session  string
	// held is the lock the token comes from (consul, lease): the run is void if it is lost.
	held lease.Lease
}

// options is what a fenced run adds to the driver's startup options.
func (t target) options() string {
	if t.resource == "" {
		return ""
	}
	s := fmt.Sprintf("-c fence.resource=%s -c fence.token=%d", t.resource, t.token)
	if t.session != "" {
		s += " -c fence.session=" + t.session
	}
	return s
}

// dsn is a libpq keyword/value string (psycopg's PSYCOPG_TEST_DSN).
func (t target) dsn() string {
	s := fmt.Sprintf("host=%s port=%d dbname=%s user=%s password=%s sslmode=disable", t.host, t.port, t.db, t.user, t.password)
	if o := t.options(); o != "" {
		s += " options='" + o + "'"
	}
	return s
}

// pgEnv is the libpq-style environment node-postgres reads (PGOPTIONS included).
func (t target) pgEnv() []string {
	env := []string{"PGHOST=" + t.host, "PGPORT=" + strconv.Itoa(t.port), "PGDATABASE=" + t.db,
		"PGUSER=" + t.user, "PGPASSWORD=" + t.password, "PGSSLMODE=disable"}
	if o := t.options(); o != "" {
		env = append(env, "PGOPTIONS="+o)
	}
	return env
}

// lost says why the run's lock is gone ("" while it is held, or for a mode without one).
func (t target) lost() string {
	if t.held == nil {
		return ""
	}
	select {
	case <-t.held.Done():
		return fmt.Sprintf("the %s lock of %s was lost during the run (%v): its results are void", t.held.Store(), t.resource, t.held.Err())
	default:
		return ""
	}
}

// conns counts the connections a test opened: to the run's host and port with a fencing
// token in the options, without one, or elsewhere (a conninfo of the test's own).
type conns struct {
	Fenced    int `json:"fenced"`
	Unfenced  int `json:"unfenced"`
	Elsewhere int `json:"elsewhere"`
}

// record is one test's outcome as the suite's reporter writes it (a JSON line).
type record struct {
	Test    string `json:"test"`
	Outcome string `json:"outcome"` // passed, failed, error, skipped
	Message string `json:"message"`
	Conns   conns  `json:"conns"`
}

// results are a run's records by test, and the order the tests ran in.
type results struct {
	byTest map[string]record
	order  []string
	took   time.Duration
}

func (r *results) add(rec record) {
	if r.byTest == nil {
		r.byTest = map[string]record{}
	}
	prev, ok := r.byTest[rec.Test]
	if !ok {
		r.order = append(r.order, rec.Test)
	}
	// A node-postgres file's record comes in two lines: the connections its reporter saw
	// outside named tests, then its exit status.
	if rec.Conns == (conns{}) {
		rec.Conns = prev.Conns
	}
	r.byTest[rec.Test] = rec
}

// outcome is the test's outcome, "missing" when it did not run (a node-postgres file stops
// at its first failure).
func (r *results) outcome(test string) string {
	if rec, ok := r.byTest[test]; ok {
		return rec.Outcome
	}
	return "missing"
}

// suite is one driver's test suite.
type suite interface {
	name() string
	// db is the prefix of the suite's databases (one per mode).
	db() string
	// check says what is missing before any server starts.
	check() error
	// run runs the whole suite (only == nil) or the given tests against t, writing its
	// logs under dir/tag.
	run(ctx context.Context, t target, only []string, dir, tag string) (*results, error)
}

// session is the servers of a whole run: one PostgreSQL cluster, a Consul agent when the
// consul mode runs, and a proxy per suite and mode.
type session struct {
	c        config
	work     string
	fenceBin string
	keyFile  string
	pg       *testenv.Postgres
	consul   *testenv.Consul
	consulCl *api.Client
	procs    []*testenv.ProxyProcess
	held     []lease.Lease
}

func (s *session) close() error {
	var errs []error
	for i := len(s.procs) - 1; i >= 0; i-- {
		errs = append(errs, s.procs[i].Terminate(20*time.Second))
	}
	for _, l := range s.held {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		errs = append(errs, l.Release(ctx))
		cancel()
	}
	if s.consul != nil {
		errs = append(errs, s.consul.Close())
	}
	if s.pg != nil {
		errs = append(errs, s.pg.Close())
	}
	if s.work != "" {
		if s.c.Keep {
			say("kept %s", s.work)
		} else {
			errs = append(errs, os.RemoveAll(s.work))
		}
	}
	return errors.Join(errs...)
}

func (s *session) adminURL(db string) string {
	return s.pg.URLWithPassword(testenv.AdminUser, testenv.AdminPassword, db)
}

// migrate installs the fence schema and the proxy key in db, as `fenceproxy migrate` does for
// an operator.
func (s *session) migrate(ctx context.Context, db string) error {
	cmd := exec.CommandContext(ctx, s.fenceBin, "migrate", "--database", s.adminURL(db), "--key-file", s.keyFile, "--log-format", "console")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("fenceproxy migrate %s: %w\n%s", db, err, out)
	}
	return nil
}

// hold takes the lock of resource in store, as fenceproxy lock does, and keeps it (renewed
// by the lease's own keep-alive) until the session closes.
func (s *session) hold(ctx context.Context, store lease.Store, resource string) (lease.Lease, error) {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	l, err := store.Campaign(ctx, resource)
	if err != nil {
		return nil, fmt.Errorf("taking the %s lock of %s: %w", store.Name(), resource, err)
	}
	s.held = append(s.held, l)
	return l, nil
}

// targets creates the suite's databases, takes the locks of the consul and lease modes and
// starts a proxy per mode, and returns where each mode connects.
func (s *session) targets(ctx context.Context, st suite) (map[string]target, error) {
	out := map[string]target{}
	for _, m := range s.c.Modes {
		t := target{mode: m, host: s.pg.Host, port: s.pg.Port, db: st.db() + "_" + m, user: testenv.AdminUser, password: testenv.AdminPassword}
		if err := s.pg.ExecContext(ctx, "CREATE DATABASE "+t.db); err != nil {
			return nil, err
		}
		// The same schema and key in every mode's database: the runs differ only in the path.
		if err := s.migrate(ctx, t.db); err != nil {
			return nil, err
		}
		if pr, ok := st.(interface {
			prepare(ctx context.Context, url string) error
		}); ok {
			if err := pr.prepare(ctx, s.adminURL(t.db)); err != nil {
				return nil, err
			}
		}
		if m == "direct" {
			out[m] = t
			continue
		}
		// A proxy per mode, as a deployment of that path has it: its control database is
		// the mode's own, so that it asks there whether a raise ended a fenced backend
		// instead of waiting for a raise it might hear of (psycopg's tests end backends and
		// time the error). --unfenced allow: tests that set their own options carry no token.
		flags := []string{"--upstream", fmt.Sprintf("postgres://%s:%d", s.pg.Host, s.pg.Port),
			"--key-file", s.keyFile, "--unfenced", "allow", "--control-database", s.adminURL(t.db),
			"--tls-cert", filepath.Join(s.pg.DataDir, "server.crt"), "--tls-key", filepath.Join(s.pg.DataDir, "server.key")}
		switch m {
		case "unfenced":
			flags = append(flags, "--resource", bareResource)
		case "bare":
			flags = append(flags, "--resource", bareResource)
			t.resource, t.token = bareResource, bareToken
		case "consul":
			res, key := st.db()+"_consul", "locks/driversuites/"+st.db()
			l, err := s.hold(ctx, &consul.Store{Client: s.consulCl, Key: key, TTL: 30 * time.Second}, res)
			if err != nil {
				return nil, err
			}
			flags = append(flags, "--resource", res+"="+key, "--consul-addr", s.consul.Addr)
			t.resource, t.token, t.session, t.held = res, l.Token(), l.Holder(), l
		case "lease":
			res := st.db() + "_lease"
			l, err := s.hold(ctx, &pglease.Store{URL: s.adminURL(t.db), TTL: time.Minute, Holder: "driversuites-" + st.db()}, res)
			if err != nil {
				return nil, err
			}
			flags = append(flags, "--lease-resource", res)
			t.resource, t.token, t.held = res, l.Token(), l
		}
		admin, err := testenv.PickFreePort()
		if err != nil {
			return nil, err
		}
		flags = append(flags, "--admin-listen", fmt.Sprintf("127.0.0.1:%d", admin))
		px, err := testenv.LaunchProxyProcess(ctx, s.work, "fenceproxy-"+st.db()+"-"+m, s.fenceBin, flags...)
		if err != nil {
			return nil, err
		}
		s.procs = append(s.procs, px)
		say("%s, %s: fenceproxy on %s: serve %s", st.name(), m, px.Addr(), redact(strings.Join(flags, " ")))
		// As an operator does: sessions once /readyz says so (the control database's tokens
		// read, Consul's lock state known).
		if err := waitReady(ctx, fmt.Sprintf("http://127.0.0.1:%d/readyz", admin)); err != nil {
			return nil, fmt.Errorf("%s, %s: %w (its log: %s)", st.name(), m, err, px.LogFile)
		}
		t.host, t.port = px.Host, px.Port
		if t.resource != "" {
			if err := checkBound(ctx, t); err != nil {
				return nil, fmt.Errorf("%s, %s: %w", st.name(), m, err)
			}
		}
		out[m] = t
	}
	return out, nil
}

// redact hides the password in a command line.
func redact(s string) string {
	return strings.ReplaceAll(s, ":"+testenv.AdminPassword+"@", ":***@")
}

// waitReady polls a proxy's /readyz until it answers 200 (within a minute).
func waitReady(ctx context.Context, u string) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	last := "no answer"
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
		if err != nil {
			return err
		}
		if resp, err := http.DefaultClient.Do(req); err == nil {
			b, _ := io.ReadAll(io.LimitReader(resp.Body, 1000))
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = fmt.Sprintf("%s: %s", resp.Status, strings.TrimSpace(string(b)))
		} else {
			last = err.Error()
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("fenceproxy not ready within a minute: %s", last)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// checkBound makes sure a fenced session works before a suite depends on it: its first bind
// admits the token, and its backend shows up in fence.bindings.
func checkBound(ctx context.Context, t target) error {
	q := url.Values{"sslmode": {"disable"}, "options": {t.options()}}
	u := url.URL{Scheme: "postgres", User: url.UserPassword(t.user, t.password), Host: fmt.Sprintf("%s:%d", t.host, t.port), Path: "/" + t.db,
		RawQuery: strings.ReplaceAll(q.Encode(), "+", "%20")}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, u.String())
	if err != nil {
		return fmt.Errorf("a fenced session through the proxy failed: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var n int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM fence.bindings WHERE pid = pg_backend_pid()").Scan(&n); err != nil {
		return fmt.Errorf("reading fence.bindings through the proxy: %w", err)
	}
	if n != 1 {
		return fmt.Errorf("a fenced session through the proxy is not bound (%d rows in fence.bindings)", n)
	}
	return nil
}

// verdict is what the comparison found for one suite.
type verdict struct {
	differences []string            // passed directly, failed through the proxy, also alone
	expected    []string            // failed through the proxy where the path refuses by design (expectedFailures)
	flaky       []string            // failed through the proxy in the full run, not reliably alone
	noToken     map[string][]string // by fenced mode: its tests that connected through the proxy without a token
	elsewhere   map[string][]string // by fenced mode: its tests that connected to an address of their own
}

// run builds fenceproxy, starts the servers, runs every suite in every mode and reports.
// It returns the number of tests that pass directly and fail through the proxy.
func run(ctx context.Context, c config) (failed int, err error) {
	started := time.Now()
	if len(c.Modes) == 0 || c.Modes[0] != "direct" {
		return 0, errors.New("--modes must start with direct (the reference run)")
	}
	for _, m := range c.Modes {
		if !slices.Contains(modes, m) {
			return 0, fmt.Errorf("unknown mode %q: want %s", m, strings.Join(modes, ", "))
		}
	}
	var suites []suite
	for _, name := range c.Suites {
		switch name {
		case "node-postgres":
			suites = append(suites, &nodeSuite{c: c})
		case "psycopg":
			suites = append(suites, &pytestSuite{c: c})
		case "pgx":
			suites = append(suites, &pgxSuite{c: c})
		default:
			return 0, fmt.Errorf("unknown suite %q: want node-postgres, psycopg, pgx", name)
		}
	}
	for _, st := range suites {
		if err := st.check(); err != nil {
			return 0, fmt.Errorf("%s: %w", st.name(), err)
		}
	}

	s := &session{c: c}
	defer func() { err = errors.Join(err, s.close()) }()
	if s.work, err = os.MkdirTemp("", "fenceproxy-driversuites-"); err != nil {
		return 0, err
	}
	if err := os.MkdirAll(c.BinDir, 0o755); err != nil {
		return 0, err
	}
	say("building fenceproxy into %s", c.BinDir)
	bins, err := testenv.BuildGoContext(ctx, c.BinDir, "./cmd/fenceproxy")
	if err != nil {
		return 0, err
	}
	s.fenceBin = bins[0]
	s.keyFile = filepath.Join(s.work, "fenceproxy.key")
	// max_prepared_transactions: psycopg's two-phase commit tests run instead of skipping.
	// SSL: the suites' TLS tests run (through the proxy with its own --tls-cert) instead of
	// failing on a server without it.
	if s.pg, err = testenv.LaunchPostgres(ctx, testenv.WithAuth("scram-sha-256"), testenv.WithSSL(),
		testenv.WithConf("max_prepared_transactions", "10")); err != nil {
		return 0, err
	}
	say("PostgreSQL on %s:%d; folder %s", s.pg.Host, s.pg.Port, s.work)
	// The fence schema in template1 too: every database has it, as in a deployment that fences
	// them all (node-postgres's gh-issues/130-tests.js runs psql with the run's PGOPTIONS in
	// template1, and a fenced session needs the schema where it binds).
	if err := s.migrate(ctx, "template1"); err != nil {
		return 0, err
	}
	if slices.Contains(c.Modes, "consul") {
		if s.consul, err = testenv.LaunchConsul(ctx); err != nil {
			return 0, err
		}
		if s.consulCl, err = s.consul.NewClient(); err != nil {
			return 0, err
		}
		say("Consul on %s", s.consul.Addr)
	}

	type done struct {
		st   suite
		runs map[string]*results
		v    verdict
	}
	var all []done
	for _, st := range suites {
		targets, err := s.targets(ctx, st)
		if err != nil {
			return 0, err
		}
		runs := map[string]*results{}
		for _, m := range c.Modes {
			t0 := time.Now()
			t := targets[m]
			say("%s, %s: %s", st.name(), m, describe(t))
			r, err := st.run(ctx, t, nil, s.work, st.db()+"-"+m)
			if err != nil {
				return 0, fmt.Errorf("%s, %s: %w", st.name(), m, err)
			}
			r.took = time.Since(t0)
			if why := t.lost(); why != "" {
				return 0, fmt.Errorf("%s, %s: %s", st.name(), m, why)
			}
			runs[m] = r
			say("%s, %s: %s in %s", st.name(), m, counts(r), r.took.Round(time.Second))
		}
		v, err := compare(ctx, c, st, targets, runs, s.work)
		if err != nil {
			return 0, err
		}
		all = append(all, done{st, runs, v})
	}

	fmt.Printf("\n== the drivers' own test suites: straight to PostgreSQL, and through fenceproxy by each admission path ==\n")
	fmt.Printf("%-14s %-9s %7s %7s %8s %7s %8s\n", "suite", "mode", "passed", "failed", "skipped", "errors", "time")
	for _, d := range all {
		for _, m := range c.Modes {
			r := d.runs[m]
			n := tally(r)
			fmt.Printf("%-14s %-9s %7d %7d %8d %7d %7ds\n", d.st.name(), m, n["passed"], n["failed"], n["skipped"], n["error"], int(r.took.Seconds()))
		}
	}
	for _, d := range all {
		name := d.st.name()
		_, uncounted := d.st.(interface{ uncounted() })
		for _, m := range c.Modes {
			if !fenced(m) || uncounted {
				continue
			}
			fmt.Printf("\n%s, %s run: tests that connected through the proxy without a token (they set their own options; unfenced under --unfenced allow): %d\n", name, m, len(d.v.noToken[m]))
			printList(d.v.noToken[m])
			fmt.Printf("%s, %s run: tests that connected to an address of their own (not through the proxy; per file): %d\n", name, m, len(d.v.elsewhere[m]))
			printList(perFile(d.v.elsewhere[m]))
		}
		if len(d.v.flaky) > 0 {
			fmt.Printf("\n%s: flaky (failed through the proxy in the full run; alone, passed through it at least once or failed directly too): %d\n", name, len(d.v.flaky))
			printList(d.v.flaky)
		}
		if len(d.v.expected) > 0 {
			fmt.Printf("\n%s: failed through fenceproxy where the path refuses by design: %d\n", name, len(d.v.expected))
			printList(d.v.expected)
		}
		fmt.Printf("\n%s: passed directly, failed through fenceproxy: %d\n", name, len(d.v.differences))
		printList(d.v.differences)
		failed += len(d.v.differences)
	}
	fmt.Printf("\nwall time: %ds\n", int(time.Since(started).Seconds()))
	return failed, nil
}

// fenced says whether mode's sessions present a token.
func fenced(mode string) bool { return mode == "bare" || mode == "consul" || mode == "lease" }

func describe(t target) string {
	switch t.mode {
	case "direct":
		return fmt.Sprintf("straight to PostgreSQL on %s:%d, database %s", t.host, t.port, t.db)
	case "unfenced":
		return fmt.Sprintf("through fenceproxy on %s:%d, no token, database %s", t.host, t.port, t.db)
	}
	return fmt.Sprintf("through fenceproxy on %s:%d, options %q, database %s", t.host, t.port, t.options(), t.db)
}

func printList(items []string) {
	for _, it := range items {
		fmt.Println("  " + it)
	}
}

// perFile sums up a list of tests ("file::name ...") as "file: N tests".
func perFile(tests []string) []string {
	var files []string
	n := map[string]int{}
	for _, t := range tests {
		f, _, _ := strings.Cut(t, "::")
		f, _, _ = strings.Cut(f, " ")
		if n[f] == 0 {
			files = append(files, f)
		}
		n[f]++
	}
	out := make([]string, len(files))
	for i, f := range files {
		out[i] = fmt.Sprintf("%s: %d", f, n[f])
	}
	return out
}

func tally(r *results) map[string]int {
	n := map[string]int{}
	for _, rec := range r.byTest {
		n[rec.Outcome]++
	}
	return n
}

func counts(r *results) string {
	n := tally(r)
	return fmt.Sprintf("%d passed, %d failed, %d skipped, %d errors", n["passed"], n["failed"], n["skipped"], n["error"])
}

// expectedFailures are the tests ("mode file-or-test") that a path refuses by design,
// with the reason: they fail through the proxy there however transparent it is.
var expectedFailures = map[string]string{
	// psql into template1 with the run's PGOPTIONS: the token is the generation of the lease
	// held in the mode's database, and template1 has no lease of its own (a PostgreSQL lease
	// lives in the database it fences), so fence.lease_bind refuses the session there
	// ("fencing lease missing"), as it must.
	"lease test/integration/gh-issues/130-tests.js": "a lease resource's token is valid only in the database that holds the lease; this test's psql goes to template1 (fencing lease missing)",
}

// compare finds the tests that passed directly and failed through the proxy, and sorts them
// into differences and flaky ones by running each alone again on both sides.
func compare(ctx context.Context, c config, st suite, targets map[string]target, runs map[string]*results, work string) (verdict, error) {
	v := verdict{noToken: map[string][]string{}, elsewhere: map[string][]string{}}
	ref := runs["direct"]
	for _, m := range c.Modes[1:] {
		other := runs[m]
		for _, test := range ref.order {
			if ref.outcome(test) != "passed" {
				continue
			}
			out := other.outcome(test)
			if out == "passed" || out == "skipped" {
				continue
			}
			line := fmt.Sprintf("%s: %s (%s): %s", m, test, out, oneLine(other.byTest[test].Message))
			if why, ok := expectedFailures[m+" "+test]; ok {
				v.expected = append(v.expected, line+"; expected: "+why)
				continue
			}
			if c.Recheck == 0 {
				v.differences = append(v.differences, line)
				continue
			}
			proxyFails, directFails := 0, 0
			for i := range c.Recheck {
				tag := fmt.Sprintf("%s-recheck-%d", st.db(), i)
				r, err := st.run(ctx, targets[m], []string{test}, work, tag+"-"+m)
				if err != nil {
					return v, err
				}
				if r.outcome(test) != "passed" {
					proxyFails++
				}
				if r, err = st.run(ctx, targets["direct"], []string{test}, work, tag+"-direct"); err != nil {
					return v, err
				}
				if r.outcome(test) != "passed" {
					directFails++
				}
			}
			if proxyFails < c.Recheck || directFails > 0 {
				v.flaky = append(v.flaky, fmt.Sprintf("%s; alone it failed %d of %d times through the proxy, %d of %d directly", line, proxyFails, c.Recheck, directFails, c.Recheck))
			} else {
				v.differences = append(v.differences, line)
			}
		}
	}
	for m, r := range runs {
		if !fenced(m) {
			continue
		}
		for _, test := range r.order {
			cn := r.byTest[test].Conns
			summary := fmt.Sprintf("%s (%d with the token, %d without, %d elsewhere)", test, cn.Fenced, cn.Unfenced, cn.Elsewhere)
			if cn.Unfenced > 0 {
				v.noToken[m] = append(v.noToken[m], summary)
			}
			if cn.Elsewhere > 0 {
				v.elsewhere[m] = append(v.elsewhere[m], summary)
			}
		}
	}
	return v, nil
}

// oneLine shortens a failure message for the report.
func oneLine(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > 300 {
		s = s[:300] + "..."
	}
	return s
}
