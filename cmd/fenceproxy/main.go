// Command fenceproxy is a PostgreSQL wire-protocol proxy that fences stale
// leaders: it binds each session to its fencing token inside PostgreSQL, and
// admitting a higher token ends every session of a lower one.
//
//	fenceproxy migrate --database postgres://admin@127.0.0.1:5432/app --key-file proxy.key
//	fenceproxy serve   --listen 127.0.0.1:7432 --upstream postgres://127.0.0.1:5432 --resource billing --key-file proxy.key
//	fenceproxy lock    --resource billing --database-url postgres://app@127.0.0.1:7432/app -- ./billing
//	fenceproxy lock    --store postgres --database postgres://lock@127.0.0.1:5432/app --resource billing --database-url postgres://app@127.0.0.1:7432/app -- ./billing
//
// Every flag can also be set by an environment variable FENCEPROXY_<FLAG>
// (for example FENCEPROXY_UPSTREAM) and in a YAML or JSON file given with
// --config whose keys are the flag names (deploy/fenceproxy.yaml sets every one).
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/debug"
	"slices"
	"strings"
	"syscall"

	"github.com/alecthomas/kong"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// globals are flags every subcommand takes.
type globals struct {
	Config    kong.ConfigFlag  `help:"Configuration file, YAML (.yaml, .yml) or JSON; its keys are the flag names (e.g. listen: 127.0.0.1:7432)." type:"path"`
	LogLevel  string           `help:"Log level: debug, info, warn, error." default:"info" enum:"debug,info,warn,error"`
	LogFormat string           `help:"Log format: json or console." default:"json" enum:"json,console"`
	Version   kong.VersionFlag `help:"Print the version and exit (as the version command does)."`
}

type cli struct {
	globals

	Serve   ServeCmd   `cmd:"" help:"Run the proxy."`
	Migrate MigrateCmd `cmd:"" help:"Install or upgrade the fence schema in a database."`
	Lock    LockCmd    `cmd:"" help:"Run a command as the leader of a resource (a Consul lock, an etcd election, a ZooKeeper lock, or the PostgreSQL lease; see --store), with its fencing token in the environment."`
	Fence   FenceCmd   `cmd:"" help:"Inspect or reset stored fencing tokens (operator tools)."`
	Version VersionCmd `cmd:"" help:"Print the version."`
}

// version is stamped at build time with -ldflags "-X main.version=$(git describe --tags
// --always --dirty)" (make build, the Dockerfile); when it is empty, versionOf finds one in the
// build information Go records.
var version string //nolint:gochecknoglobals // set by the linker

// VersionCmd prints the version.
type VersionCmd struct{}

// Run prints the version.
func (VersionCmd) Run() error {
	fmt.Println("fenceproxy", buildVersion())
	return nil
}

// buildVersion is this binary's version (versionOf).
func buildVersion() string {
	info, ok := debug.ReadBuildInfo()
	return versionOf(version, info, ok)
}

// versionOf is the version to show: the stamped one; else the module's version (go install
// module@version); else the VCS commit go build and go run record (-dirty when the work tree
// had changes); else a sentence that says how to get one.
func versionOf(stamped string, info *debug.BuildInfo, ok bool) string {
	if stamped != "" {
		return stamped
	}
	if !ok || info == nil {
		return "unknown (built without build information; build with make build)"
	}
	if v := info.Main.Version; v != "" && v != "(devel)" {
		return v
	}
	var rev, modified string
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			modified = s.Value
		}
	}
	if rev == "" {
		return "unknown (built without VCS information; build with make build, or go build inside the git work tree with -buildvcs=true if GOFLAGS sets -buildvcs=false)"
	}
	if len(rev) > 12 {
		rev = rev[:12]
	}
	if modified == "true" {
		rev += "-dirty"
	}
	return rev
}

// newLogger returns the logger and its level, which a reload may change.
func newLogger(level, format string) (*zap.Logger, zap.AtomicLevel, error) {
	lvl, err := zap.ParseAtomicLevel(level)
	if err != nil {
		return nil, lvl, err
	}
	cfg := logConfig(format)
	cfg.Level = lvl
	cfg.OutputPaths = []string{"stderr"}
	cfg.ErrorOutputPaths = []string{"stderr"}
	cfg.DisableStacktrace = true
	log, err := cfg.Build()
	return log, lvl, err
}

// logConfig is the logger's configuration for format (json or console): ISO 8601 times, and
// durations with their unit ("10m0s", "1.5s"), where zap's production encoder wrote bare
// seconds ("window":600).
func logConfig(format string) zap.Config {
	cfg := zap.NewProductionConfig()
	if format == "console" {
		cfg = zap.NewDevelopmentConfig()
	}
	cfg.EncoderConfig.EncodeTime = zapcore.ISO8601TimeEncoder
	cfg.EncoderConfig.EncodeDuration = zapcore.StringDurationEncoder
	return cfg
}

