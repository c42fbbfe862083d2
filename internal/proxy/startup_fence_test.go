package proxy_test

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

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
	mustExec(t, admin, "SELECT fence.raise('other', 50)")
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
		// The raise runs in its own READ COMMITTED, READ WRITE transaction
		// whatever the session's defaults.
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

// TestUnfencedPolicies covers --unfenced readonly and allow.
func TestUnfencedPolicies(t *testing.T) {
	pg, _ := fencedDB(t)
	ro := fencedProxy(t, pg, func(c *proxy.Config) { c.Unfenced = proxy.UnfencedReadOnly })
	allow := fencedProxy(t, pg, func(c *proxy.Config) { c.Unfenced = proxy.UnfencedAllow })
	ctx := ctxT(t)

	c := connect(t, ro.URL("app", "postgres"))
	if n := count(t, c, "SELECT count(*) FROM items"); n != 0 {
		t.Fatalf("read: %d", n)
	}
	_, err := c.Exec(ctx, "INSERT INTO items(tag) VALUES ('ro')")
	wantCode(t, err, "25006")
	// The client cannot switch read-only off: the injected check still refuses.
	mustExec(t, c, "SET default_transaction_read_only = off")
	_, err = c.Exec(ctx, "INSERT INTO items(tag) VALUES ('ro')")
	wantCode(t, err, "25006")
	err = simple(ctx, c, "BEGIN READ WRITE; INSERT INTO items(tag) VALUES ('ro'); COMMIT")
	wantCode(t, err, "25006")
	if st := c.PgConn().TxStatus(); st != 'I' {
		t.Fatalf("session state %q after refused COMMIT", st)
	}
	_, err = c.Exec(ctx, "SELECT set_config('default_transaction_read_only', 'off', false)")
	if err != nil {
		t.Fatal(err)
	}
	err = simple(ctx, c, "INSERT INTO items(tag) VALUES ('ro')")
	wantCode(t, err, "25006")

	a := connect(t, allow.URL("app", "postgres"))
	mustExec(t, a, "INSERT INTO items(tag) VALUES ('allowed')")
	if n := count(t, a, "SELECT count(*) FROM items WHERE tag = 'ro'"); n != 0 {
		t.Fatalf("%d read-only writes committed", n)
	}
}

// TestNotAllowedStatements covers statements that could commit past the
// check and so are refused (or made safe) in fenced sessions.
func TestNotAllowedStatements(t *testing.T) {
	pg, admin := fencedDB(t)
	p := fencedProxy(t, pg)
	mustExec(t, admin, `CREATE PROCEDURE commit_inside() LANGUAGE plpgsql AS $$BEGIN INSERT INTO items(tag) VALUES ('proc'); COMMIT; INSERT INTO items(tag) VALUES ('proc2'); END$$`)
	mustExec(t, admin, `CREATE PROCEDURE plain_proc() LANGUAGE sql AS $$INSERT INTO items(tag) VALUES ('plain')$$`)
	c := connect(t, p.FenceURL("app", "postgres", "billing", 1))
	ctx := ctxT(t)

	// Simple protocol: the check makes the string a multi-statement one, so
	// the procedure runs inside an implicit block where it cannot COMMIT.
	err := simple(ctx, c, "CALL commit_inside()")
	wantCode(t, err, "2D000") // invalid transaction termination
	if n := count(t, admin, "SELECT count(*) FROM items WHERE tag LIKE 'proc%'"); n != 0 {
		t.Fatalf("procedure committed %d rows past the check", n)
	}
	if err := simple(ctx, c, "CALL plain_proc()"); err != nil {
		t.Fatalf("plain CALL: %v", err)
	}
	// Extended protocol outside a block: refused.
	extended := func(sql string) error {
		_, err := c.PgConn().ExecParams(ctx, sql, nil, nil, nil, nil).Close()
		return err
	}
	wantCode(t, extended("CALL plain_proc()"), fence.CodeNotAllowed)
	wantCode(t, extended("DO $$BEGIN PERFORM 1; END$$"), fence.CodeNotAllowed)
	// Inside a block it runs, and the COMMIT is checked.
	if err := pgx.BeginFunc(ctx, c, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "CALL plain_proc()")
		return err
	}); err != nil {
		t.Fatalf("CALL in a block: %v", err)
	}
	// Statements that commit in their own transaction.
	err = simple(ctx, c, "CREATE DATABASE fenced_db")
	wantCode(t, err, fence.CodeNotAllowed)
	wantCode(t, extended("CREATE INDEX CONCURRENTLY ON items(tag)"), fence.CodeNotAllowed)
	// Maintenance that changes no data is fine.
	if err := simple(ctx, c, "VACUUM items"); err != nil {
		t.Fatalf("VACUUM: %v", err)
	}
	// Lexing settings that would blind the parser.
	err = simple(ctx, c, "SET standard_conforming_strings = off")
	wantCode(t, err, fence.CodeNotAllowed)
	err = simple(ctx, c, "SET client_encoding = 'SJIS'")
	wantCode(t, err, fence.CodeNotAllowed)
	// Syntax errors are refused by the proxy (it cannot tell what they do).
	err = simple(ctx, c, "SELEC 1")
	wantCode(t, err, "42601")
	// The session is still usable.
	if n := count(t, c, "SELECT 1"); n != 1 {
		t.Fatal("session unusable")
	}
}

// TestStaleSessionInFlightCancelled: a session frozen in a long query is
// cancelled when its proxy learns of a higher token, and its next
// statement is refused.
func TestStaleSessionInFlightCancelled(t *testing.T) {
	pg, admin := fencedDB(t)
	a := fencedProxy(t, pg)
	b := fencedProxy(t, pg)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ready := make(chan struct{})
	go fence.Listen(ctx, pg.AdminURL(), a.Registry, zapNop(), func() { close(ready) }) //nolint:errcheck
	<-ready

	old := connect(t, a.FenceURL("app", "postgres", "billing", 10))
	mustExec(t, old, "BEGIN")
	mustExec(t, old, "INSERT INTO items(tag) VALUES ('frozen')")
	done := make(chan error, 1)
	start := time.Now()
	go func() {
		_, err := old.Exec(context.Background(), "SELECT pg_sleep(30)")
		done <- err
	}()
	time.Sleep(200 * time.Millisecond)
	connect(t, b.FenceURL("app", "postgres", "billing", 11))
	select {
	case err := <-done:
		wantStale(t, err)
		if d := time.Since(start); d > 10*time.Second {
			t.Fatalf("cancelled after %s", d)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("in-flight query of the stale session was not cancelled")
	}
	err := simple(ctxT(t), old, "ROLLBACK")
	if err != nil {
		t.Fatalf("ROLLBACK of a stale session: %v", err)
	}
	_, err = old.Exec(ctxT(t), "SELECT 1")
	wantStale(t, err)
	if n := count(t, admin, "SELECT count(*) FROM items WHERE tag = 'frozen'"); n != 0 {
		t.Fatal("frozen write committed")
	}
}

// TestPsqlFenced drives libpq (psql) with the token in PGOPTIONS.
func TestPsqlFenced(t *testing.T) {
	pg, admin := fencedDB(t)
	p := fencedProxy(t, pg)
	psql := func(token string, sql string) (string, error) {
		cmd := exec.Command(pg.Bin("psql"), "-X", "-v", "ON_ERROR_STOP=1", "-h", p.Host, "-p", itoa(p.Port), "-U", "app", "-d", "postgres", "-c", sql)
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

func itoa(i int) string { return strconvItoa(i) }

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
