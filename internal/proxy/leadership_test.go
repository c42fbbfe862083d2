package proxy_test

import (
	"os/exec"
	"path/filepath"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
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