// configJSON is kong.JSON with the file's keys read as the flag names they are documented to
// be: kong's resolver looks a flag up only as snake_case or camelCase, so a key such as
// "key-file" or "shutdown-grace" was silently ignored (and a proxy configured with its key
// file in the file refused to start, "key-file is required"). A key that is no flag (a
// misspelling) is refused, and a file that is no JSON object is named with what is wrong.
func configJSON(r io.Reader) (kong.Resolver, error) {
	file := "configuration file"
	if f, ok := r.(interface{ Name() string }); ok {
		file = "configuration file " + f.Name()
	}
	var values map[string]json.RawMessage
	dec := json.NewDecoder(r)
	if err := dec.Decode(&values); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return nil, fmt.Errorf("%s: empty or truncated: want one JSON object whose keys are flag names (%w)", file, err)
		}
		var se *json.SyntaxError
		if errors.As(err, &se) {
			return nil, fmt.Errorf("%s: invalid JSON at byte %d: %w", file, se.Offset, err)
		}
		return nil, fmt.Errorf("%s: want one JSON object whose keys are flag names: %w", file, err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%s: more than one JSON value", file)
	}
	keys := make(map[string]json.RawMessage, len(values))
	for k, v := range values {
		name := strings.ReplaceAll(k, "-", "_")
		if _, dup := keys[name]; dup {
			return nil, fmt.Errorf("configuration key %q given twice (with - and _)", k)
		}
		keys[name] = v
	}
	b, err := json.Marshal(keys)
	if err != nil {
		return nil, err
	}
	res, err := kong.JSON(bytes.NewReader(b))
	if err != nil {
		return nil, err
	}
	return knownKeys{Resolver: res, file: file, keys: keys}, nil
}

// knownKeys refuses a configuration file with a key that names no flag of any command.
type knownKeys struct {
	kong.Resolver
	file string
	keys map[string]json.RawMessage
}

// Validate implements kong.Resolver.
func (k knownKeys) Validate(app *kong.Application) error {
	flags := map[string]bool{}
	var walk func(n *kong.Node)
	walk = func(n *kong.Node) {
		for _, f := range n.Flags {
			for _, name := range append([]string{f.Name}, f.Aliases...) {
				flags[strings.ReplaceAll(name, "-", "_")] = true
				flags[camelCase(name)] = true // kong's own second spelling
			}
		}
		for _, c := range n.Children {
			walk(c)
		}
	}
	walk(app.Node)
	var unknown []string
	for key := range k.keys {
		if !flags[key] {
			unknown = append(unknown, strings.ReplaceAll(key, "_", "-"))
		}
	}
	if len(unknown) > 0 {
		slices.Sort(unknown)
		return fmt.Errorf("%s: unknown key(s) %s: the keys are the flag names (fenceproxy serve --help)", k.file, strings.Join(unknown, ", "))
	}
	return k.Resolver.Validate(app)
}

// camelCase is name (a flag's, "key-file") as kong's JSON resolver also reads it ("keyFile").
func camelCase(name string) string {
	parts := strings.Split(name, "-")
	for i := 1; i < len(parts); i++ {
		if parts[i] != "" {
			parts[i] = strings.ToUpper(parts[i][:1]) + parts[i][1:]
		}
	}
	return strings.Join(parts, "")
}

func main() {
	os.Exit(run(os.Args[1:]))
}

func newParser(c *cli) (*kong.Kong, error) {
	return kong.New(c,
		kong.Name("fenceproxy"),
		kong.Description("PostgreSQL proxy that fences stale leaders: each session is bound to its fencing token inside PostgreSQL, and admitting a higher token ends the sessions of lower ones."),
		kong.UsageOnError(),
		kong.Vars{"version": "fenceproxy " + buildVersion()},
		kong.DefaultEnvars("FENCEPROXY"),
		kong.Configuration(configFile),
	)
}

// reloadSource reads the command line, environment and configuration file again (SIGHUP).
type reloadSource func() (*cli, error)

func run(args []string) int {
	var c cli
	parser, err := newParser(&c)
	if err != nil {
		fmt.Fprintln(os.Stderr, "fenceproxy:", err)
		return 2
	}
	kctx, err := parser.Parse(args)
	if err != nil {
		fmt.Fprintln(os.Stderr, "fenceproxy:", err)
		return 2
	}
	log, level, err := newLogger(c.LogLevel, c.LogFormat)
	if err != nil {
		fmt.Fprintln(os.Stderr, "fenceproxy:", err)
		return 2
	}
	defer log.Sync() //nolint:errcheck

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	kctx.BindTo(ctx, (*context.Context)(nil))
	kctx.Bind(log, level, reloadSource(func() (*cli, error) {
		var again cli
		p, err := newParser(&again)
		if err != nil {
			return nil, err
		}
		if _, err := p.Parse(args); err != nil {
			return nil, err
		}
		return &again, nil
	}))
	if err := kctx.Run(); err != nil {
		var ec interface{ ExitCode() int }
		if errors.As(err, &ec) {
			return ec.ExitCode()
		}
		// Once, as a plain line a person reads (a JSON log line escaped its quotes).
		log.Sync() //nolint:errcheck // what was logged before comes first
		fmt.Fprintln(os.Stderr, "fenceproxy:", err)
		return 1
	}
	return 0
}
