package demo_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// demoTimeout bounds the whole demo run: two scenarios of about 25 s each (the Consul TTL
// of 10 s is the floor: a frozen leader is replaced after 10 to 20 s), plus building
// fenceproxy when the build cache is cold.
const demoTimeout = 6 * time.Minute

// replicas are the billing replicas, in both the local demo and docker-compose.yml.
var replicas = []string{"billing-1", "billing-2", "billing-3"}

// composeKeyFile is the proxy key file in docker-compose.yml: on the volume that the migrate
// service writes it to and the fenceproxy service reads it from. The local demo's key file,
// in its temporary folder, stands for it.
const composeKeyFile = "/var/lib/fenceproxy/fenceproxy.key"

// repoRoot is the folder holding go.mod.
func repoRoot(t *testing.T) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("go.mod not found above the test's folder")
		}
		dir = parent
	}
}

// demoRun is what one run of the demo (cmd/demo) printed.
type demoRun struct {
	output   string
	summary  map[string]int    // "customers charged" -> 12, ...
	services map[string]string // service name -> the command line it ran
	addrs    map[string]string // "127.0.0.1:PORT" -> the compose address of that service
	keyFile  string            // the proxy key file of the local demo (composeKeyFile in compose)
}

// runDemo builds and runs cmd/demo with short timings (and env, VAR=VALUE, on top) and
// returns what it printed; it must exit 0 (it exits 1 when fencing let a duplicate through
// or rejected nothing).
func runDemo(t *testing.T, customers int, env ...string) *demoRun {
	t.Helper()
	testenv.NeedServers(t) // cmd/demo starts PostgreSQL, Consul and the proxy itself
	root := repoRoot(t)
	bins := t.TempDir()
	demo := testenv.BuildGo(t, bins, "./cmd/demo")[0]
	ctx, cancel := context.WithTimeout(context.Background(), demoTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, demo)
	cmd.Dir = root
	cmd.Env = append(os.Environ(),
		"DEMO_BIN_DIR="+bins,
		"FENCEPROXY_CONSUL_BIN="+testenv.ConsulBinary(t),
		"DEMO_CUSTOMERS="+strconv.Itoa(customers),
		"DEMO_TX_DELAY=200ms",
		"DEMO_STEP_DELAY=50ms",
		"DEMO_CHARGES_BEFORE_FREEZE=2",
		"DEMO_CHARGES_AFTER_TAKEOVER=2",
		"DEMO_TIMEOUT=90s",
	)
	cmd.Env = append(cmd.Env, env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	// On timeout: SIGTERM, so that the demo stops everything it started.
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = time.Minute
	start := time.Now()
	err := cmd.Run()
	t.Logf("the demo ran for %v", time.Since(start).Round(time.Second))
	if err != nil {
		t.Fatalf("the demo: %v; its output:\n%s", err, out.String())
	}
	return parseDemo(t, out.String())
}

var (
	summaryLine = regexp.MustCompile(`^([a-z ]+): ([0-9]+)$`)
	serviceLine = regexp.MustCompile(`^demo: service ([a-z0-9/-]+): (.*)$`)
	addrLine    = regexp.MustCompile(`^demo: (PostgreSQL|Consul v[0-9.]+|fenceproxy) on (127\.0\.0\.1:[0-9]+)`)
	keyLine     = regexp.MustCompile(`^demo: proxy key file (/[^ ]+)$`)
)

func parseDemo(t *testing.T, output string) *demoRun {
	t.Helper()
	r := &demoRun{output: output, summary: map[string]int{}, services: map[string]string{}, addrs: map[string]string{}}
	composeAddr := map[string]string{"PostgreSQL": "postgres:5432", "fenceproxy": "fenceproxy:7432"}
	inSummary := false
	sc := bufio.NewScanner(strings.NewReader(output))
	for sc.Scan() {
		line := sc.Text()
		if line == "== summary ==" {
			inSummary = true
		}
		if m := summaryLine.FindStringSubmatch(line); inSummary && m != nil {
			n, _ := strconv.Atoi(m[2])
			r.summary[m[1]] = n
		}
		if m := serviceLine.FindStringSubmatch(line); m != nil {
			r.services[m[1]] = m[2]
		}
		if m := keyLine.FindStringSubmatch(line); m != nil {
			r.keyFile = m[1]
		}
		if m := addrLine.FindStringSubmatch(line); m != nil {
			what := m[1]
			if strings.HasPrefix(what, "Consul") {
				r.addrs[m[2]] = "consul:8500"
			} else {
				r.addrs[m[2]] = composeAddr[what]
			}
		}
	}
	return r
}

func TestDemo(t *testing.T) {
	const customers = 12
	r := runDemo(t, customers)
	t.Logf("demo output:\n%s", r.output)

	t.Run("outcome", func(t *testing.T) { wantOutcome(t, r, customers) })
	t.Run("timeline", func(t *testing.T) { wantTimeline(t, r, "lease store: consul") })

	t.Run("compose runs the same commands", func(t *testing.T) {
		if r.keyFile == "" {
			t.Fatal(`the demo printed no "demo: proxy key file PATH" line`)
		}
		compose := loadCompose(t)
		for _, name := range append([]string{"migrate", "fenceproxy"}, replicas...) {
			t.Run(name, func(t *testing.T) {
				local, ok := r.services[name]
				if !ok {
					local, ok = r.services["fenced/"+name] // the replicas of the fenced run
				}
				if !ok {
					t.Fatalf("the demo printed no command for service %s", name)
				}
				env, args := r.localCommand(local)
				svc := compose.Services[name]
				if want := svc.composeCommand(); !slices.Equal(args, want) {
					t.Errorf("command differs:\n  cmd/demo:            %q\n  docker-compose.yml:  %q", args, want)
				}
				if got, want := sortedKeys(env), sortedKeys(svc.Environment); !slices.Equal(got, want) {
					t.Errorf("environment variables differ: cmd/demo sets %q, docker-compose.yml %q", got, want)
				}
				if env["BILLING_REPLICA"] != svc.Environment["BILLING_REPLICA"] {
					t.Errorf("BILLING_REPLICA: cmd/demo %q, docker-compose.yml %q",
						env["BILLING_REPLICA"], svc.Environment["BILLING_REPLICA"])
				}
			})
		}
	})
}

// TestDemoPostgresStore runs the demo on the PostgreSQL lease (`make demo STORE=postgres`):
// no Consul at all, the same outcome.
func TestDemoPostgresStore(t *testing.T) {
	testDemoWithoutConsul(t, "postgres", "demo: no Consul:")
}

// TestDemoEtcdStore runs the demo on an etcd election (`make demo STORE=etcd`): etcd's
// server in the demo's process, the proxy validating tokens against it, no Consul.
func TestDemoEtcdStore(t *testing.T) {
	r := testDemoWithoutConsul(t, "etcd", "demo: etcd on ")
	if cmd := r.services["fenceproxy"]; !strings.Contains(cmd, "--etcd-resource billing=locks/billing") {
		t.Errorf("the proxy does not validate tokens against etcd: %s", cmd)
	}
}

// testDemoWithoutConsul runs the demo on store with a short TTL and no Consul binary to be
// found, and checks its outcome, its timeline (with the lines of extra) and that no service
// mentions Consul.
func testDemoWithoutConsul(t *testing.T, store string, extra ...string) *demoRun {
	const customers = 12
	r := runDemo(t, customers, "DEMO_STORE="+store, "DEMO_TTL=3s", "FENCEPROXY_CONSUL_BIN=/nonexistent")
	t.Logf("demo output:\n%s", r.output)
	t.Run("outcome", func(t *testing.T) { wantOutcome(t, r, customers) })
	t.Run("timeline", func(t *testing.T) { wantTimeline(t, r, append([]string{"lease store: " + store}, extra...)...) })
	t.Run("no Consul", func(t *testing.T) {
		for name, cmd := range r.services {
			if strings.Contains(cmd, "consul") {
				t.Errorf("service %s mentions Consul: %s", name, cmd)
			}
		}
	})
	return r
}

// wantTimeline checks that the output shows the scenario: the freeze, the refusal, the
// duplicate without fencing, and the lines of extra.
func wantTimeline(t *testing.T, r *demoRun, extra ...string) {
	for _, want := range append([]string{
		"== timeline: fenced ==",
		">>> froze billing-",
		">>> woke billing-",
		"REJECTED: customer ",
		"ZF001 stale fencing token:",
		"== timeline: direct ==",
		"AGAIN: DUPLICATE",
	}, extra...) {
		if !strings.Contains(r.output, want) {
			t.Errorf("the output has no %q", want)
		}
	}
}

// wantOutcome checks the summary of a demo run with fencing and its negative control.
func wantOutcome(t *testing.T, r *demoRun, customers int) {
	for _, tc := range []struct {
		line string
		ok   func(n int) bool
		want string
	}{
		{"customers charged", func(n int) bool { return n == customers }, fmt.Sprint(customers)},
		{"duplicates", func(n int) bool { return n == 0 }, "0"},
		{"stale writes rejected", func(n int) bool { return n >= 1 }, "at least 1"},
		{"customers charged without fencing", func(n int) bool { return n == customers }, fmt.Sprint(customers)},
		// The negative control: the same scenario without the proxy must charge
		// somebody twice, or this test would pass without proving anything.
		{"duplicates without fencing", func(n int) bool { return n >= 1 }, "at least 1"},
		{"stale writes rejected without fencing", func(n int) bool { return n == 0 }, "0"},
	} {
		t.Run(tc.line, func(t *testing.T) {
			n, ok := r.summary[tc.line]
			if !ok {
				t.Fatalf("no %q line in the summary", tc.line+": N")
			}
			if !tc.ok(n) {
				t.Errorf("%s: %d, want %s", tc.line, n, tc.want)
			}
		})
	}
}

// localCommand splits a command line the demo printed into its leading VAR=VALUE
// assignments and its arguments, with loopback addresses replaced by the compose
// service addresses they stand for, and the local key file by composeKeyFile. The demo
// passes no argument containing a space.
func (r *demoRun) localCommand(line string) (env map[string]string, args []string) {
	env = map[string]string{}
	fields := strings.Fields(line)
	for len(fields) > 0 {
		name, value, ok := strings.Cut(fields[0], "=")
		if !ok || name == "" || strings.ToUpper(name) != name || strings.HasPrefix(name, "-") {
			break
		}
		env[name] = value
		fields = fields[1:]
	}
	for _, f := range fields {
		for local, service := range r.addrs {
			f = strings.ReplaceAll(f, local, service)
		}
		if r.keyFile != "" && f == r.keyFile {
			f = composeKeyFile
		}
		args = append(args, f)
	}
	return env, args
}

// composeFile is the part of `docker-compose config`'s normalized output the tests read.
type composeFile struct {
	Services map[string]composeService `json:"services"`
}

type composeService struct {
	Image       string            `json:"image"`
	Build       json.RawMessage   `json:"build"`
	Command     []string          `json:"command"`
	Environment map[string]string `json:"environment"`
	DependsOn   map[string]struct {
		Condition string `json:"condition"`
	} `json:"depends_on"`
	Volumes []json.RawMessage `json:"volumes"`
	Ports   []json.RawMessage `json:"ports"`
}

// composeCommand is the service's command with the one address that differs by nature
// from the local demo's: inside its container the proxy listens on every interface.
func (s composeService) composeCommand() []string {
	out := slices.Clone(s.Command)
	for i := 1; i < len(out); i++ {
		if out[i-1] == "--listen" && strings.HasPrefix(out[i], "0.0.0.0:") {
			out[i] = "fenceproxy:" + strings.TrimPrefix(out[i], "0.0.0.0:")
		}
	}
	return out
}

// loadCompose validates docker-compose.yml with docker-compose (Debian's, installed by
// scripts/deps.sh) and returns its normalized form. docker-compose prints YAML only; the
// python3 it runs on has PyYAML (a docker-compose dependency), which turns it into JSON.
func loadCompose(t *testing.T) composeFile {
	t.Helper()
	root := repoRoot(t)
	dc, err := exec.LookPath("docker-compose")
	if err != nil {
		t.Fatalf("docker-compose not found (%v): run make deps", err)
	}
	cmd := exec.Command(dc, "--file", filepath.Join(root, "docker-compose.yml"), "--project-directory", root, "config")
	cmd.Env = composeEnv()
	yml, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("docker-compose config: %v\n%s", err, ee.Stderr)
		}
		t.Fatalf("docker-compose config: %v", err)
	}
	conv := exec.Command("/usr/bin/python3", "-c",
		"import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)")
	conv.Stdin = bytes.NewReader(yml)
	js, err := conv.Output()
	if err != nil {
		t.Fatalf("convert docker-compose config's YAML to JSON: %v", err)
	}
	var f composeFile
	if err := json.Unmarshal(js, &f); err != nil {
		t.Fatalf("docker-compose config's output: %v\n%s", err, yml)
	}
	return f
}

