// Command driversuites runs the drivers' own test suites (node-postgres's integration tests,
// psycopg 3's pytest suite, pgx's tests) straight to PostgreSQL and through fenceproxy by each
// admission path (modes): unfenced, a bare resource, a Consul-validated resource (the token is
// the LockIndex of a Consul lock this program holds, with the holder's session) and a
// PostgreSQL lease resource (the token is the generation of a lease this program holds in the
// mode's database), the token in the driver's startup options. A fenced session is bound at
// startup and then relayed plainly, so it must be as transparent as an unfenced one: every
// test that passes directly must pass through the proxy in every mode, except the few that a
// path refuses by design (expectedFailures).
//
// `make driver-suites` runs it through scripts/driver-suites.sh, which installs what the
// suites need and gets their sources; this program starts the servers (internal/testenv: a
// PostgreSQL 15 cluster, a Consul agent, `fenceproxy migrate`, and `fenceproxy serve` per suite
// and mode, each with the mode's database as its control database), runs each
// suite in each mode in a database of its own, compares the outcomes per test, reruns alone
// each test that passed directly and failed through the proxy (one that then passes through
// the proxy, or fails directly too, is flaky: timing on a busy machine, not the proxy), and
// prints a table and the differences. It exits 1 when a test passes directly but fails
// through the proxy.
//
// A test that replaces the connection's options (psycopg.connect(dsn, options=...), a
// node-postgres Client with its own `options`) carries no token: the proxy runs with
// --unfenced allow, so it runs unfenced even in the fenced runs. A small reporter loaded into
// node-postgres and psycopg (node_reporter.js with node -r, pytest_plugin.py with pytest -p)
// records every test's outcome and the connections it opened, with or without a token; the
// program lists the fenced runs' tests that opened any without one. pgx's outcomes come from
// go test -json.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/alecthomas/kong"
)

// config is the program's settings: flags or the environment variables scripts/driver-suites.sh
// passes on.
type config struct {
	Suites      []string      `help:"Suites to run: node-postgres, psycopg, pgx." default:"node-postgres,psycopg,pgx" env:"SUITES"`
	Modes       []string      `help:"Modes to run, direct (the reference) first: direct, unfenced (through the proxy, no token), bare (a bare resource, token 1), consul (a Consul-validated resource, token the LockIndex of a lock this program holds), lease (a --lease-resource, token the generation of a PostgreSQL lease this program holds)." default:"direct,unfenced,bare,consul,lease" env:"SUITE_MODES"`
	NodeDir     string        `help:"node-postgres's package folder (lib/, test/, node_modules/)." type:"path" env:"NODE_SUITE_DIR"`
	NodeFiles   string        `help:"Only the integration test files whose path matches this regular expression." env:"NODE_SUITE_FILES"`
	Node        string        `help:"The node program." default:"node" env:"NODE"`
	PsycopgDir  string        `help:"psycopg's source folder with tests/ and pyproject.toml." type:"path" env:"PSYCOPG_SUITE_DIR"`
	PytestArgs  []string      `help:"More pytest arguments (space-separated), e.g. tests/test_copy.py to run a part." sep:" " env:"SUITE_PYTEST_ARGS"`
	PgxPackages []string      `help:"pgx's packages to test (space-separated, relative to its module)." default:". ./pgconn ./pgxpool ./stdlib ./pgtype" sep:" " env:"SUITE_PGX_PACKAGES"`
	PgxRun      string        `help:"Only pgx's tests whose name matches this go test -run expression." env:"SUITE_PGX_RUN"`
	Markers     string        `help:"pytest -m expression: pproxy is not in Debian, mypy checks no database." default:"not proxy and not mypy" env:"SUITE_MARKERS"`
	Python      string        `help:"Debian's python3, for which python3-psycopg is installed." default:"/usr/bin/python3" env:"SUITE_PYTHON"`
	TestTimeout time.Duration `help:"Per-test timeout (pytest), per-file timeout (node-postgres: 5 times this)." default:"120s" env:"SUITE_TEST_TIMEOUT"`
	Recheck     int           `help:"Reruns alone, on each side, of a test that passed directly and failed through the proxy (0: none)." default:"3" env:"SUITE_RECHECK"`
	BinDir      string        `help:"Where fenceproxy is built." default:"bin" type:"path" env:"SUITE_BIN_DIR"`
	Keep        bool          `help:"Keep the temporary folder (logs, per-test records) and print its path." env:"SUITE_KEEP"`
}

func main() {
	var c config
	parser, err := kong.New(&c, kong.Name("driversuites"),
		kong.Description("The drivers' own test suites straight to PostgreSQL and through fenceproxy, unfenced and fenced."),
		kong.UsageOnError())
	if err == nil {
		_, err = parser.Parse(os.Args[1:])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "driversuites:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	failed, err := run(ctx, c)
	interrupted := ctx.Err() != nil
	stop()
	switch {
	case interrupted:
		fmt.Println("driversuites: interrupted")
		os.Exit(130)
	case err != nil:
		fmt.Printf("driversuites: FAILED: %v\n", err)
		os.Exit(1)
	case failed > 0:
		fmt.Printf("driversuites: FAILED: %d test(s) pass directly but fail through the proxy\n", failed)
		os.Exit(1)
	}
	fmt.Println("driversuites: ok: every test that passes directly passes through fenceproxy, by every path run")
}

func say(format string, args ...any) { fmt.Printf("driversuites: "+format+"\n", args...) }
