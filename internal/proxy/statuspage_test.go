package proxy_test

import (
	"context"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
)

// TestStatusPageInBrowser loads the status page in headless Chromium (Debian's chromium,
// which scripts/deps.sh installs) against a running proxy and checks what the page shows
// once its script has run: the resource with its leader token, the sessions per token, the
// history's timeline (a change from 1 to 2) and the stale refusal. STATUS_SCREENSHOT=FILE
// also saves a screenshot (the README's, docs/status-page.png).
func TestStatusPageInBrowser(t *testing.T) {
	browser, err := exec.LookPath("chromium")
	if err != nil {
		t.Fatal("chromium not found: run make deps (Debian package chromium)")
	}
	pg, _ := fencedDB(t)
	p := fencedProxy(t, pg, func(c *proxy.Config) { c.ControlDatabase = pg.AdminURL() })
	connect(t, p.FenceURL("app", "postgres", "billing", 1))
	connect(t, p.FenceURL("app", "postgres", "billing", 2))
	connect(t, p.FenceURL("app", "postgres", "billing", 2))
	wantCode(t, connectErr(p.FenceURL("app", "postgres", "billing", 1)), "ZF001")

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: p.Server.AdminMux(promhttp.Handler()), ReadHeaderTimeout: 5 * time.Second}
	go hs.Serve(ln) //nolint:errcheck // closed below
	t.Cleanup(func() { hs.Close() })
	url := "http://" + ln.Addr().String() + "/"

	run := func(args ...string) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(ctxT(t), 2*time.Minute)
		defer cancel()
		// A new profile each run; no sandbox (tests run as root); no GPU, no background
		// traffic. The virtual time budget lets the page's fetches and rendering finish.
		args = append([]string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
			"--user-data-dir=" + t.TempDir(), "--virtual-time-budget=5000"}, append(args, url)...)
		out, err := exec.CommandContext(ctx, browser, args...).Output()
		if err != nil {
			t.Fatalf("chromium %v: %v\n%s", args, err, out)
		}
		return string(out)
	}
	var dom string
	want := []string{`<td class="bare">billing (bare token: any client of the proxy may raise it)</td><td class="num token">2</td>`, `token 2: 2`,
		`1 → 2`, `ZF001`, `stale fencing token: resource "billing" token 1 is lower than the highest admitted token 2`, `class="ok">ready`}
	// The page fills itself in asynchronously: on a loaded machine a first load may be dumped
	// before its fetches answered, so try a few times.
	for attempt := 0; attempt < 3; attempt++ {
		dom = run("--dump-dom")
		missing := false
		for _, w := range want {
			missing = missing || !strings.Contains(dom, w)
		}
		if !missing {
			break
		}
	}
	for _, w := range want {
		if !strings.Contains(dom, w) {
			t.Errorf("the page does not show %q", w)
		}
	}
	if t.Failed() {
		t.Fatalf("page:\n%s", dom)
	}
	if shot := os.Getenv("STATUS_SCREENSHOT"); shot != "" {
		abs, err := filepath.Abs(shot)
		if err != nil {
			t.Fatal(err)
		}
		run("--screenshot="+abs, "--window-size=1100,720", "--hide-scrollbars")
	}
}
