package proxy_test

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/lease/consul"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxy/guards"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestLeaderFlapping: a leader that changes more than --flap-changes times within
// --flap-window is flapping: /status says so and the proxy logs one warning; a stale
// session that ends is counted for its resource.
func TestLeaderFlapping(t *testing.T) {
	pg, _ := fencedDB(t)
	core, logs := observer.New(zapcore.InfoLevel)
	p := testenv.StartProxy(t, pg, proxy.Config{Resources: []string{"billing"}, FlapChanges: 2},
		testenv.ProxyOptions{Logger: zap.New(core)})
	for tok := int64(1); tok <= 3; tok++ { // 1 is learnt, 2 and 3 are changes: not more than 2
		connect(t, p.FenceURL("app", "postgres", "billing", tok))
	}
	if st := p.Server.Status(ctxT(t)); len(st.Resources) != 1 || st.Resources[0].Changes != 2 || st.Resources[0].Flapping {
		t.Fatalf("after 2 changes: %+v", st.Resources)
	}
	connect(t, p.FenceURL("app", "postgres", "billing", 4))
	st := p.Server.Status(ctxT(t))
	if r := st.Resources[0]; r.Token != 4 || r.Changes != 3 || !r.Flapping || r.Sessions["4"] != 1 {
		t.Fatalf("after 3 changes: %+v", st.Resources)
	}
	if n := logs.FilterMessageSnippet("leader flapping").Len(); n != 1 {
		t.Fatalf("%d flapping warnings, want 1: %v", n, logs.All())
	}
	if n := logs.FilterMessage("leader changed").Len(); n != 3 {
		t.Errorf("%d leader change log lines, want 3", n)
	}
}

// TestAlertRules checks the Prometheus rules in monitoring/ with promtool (Debian's
// prometheus package, which scripts/deps.sh installs): their syntax, and their unit tests
// (the flapping alert fires at more than 3 changes in 10 minutes, and only then).
func TestAlertRules(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatal("promtool not found: run make deps (Debian package prometheus)")
	}
	dir := filepath.Join("..", "..", "monitoring")
	for _, args := range [][]string{{"check", "rules", "alerts.yml"}, {"test", "rules", "alerts_test.yml"}} {
		cmd := exec.CommandContext(ctxT(t), promtool, args...)
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("promtool %v: %v\n%s", args, err, out)
		}
	}
}

// describing is a Registerer that keeps the names of the metrics registered with it.
type describing map[string]bool

func (d describing) Register(c prometheus.Collector) error {
	ch := make(chan *prometheus.Desc, 64)
	go func() { c.Describe(ch); close(ch) }()
	name := regexp.MustCompile(`fqName: "([^"]+)"`)
	for desc := range ch {
		if m := name.FindStringSubmatch(desc.String()); m != nil {
			d[m[1]] = true
		}
	}
	return nil
}

func (d describing) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		d.Register(c) //nolint:errcheck // never fails
	}
}

func (d describing) Unregister(prometheus.Collector) bool { return false }

// TestMonitoringNames: every metric the alert rules and the Grafana dashboard (monitoring/)
// query is one the proxy exports (no Consul is contacted: a Guard only describes its metrics
// here), and the dashboard is valid JSON with a query per panel.
func TestMonitoringNames(t *testing.T) {
	known := describing{}
	cfg := proxy.Config{Upstream: "postgres://127.0.0.1:1", Resources: []string{"billing=locks/billing"}, Key: testenv.Key, ConsulAddr: "127.0.0.1:1"}
	reg := fence.NewRegistry()
	if _, err := proxy.New(cfg, proxy.Options{Registry: reg, Registerer: known, Metrics: proxy.NewMetrics(known)}); err != nil {
		t.Fatal(err)
	}
	if _, err := guards.Consul(ctxT(t), cfg, consul.GuardOptions{Registry: reg, Registerer: known}); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join("..", "..", "monitoring")
	alerts, err := os.ReadFile(filepath.Join(dir, "alerts.yml"))
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(filepath.Join(dir, "grafana-dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Type, Title string
			Targets     []struct{ Expr string }
		}
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatalf("grafana-dashboard.json: %v", err)
	}
	queries := string(alerts)
	for _, p := range dash.Panels {
		if p.Type != "row" && len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, q := range p.Targets {
			queries += "\n" + q.Expr
		}
	}
	used := regexp.MustCompile(`fenceproxy_[a-z_]+`).FindAllString(queries, -1)
	if len(used) < 10 {
		t.Fatalf("only %d metric names found in monitoring/", len(used))
	}
	for _, name := range used {
		base := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(name, "_bucket"), "_sum"), "_count")
		if !known[name] && !known[base] {
			t.Errorf("monitoring/ queries %s, which the proxy does not export", name)
		}
	}
}
