package proxy_test

import (
	"context"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestSessionAdmission covers how a session presents its token and every
// refusal at startup.
func TestSessionAdmission(t *testing.T) {
	pg, admin := fencedDB(t)
	p := fencedProxy(t, pg)
	single := testenv.StartProxy(t, pg, proxy.Config{Resources: []string{"solo"}})
	// The operator's raise: the proxy does not hear of it, the bind refuses.
	mustExec(t, admin, "SELECT fence.reset('other', 50)")
	tests := []struct {
		name string
		url  string
		code string // "" = admitted
	}{
		{"URL parameters", p.URL("app", "postgres", "fence.resource=billing", "fence.token=5"), ""},
		{"options", p.URL("app", "postgres", "options=-c fence.resource=billing -c fence.token=6"), ""},
		{"options long form", p.URL("app", "postgres", "options=--fence.resource=billing --fence.token=7"), ""},
		{"options mixed with other settings", p.URL("app", "postgres", "options=-c statement_timeout=5s -c fence.resource=billing -c fence.token=8 -c search_path=public"), ""},
		{"resource defaults when only one is configured", single.URL("app", "postgres", "fence.token=3"), ""},
		{"no token (unfenced reject)", p.URL("app", "postgres"), fence.CodeMissing},
		{"resource without token", p.URL("app", "postgres", "fence.resource=billing"), fence.CodeMissing},
		{"token without resource, several configured", p.URL("app", "postgres", "fence.token=5"), fence.CodeMissing},
		{"malformed token", p.URL("app", "postgres", "fence.resource=billing", "fence.token=abc"), fence.CodeMalformed},
		{"zero token", p.URL("app", "postgres", "fence.resource=billing", "fence.token=0"), fence.CodeMalformed},
		{"negative token", p.URL("app", "postgres", "fence.resource=billing", "fence.token=-4"), fence.CodeMalformed},
		{"token above int64", p.URL("app", "postgres", "fence.resource=billing", "fence.token=9223372036854775808"), fence.CodeMalformed},
		{"malformed resource", p.URL("app", "postgres", "fence.resource=Bill'ing", "fence.token=4"), fence.CodeMalformed},
		{"unknown resource", p.URL("app", "postgres", "fence.resource=payroll", "fence.token=4"), fence.CodeUnknown},
		{"conflicting tokens", p.URL("app", "postgres", "fence.resource=billing", "fence.token=4", "options=-c fence.token=5"), fence.CodeMalformed},
		{"unknown fence parameter", p.URL("app", "postgres", "options=-c fence.resource=billing -c fence.token=4 -c fence.tokn=5"), fence.CodeMalformed},
		{"stale at startup", p.FenceURL("app", "postgres", "other", 49), fence.CodeStale},
		{"current at startup", p.FenceURL("app", "postgres", "other", 50), ""},
		// The bind (and the raise it makes) runs in its own READ COMMITTED,
		// READ WRITE transaction whatever the session's defaults.
		{"raise under serializable, read-only defaults", p.URL("app", "postgres",
			"options=-c default_transaction_isolation=serializable -c default_transaction_read_only=on -c fence.resource=other -c fence.token=51"), ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := connectErr(tt.url)
			if tt.code == "" {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			wantCode(t, err, tt.code)
			if !strings.Contains(err.Error(), "fenc") {
				t.Errorf("message does not say what was wrong with fencing: %v", err)
			}
		})
	}
	// Raised tokens are stored.
	if n := count(t, admin, "SELECT token FROM fence.tokens WHERE resource = 'billing'"); n != 8 {
		t.Fatalf("stored token %d, want 8", n)
	}
	// The fence parameters never reach the server.
	c := connect(t, p.URL("app", "postgres", "options=-c fence.resource=billing -c fence.token=8 -c application_name=fenced"))
	var opt string
	if err := c.QueryRow(ctxT(t), "SELECT current_setting('fence.token', true) IS NULL OR current_setting('fence.token', true) = ''").Scan(new(bool)); err != nil {
		t.Fatal(err)
	}
	if err := c.QueryRow(ctxT(t), "SELECT current_setting('application_name')").Scan(&opt); err != nil || opt != "fenced" {
		t.Fatalf("other options lost: %q %v", opt, err)
	}
}

// TestUnfencedPolicies covers --unfenced readonly and allow. readonly is
// best effort: it sets default_transaction_read_only, which the client may
// turn off (a role without write privileges is what enforces read-only).
func TestUnfencedPolicies(t *testing.T) {
	pg, admin := fencedDB(t)
	ro := fencedProxy(t, pg, func(c *proxy.Config) { c.Unfenced = proxy.UnfencedReadOnly })
	allow := fencedProxy(t, pg, func(c *proxy.Config) { c.Unfenced = proxy.UnfencedAllow })
	ctx := ctxT(t)

	c := connect(t, ro.URL("app", "postgres"))
	if n := count(t, c, "SELECT count(*) FROM items"); n != 0 {
		t.Fatalf("read: %d", n)
	}
	var setting string
	if err := c.QueryRow(ctx, "SHOW default_transaction_read_only").Scan(&setting); err != nil || setting != "on" {
		t.Fatalf("default_transaction_read_only = %q (%v), want on", setting, err)
	}
	_, err := c.Exec(ctx, "INSERT INTO items(tag) VALUES ('ro')")
	wantCode(t, err, "25006")
	err = simple(ctx, c, "BEGIN; INSERT INTO items(tag) VALUES ('ro'); COMMIT")
	wantCode(t, err, "25006")
	mustExec(t, c, "ROLLBACK")
	if n := count(t, admin, "SELECT count(*) FROM items WHERE tag = 'ro'"); n != 0 {
		t.Fatalf("%d read-only writes committed", n)
	}
	// Best effort only: the session is an unfenced plain relay, and the
	// client may switch the default off.
	mustExec(t, c, "SET default_transaction_read_only = off")
	mustExec(t, c, "INSERT INTO items(tag) VALUES ('ro-off')")

	a := connect(t, allow.URL("app", "postgres"))
	if err := a.QueryRow(ctx, "SHOW default_transaction_read_only").Scan(&setting); err != nil || setting != "off" {
		t.Fatalf("allow: default_transaction_read_only = %q (%v), want off", setting, err)
	}
	mustExec(t, a, "INSERT INTO items(tag) VALUES ('allowed')")
	if n := count(t, admin, "SELECT count(*) FROM items WHERE tag IN ('allowed', 'ro-off')"); n != 2 {
		t.Fatalf("%d rows, want 2", n)
	}

	// A token whose parameter names are not in lower case is still a token: PostgreSQL
	// folds the names (Fence.Token sets fence.token). A review's stale writer sent them so
	// and ran unfenced, its insert committed.
	connect(t, allow.FenceURL("app", "postgres", "billing", 50))
	err = connectErr(allow.URL("app", "postgres", "Fence.Resource=billing", "FENCE.TOKEN=5"))
	wantStale(t, err)
	// Nor does getopt's clustering of switches hide one (-ec x is -e -c x).
	wantStale(t, connectErr(allow.URL("app", "postgres", "options=-ec fence.resource=billing -ec fence.token=5")))
}

// TestStaleSessionInFlightCancelled: a session frozen in a long query
// inside a transaction is ended when a higher token is admitted through
// another proxy instance: the raise ends its backend, rolling the transaction
// back, and its proxy, which hears of the raise, tells the client ZF001.
func TestStaleSessionInFlightCancelled(t *testing.T) {
	pg, admin := fencedDB(t)
	a := fencedProxy(t, pg, func(c *proxy.Config) { c.ControlDatabase = pg.AdminURL() })
	b := fencedProxy(t, pg)

	old := connect(t, a.FenceURL("app", "postgres", "billing", 10))
	mustExec(t, old, "BEGIN")
	mustExec(t, old, "INSERT INTO items(tag) VALUES ('frozen')")
	pid := old.PgConn().PID()
	done := make(chan error, 1)
	go func() {
		_, err := old.Exec(context.Background(), "SELECT pg_sleep(30)")
		done <- err
	}()
	waitActive(t, admin, pid, "pg_sleep")
	start := time.Now()
	connect(t, b.FenceURL("app", "postgres", "billing", 11))
	// The raise committed only once the old backend had exited.
	if n := count(t, admin, "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", int32(pid)); n != 0 {
		t.Fatalf("the stale backend %d outlived the raise", pid)
	}
	select {
	case err := <-done:
		wantStale(t, err)
		if d := time.Since(start); d > 10*time.Second {
			t.Fatalf("ended after %s", d)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("in-flight query of the stale session was not ended")
	}
	// The session is over: its COMMIT gets ZF001 too (the proxy kept the
	// connection for it), then the connection closes.
	if err := simple(ctxT(t), old, "COMMIT"); err == nil {
		t.Fatal("COMMIT of the stale session succeeded")
	} else if pe := pgErrorOf(err); pe != nil {
		wantStale(t, err)
	}
	wantSessionOver(t, old, fence.CodeStale)
	if n := count(t, admin, "SELECT count(*) FROM items WHERE tag = 'frozen'"); n != 0 {
		t.Fatal("frozen write committed")
	}
}

// TestPsqlFenced drives libpq (psql) with the token in PGOPTIONS.
func TestPsqlFenced(t *testing.T) {
	pg, admin := fencedDB(t)
	p := fencedProxy(t, pg)
	psql := func(token string, sql string) (string, error) {
		cmd := exec.Command(pg.Bin("psql"), "-X", "-v", "ON_ERROR_STOP=1", "-h", p.Host, "-p", strconv.Itoa(p.Port), "-U", "app", "-d", "postgres", "-c", sql)
		cmd.Env = append(os.Environ(), "PGOPTIONS=-c fence.resource=billing -c fence.token="+token, "PGSSLMODE=disable")
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	if out, err := psql("3", "INSERT INTO items(tag) VALUES ('psql3')"); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if out, err := psql("4", "BEGIN; INSERT INTO items(tag) VALUES ('psql4'); COMMIT;"); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	out, err := psql("3", "INSERT INTO items(tag) VALUES ('psql3-stale')")
	if err == nil || !strings.Contains(out, "stale fencing token") || !strings.Contains(out, "ZF001") && !strings.Contains(out, "stale") {
		t.Fatalf("stale psql session: %v: %s", err, out)
	}
	if n := count(t, admin, "SELECT count(*) FROM items WHERE tag LIKE 'psql%'"); n != 2 {
		t.Fatalf("%d psql rows, want 2", n)
	}
}

// TestRefusalOverTLS: a session refused at startup after the TLS switch
// gets its error over TLS, readable by the client.
func TestRefusalOverTLS(t *testing.T) {
	pg, _ := fencedDB(t)
	ca := newCA(t)
	cert, key := ca.issue(t, "proxy")
	p := fencedProxy(t, pg, func(c *proxy.Config) { c.TLSCert, c.TLSKey = cert, key })
	wantCode(t, connectErr(p.URL("app", "postgres", "sslmode=require")), fence.CodeMissing)
	wantCode(t, connectErr(p.URL("app", "postgres", "sslmode=require", "fence.resource=billing", "fence.token=x")), fence.CodeMalformed)
}
