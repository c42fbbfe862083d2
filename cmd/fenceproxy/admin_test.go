package main_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// syncBuffer is a log the process writes while the test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// configFile returns a JSON configuration file's path (not written yet) and what writes it.
func configFile(t *testing.T) (string, func(conf map[string]any)) {
	path := filepath.Join(t.TempDir(), "fenceproxy.json")
	return path, func(conf map[string]any) {
		b, _ := json.Marshal(conf)
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
}

// startServe starts fenceproxy serve with args, its stderr in logs; stop stops it (SIGTERM,
// then a kill after a minute): defer it before ctx is cancelled, which would kill it.
func startServe(ctx context.Context, t *testing.T, bin string, args ...string) (cmd *exec.Cmd, logs *syncBuffer, stop func()) {
	cmd = exec.CommandContext(ctx, bin, append([]string{"serve"}, args...)...)
	logs = &syncBuffer{}
	cmd.Stderr = logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	return cmd, logs, func() {
		cmd.Process.Signal(syscall.SIGTERM) //nolint:errcheck
		select {
		case <-exited:
		case <-time.After(time.Minute):
			cmd.Process.Kill() //nolint:errcheck
		}
	}
}

// httpGet returns the status and body of GET url (0 when it cannot connect).
func httpGet(t *testing.T, url string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// pollEvery is how often eventually asks again.
const pollEvery = 50 * time.Millisecond

// eventually is the one way these tests wait for a condition (as in internal/proxy's tests):
// it calls cond until cond returns nil, every pollEvery, and fails the test once within has
// passed, with what and cond's last error (what was still wrong). Give within room: the
// machine may be loaded.
func eventually(t testing.TB, within time.Duration, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s; last: %v", what, within, err)
		}
		time.Sleep(pollEvery)
	}
}

