package proxy_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestOperations holds the regressions of an adversarial review of operations (issue
// 13's), on one cluster: each subtest starts its own proxy.
func TestOperations(t *testing.T) {
	t.Parallel()
	pg, admin := fencedDB(t)

	// A fenced client that closes (FIN) or half-closes before reading anything, or pipelines
	// a Terminate with its startup, leaves the proxy to bind its backend and then fail to
	// write the ReadyForQuery: the session was counted in its resource's sessions per token
	// and must be uncounted too.
	t.Run("sessions per token after a client gone before ReadyForQuery", func(t *testing.T) {
		p := fencedProxy(t, pg)
		startup := startupPacket(196608, "user", "app", "database", "postgres", "fence.resource", "billing", "fence.token", "5")
		terminate := []byte{'X', 0, 0, 0, 4}
		hows := []string{"close", "shutdown(SHUT_WR)", "Terminate pipelined, close"}
		const tries = 3
		for _, how := range hows {
			for range tries {
				c, err := net.DialTimeout("tcp", net.JoinHostPort(p.Host, strconv.Itoa(p.Port)), 5*time.Second)
				if err != nil {
					t.Fatal(err)
				}
				msg := startup
				if how == "Terminate pipelined, close" {
					msg = append(append([]byte(nil), startup...), terminate...)
				}
				if _, err := c.Write(msg); err != nil {
					t.Fatal(err)
				}
				if how == "shutdown(SHUT_WR)" {
					c.(*net.TCPConn).CloseWrite() //nolint:errcheck
				}
				c.Close()
			}
		}
		// Each bind happens whatever the client did (the proxy reads nothing of it then);
		// once all are done, stopping the proxy waits for every session's end.
		eventually(t, time.Minute, "every bind done", func() error {
			var m dto.Metric
			p.Metrics.BindSeconds.WithLabelValues("bound").(prometheus.Histogram).Write(&m) //nolint:errcheck
			if n := m.GetHistogram().GetSampleCount(); n != uint64(len(hows)*tries) {
				return fmt.Errorf("%d bound", n)
			}
			return nil
		})
		p.Stop(t)
		if n := p.Registry.Sessions("billing"); n != 0 {
			t.Fatalf("%d sessions of billing counted after every client went and the proxy stopped", n)
		}
		if s := p.Server.Status(ctxT(t)).Resources[0]; s.Resource != "billing" || len(s.Sessions) != 0 {
			t.Fatalf("/status shows %+v after every client went", s)
		}
	})

	// fence reset to a token above an open session's is a raise: the session's next statement
	// gets ZF001 with the reset's token, not the server's 57P01, whether the proxy hears the
	// reset's notification first or asks the database (fence.settled) when the backend ends.
	t.Run("reset to a higher token is a raise", func(t *testing.T) {
		p := fencedProxy(t, pg, func(c *proxy.Config) { c.ControlDatabase = pg.AdminURL() })
		s := connect(t, p.FenceURL("app", "postgres", "other", 130))
		mustExec(t, admin, "SELECT fence.reset('other', 200)")
		_, err := s.Exec(ctxT(t), "SELECT 1")
		wantCode(t, err, fence.CodeStale)
		if pe := pgErrorOf(err); pe == nil || !strings.Contains(pe.Message+pe.Detail, "200") {
			t.Fatalf("the stale session's error does not name the reset's token 200: %v", err)
		}
		eventually(t, time.Minute, "the reset seen as a leader change", func() error {
			for _, l := range p.Registry.Leaders() {
				if l.Resource == "other" {
					if l.Token == 200 && l.Changes == 1 {
						return nil
					}
					return fmt.Errorf("%+v", l)
				}
			}
			return errors.New("no leader of other")
		})
	})

	// A reload that gives a plain resource a Consul key cannot apply it without a restart, and
	// keeps the resource as it was: it must not remove it.
	t.Run("reload adding a Consul key keeps the resource", func(t *testing.T) {
		p := fencedProxy(t, pg)
		cfg := proxy.Config{Listen: net.JoinHostPort(p.Host, strconv.Itoa(p.Port)), Key: testenv.Key,
			Upstream:  "postgres://" + net.JoinHostPort(pg.Host, strconv.Itoa(pg.Port)),
			Resources: []string{"billing", "other=locks/other"}}
		applied, skipped, err := p.Server.Reload(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if len(applied) != 0 || len(skipped) != 1 || !strings.Contains(skipped[0], "other=locks/other") || !strings.Contains(skipped[0], "stays as it is") {
			t.Fatalf("reload: applied %q, not applied %q", applied, skipped)
		}
		connect(t, p.FenceURL("app", "postgres", "other", 300)).Close(ctxT(t))
		var names []string
		for _, r := range p.Server.Status(ctxT(t)).Resources {
			names = append(names, r.Resource)
		}
		if fmt.Sprint(names) != "[billing other]" {
			t.Fatalf("/status lists %v after the reload, want [billing other]", names)
		}
	})

	// /status (and the metrics, from the same list) shows the resources the proxy serves, not
	// one that exists only in the database (fence reset notified it); a ZF005 refusal names
	// its resource; tokens are strings in the JSON (a script's numbers lose them above 2^53).
	t.Run("status shows the configured resources, tokens as strings", func(t *testing.T) {
		p := fencedProxy(t, pg, func(c *proxy.Config) { c.ControlDatabase = pg.AdminURL() })
		mustExec(t, admin, "SELECT fence.reset('ghost', 5)")
		eventually(t, time.Minute, "the reset of ghost heard", func() error {
			if h := p.Registry.Highest("postgres", "ghost"); h != 5 {
				return fmt.Errorf("highest %d", h)
			}
			return nil
		})
		wantCode(t, connectErr(p.FenceURL("app", "postgres", "ledger", 1)), fence.CodeUnknown)
		p.Registry.Observe("postgres", "billing", 9007199254740993)
		st := p.Server.Status(ctxT(t))
		var names []string
		for _, r := range st.Resources {
			names = append(names, r.Resource)
		}
		if fmt.Sprint(names) != "[billing other]" {
			t.Errorf("/status lists %v, want [billing other]", names)
		}
		if n := len(st.Refusals); n == 0 || st.Refusals[n-1].Resource != "ledger" || st.Refusals[n-1].SQLState != fence.CodeUnknown {
			t.Errorf("/status refusals %+v: want the last ZF005 of resource ledger", st.Refusals)
		}
		b, err := json.Marshal(st)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(b), `"token":"9007199254740993"`) {
			t.Errorf("/status JSON does not carry the token as a string:\n%s", b)
		}
	})
}

// TestAdminHosts: an admin listener on loopback answers only requests whose Host is a
// loopback address, localhost or an allowed name (DNS rebinding gets 421).
func TestAdminHosts(t *testing.T) {
	t.Parallel()
	h := proxy.AdminHosts(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {}), []string{"proxy.internal"})
	for host, want := range map[string]int{
		"127.0.0.1:9187": 200, "127.0.0.2": 200, "localhost:9187": 200, "LOCALHOST": 200, "[::1]:9187": 200,
		"proxy.internal:9187": 200, "evil.example": 421, "evil.example:9187": 421, "127.0.0.1.evil.example": 421,
		"localhost.evil.example:9187": 421, "10.0.0.1:9187": 421, "": 421,
	} {
		req := httptest.NewRequest(http.MethodGet, "/status", nil)
		req.Host = host
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != want {
			t.Errorf("Host %q: %d, want %d", host, rec.Code, want)
		}
	}
}