// composeEnv is the environment without the COMPOSE_* and DOCKER_* variables that would
// change what docker-compose reads.
func composeEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "COMPOSE_") && !strings.HasPrefix(kv, "DOCKER_") {
			env = append(env, kv)
		}
	}
	return env
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

func TestComposeFile(t *testing.T) {
	f := loadCompose(t)

	t.Run("services", func(t *testing.T) {
		want := append([]string{"consul", "fenceproxy", "migrate", "postgres"}, replicas...)
		slices.Sort(want)
		if got := sortedKeys(f.Services); !slices.Equal(got, want) {
			t.Fatalf("services %q, want %q", got, want)
		}
	})

	for _, tc := range []struct {
		service   string
		image     string // "" for the image built from the Dockerfile
		program   []string
		dependsOn map[string]string // service -> condition
	}{
		{service: "postgres", image: "postgres:15"},
		{service: "consul", image: "hashicorp/consul:1.16.3"},
		{service: "migrate", program: []string{"fenceproxy", "migrate"},
			dependsOn: map[string]string{"postgres": "service_healthy"}},
		{service: "fenceproxy", program: []string{"fenceproxy", "serve"},
			dependsOn: map[string]string{"migrate": "service_completed_successfully", "consul": "service_healthy"}},
		{service: "billing-1", program: []string{"fenceproxy", "lock"},
			dependsOn: map[string]string{"fenceproxy": "service_started"}},
		{service: "billing-2", program: []string{"fenceproxy", "lock"},
			dependsOn: map[string]string{"fenceproxy": "service_started"}},
		{service: "billing-3", program: []string{"fenceproxy", "lock"},
			dependsOn: map[string]string{"fenceproxy": "service_started"}},
	} {
		t.Run(tc.service, func(t *testing.T) {
			svc, ok := f.Services[tc.service]
			if !ok {
				t.Fatalf("no service %s", tc.service)
			}
			if tc.image != "" {
				if svc.Image != tc.image {
					t.Errorf("image %q, want %q", svc.Image, tc.image)
				}
			} else {
				if len(svc.Build) == 0 || svc.Image != f.Services["fenceproxy"].Image {
					t.Errorf("want the image built from the Dockerfile (build: ., image: %q); got image %q, build %s",
						f.Services["fenceproxy"].Image, svc.Image, svc.Build)
				}
			}
			if len(tc.program) > 0 && (len(svc.Command) < len(tc.program) || !slices.Equal(svc.Command[:len(tc.program)], tc.program)) {
				t.Errorf("command %q, want it to start with %q", svc.Command, tc.program)
			}
			for dep, cond := range tc.dependsOn {
				if got := svc.DependsOn[dep].Condition; got != cond {
					t.Errorf("depends_on %s: condition %q, want %q", dep, got, cond)
				}
			}
		})
	}

	t.Run("replicas", func(t *testing.T) {
		first := f.Services[replicas[0]].Command
		for _, name := range replicas {
			svc := f.Services[name]
			if !slices.Equal(svc.Command, first) {
				t.Errorf("%s runs %q, %s runs %q: the replicas must be identical", name, svc.Command, replicas[0], first)
			}
			if got := svc.Environment["BILLING_REPLICA"]; got != name {
				t.Errorf("%s: BILLING_REPLICA=%q, want %q", name, got, name)
			}
			i := slices.Index(svc.Command, "--")
			if i < 0 || !slices.Equal(svc.Command[i+1:], []string{"billing"}) {
				t.Errorf("%s: command %q, want it to end with -- billing", name, svc.Command)
			}
			if j := slices.Index(svc.Command, "--database-url"); j < 0 || j+1 >= len(svc.Command) ||
				!strings.Contains(svc.Command[j+1], "@fenceproxy:7432/") {
				t.Errorf("%s: --database-url must point at the fenceproxy service: %q", name, svc.Command)
			}
		}
	})

	// v2 fencing: migrate creates the proxy key file and stores the key in the database; the
	// proxy reads the same file. Both services mount one named volume at its folder.
	t.Run("key file", func(t *testing.T) {
		dir := filepath.Dir(composeKeyFile)
		var volume []string
		for _, name := range []string{"migrate", "fenceproxy"} {
			svc := f.Services[name]
			if i := slices.Index(svc.Command, "--key-file"); i < 0 || i+1 >= len(svc.Command) || svc.Command[i+1] != composeKeyFile {
				t.Errorf("%s: want --key-file %s in its command %q", name, composeKeyFile, svc.Command)
			}
			found := ""
			for _, v := range svc.Volumes {
				var spec string
				if json.Unmarshal(v, &spec) != nil {
					continue
				}
				if parts := strings.Split(spec, ":"); len(parts) >= 2 && parts[1] == dir && !strings.HasPrefix(parts[0], "/") && !strings.HasPrefix(parts[0], ".") {
					found = parts[0]
				}
			}
			if found == "" {
				t.Errorf("%s: no named volume mounted at %s; volumes: %s", name, dir, svc.Volumes)
			}
			volume = append(volume, found)
		}
		if len(volume) == 2 && volume[0] != volume[1] {
			t.Errorf("migrate mounts volume %q at %s, fenceproxy %q: they must share the key file", volume[0], dir, volume[1])
		}
	})

	t.Run("schema", func(t *testing.T) {
		var mounts []string
		for _, v := range f.Services["postgres"].Volumes {
			mounts = append(mounts, string(v))
		}
		all := strings.Join(mounts, " ")
		if !strings.Contains(all, "demo/schema.sql") || !strings.Contains(all, "/docker-entrypoint-initdb.d/") {
			t.Errorf("postgres must load demo/schema.sql from /docker-entrypoint-initdb.d; volumes: %s", all)
		}
	})
}