// TestServeAdminAndReload runs the real binary with an admin listener: /healthz, /readyz,
// /status and the leadership metrics follow a session and a stale refusal; SIGHUP applies a
// new resource and limit from the configuration file while an open session keeps working;
// and /readyz says 503 while PostgreSQL is down, 200 again once it is back.
func TestServeAdminAndReload(t *testing.T) {
	bin := buildBinary(t)
	pg := testenv.StartPostgres(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	keyFile := filepath.Join(t.TempDir(), "proxy.key")
	if out, err := exec.CommandContext(ctx, bin, "migrate", "--database", pg.AdminURL(), "--key-file", keyFile).CombinedOutput(); err != nil {
		t.Fatalf("migrate: %v\n%s", err, out)
	}
	addr, admin := freeAddr(t), freeAddr(t)
	cfgFile, writeConf := configFile(t)
	conf := map[string]any{"resource": []string{"billing"}, "key-file": keyFile, "max-clients": 50,
		"control-database": pg.AdminURL(), "upstream": "postgres://" + net.JoinHostPort(pg.Host, strconv.Itoa(pg.Port))}
	writeConf(conf)
	cmd, logs, stop := startServe(ctx, t, bin, "--config", cfgFile, "--listen", addr, "--admin-listen", admin)
	defer stop()
	base := "http://" + admin
	get := func(path string) (int, string) { return httpGet(t, base+path) }
	wantStatus := func(code int, body string) error {
		if code != http.StatusOK {
			return fmt.Errorf("%d %s", code, body)
		}
		return nil
	}
	eventually(t, time.Minute, "healthz", func() error { return wantStatus(get("/healthz")) })
	eventually(t, time.Minute, "readyz", func() error { return wantStatus(get("/readyz")) })
	// On loopback, a Host that is no loopback name is refused (DNS rebinding).
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+"/status", nil)
	req.Host = "evil.example"
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != http.StatusMisdirectedRequest {
		t.Fatalf("/status with Host evil.example: %v %v, want 421", resp, err)
	} else {
		resp.Body.Close()
	}

	url := "postgres://postgres:postgres@" + addr + "/postgres?sslmode=disable"
	conn, err := pgx.Connect(ctx, url+"&fence.resource=billing&fence.token=3")
	if err != nil {
		t.Fatalf("fenced session: %v\n%s", err, logs.String())
	}
	defer conn.Close(context.Background())
	_, err = pgx.Connect(ctx, url+"&fence.resource=billing&fence.token=2")
	if pe := (*pgconn.PgError)(nil); !errors.As(err, &pe) || pe.Code != fence.CodeStale {
		t.Fatalf("a lower token: %v, want %s", err, fence.CodeStale)
	}
	var st struct {
		Ready     bool
		Resources []struct {
			Resource string
			Token    int64 `json:"token,string"`
			Sessions map[string]int
		}
		Refusals []struct {
			Resource string
			Token    int64 `json:"token,string"`
			SQLState string
		}
	}
	code, body := get("/status")
	if err := json.Unmarshal([]byte(body), &st); code != 200 || err != nil {
		t.Fatalf("/status: %d %v\n%s", code, err, body)
	}
	if !st.Ready || len(st.Resources) != 1 || st.Resources[0].Resource != "billing" || st.Resources[0].Token != 3 ||
		st.Resources[0].Sessions["3"] != 1 || len(st.Refusals) != 1 || st.Refusals[0].Token != 2 || st.Refusals[0].SQLState != fence.CodeStale {
		t.Fatalf("/status:\n%s", body)
	}
	_, metrics := get("/metrics")
	for _, want := range []string{`fenceproxy_leader_token{resource="billing"} 3`, `fenceproxy_resource_sessions{resource="billing",token="3"} 1`,
		`fenceproxy_resource_refusals_total{resource="billing",sqlstate="ZF001"} 1`, `fenceproxy_leader_changes_total{resource="billing"} 0`,
		`fenceproxy_resource_info{resource="billing",store="bare"} 1`} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}

	// The status page, and the history it shows (the control database's fence.history).
	if code, page := get("/"); code != 200 || !strings.Contains(page, "<title>fenceproxy status</title>") {
		t.Errorf("status page: %d\n%s", code, page)
	}
	code, body = get("/history?resource=billing")
	var hist []fence.HistoryEntry
	if err := json.Unmarshal([]byte(body), &hist); code != 200 || err != nil || len(hist) != 1 || hist[0].Token != 3 || hist[0].Resource != "billing" {
		t.Errorf("/history: %d %v\n%s", code, err, body)
	}
	// Bad parameters are the client's error: 400, not a database error's 503.
	for _, q := range []string{"resource=%00", "resource=Bad", "limit=abc", "limit=0", "limit=-1"} {
		if code, body := get("/history?" + q); code != 400 || !strings.Contains(body, "error") {
			t.Errorf("/history?%s: %d\n%s, want 400", q, code, body)
		}
	}

	// SIGHUP: a new resource from the file; the open session goes on.
	if _, err := pgx.Connect(ctx, url+"&fence.resource=ledger&fence.token=1"); err == nil {
		t.Fatal("resource ledger admitted before it was configured")
	}
	conf["resource"] = []string{"billing", "ledger"}
	conf["max-clients"] = 60
	conf["log-level"] = "debug"
	writeConf(conf)
	if err := cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	eventually(t, time.Minute, "reload logged", func() error {
		if !strings.Contains(logs.String(), "reloaded (SIGHUP)") {
			return errors.New(logs.String())
		}
		return nil
	})
	for _, want := range []string{"resources [billing ledger]", "max-clients 60 (was 50)", "log-level debug (was info)"} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("reload log lacks %q:\n%s", want, logs.String())
		}
	}
	ledger, err := pgx.Connect(ctx, url+"&fence.resource=ledger&fence.token=1")
	if err != nil {
		t.Fatalf("resource ledger after the reload: %v\n%s", err, logs.String())
	}
	ledger.Close(ctx)
	if _, err := conn.Exec(ctx, "CREATE TABLE after_reload (x int); INSERT INTO after_reload VALUES (1)"); err != nil {
		t.Fatalf("the session opened before the reload: %v", err)
	}
	// A change that needs a restart is said, not applied.
	conf["connect-timeout"] = "3s"
	writeConf(conf)
	cmd.Process.Signal(syscall.SIGHUP) //nolint:errcheck
	eventually(t, time.Minute, "restart-only change logged", func() error {
		if !strings.Contains(logs.String(), "could not apply") || !strings.Contains(logs.String(), "connect-timeout (needs a restart)") {
			return errors.New(logs.String())
		}
		return nil
	})
	if err := conn.Ping(ctx); err != nil {
		t.Fatalf("the session after the second reload: %v", err)
	}

	// What a reload refuses changes nothing, and the log says what and where.
	for _, bad := range []struct {
		file, want string
	}{
		{`{"max-clients": -1`, cfgFile + ": empty or truncated"},
		{`{"max_client": 70}`, cfgFile + ": unknown key(s) max-client"},
		{`{"max-clients": -1}`, "max-clients -1: must not be negative"},
		{`{"flap-changes": 0}`, "flap-changes 0: must be 1 or more"},
	} {
		file := bad.file
		if !strings.HasSuffix(file, "-1") { // a whole object: the rest of the configuration too
			var extra map[string]any
			if err := json.Unmarshal([]byte(file), &extra); err != nil {
				t.Fatal(err)
			}
			next := map[string]any{}
			for k, v := range conf {
				next[k] = v
			}
			for k, v := range extra {
				next[k] = v
			}
			b, _ := json.Marshal(next)
			file = string(b)
		}
		if err := os.WriteFile(cfgFile, []byte(file), 0o600); err != nil {
			t.Fatal(err)
		}
		cmd.Process.Signal(syscall.SIGHUP) //nolint:errcheck
		eventually(t, time.Minute, "refused reload logged: "+bad.want, func() error {
			if !strings.Contains(logs.String(), bad.want) || !strings.Contains(logs.String(), "nothing changed") {
				return errors.New(logs.String())
			}
			return nil
		})
	}
	writeConf(conf)
	if strings.Contains(logs.String(), "max-clients -1 (was") {
		t.Fatalf("a refused reload applied max-clients -1:\n%s", logs.String())
	}

	// PostgreSQL down: not ready; back: ready again.
	pg.Stop(t)
	eventually(t, time.Minute, "readyz 503 with PostgreSQL stopped", func() error {
		if c, b := get("/readyz"); c != http.StatusServiceUnavailable || !strings.Contains(b, "upstream unreachable") {
			return fmt.Errorf("%d %s", c, b)
		}
		return nil
	})
	if c, _ := get("/healthz"); c != 200 {
		t.Errorf("healthz %d with PostgreSQL stopped: the process is alive", c)
	}
	pg.Start(t)
	eventually(t, time.Minute, "readyz 200 with PostgreSQL back", func() error { return wantStatus(get("/readyz")) })
}
