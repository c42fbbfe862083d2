package proxy_test

import (
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestAdminConsole drives the admin console on the proxy's port (database fenceproxy) with
// psql and pgx against a real server with password authentication: every command, a user
// who is not an admin, PAUSE and RESUME with a session waiting and one refused at the login
// timeout, RELOAD (and a failed one), renaming the console, and garbage (an unknown command,
// the extended protocol, COPY, a function call, an unknown message, an oversized one), each
// answered with an error without a hang, the connection still usable where PostgreSQL's
// would be.
func TestAdminConsole(t *testing.T) {
	pg, _ := fencedDB(t, testenv.WithAuth("scram-sha-256"))
	pg.CreateRole(t, "ops", "ops-secret")
	ca := newCA(t)
	cert, key := ca.issue(t, "proxy")
	base := proxy.Config{Resources: []string{"billing", "other"}, AdminUsers: []string{"ops"}, TLSCert: cert, TLSKey: key}
	// RELOAD applies next (a copy of base unless a subtest changed it), as SIGHUP would apply
	// the configuration read again.
	var mu sync.Mutex
	next := base
	var p *testenv.Proxy
	reload := func() ([]string, []string, error) {
		mu.Lock()
		c := next
		mu.Unlock()
		if c.Upstream != "-" {
			c.Upstream, c.Listen = fmt.Sprintf("postgres://%s", net.JoinHostPort(pg.Host, strconv.Itoa(pg.Port))), net.JoinHostPort(p.Host, strconv.Itoa(p.Port))
		} else {
			c.Upstream = "" // invalid: the reload fails
		}
		return p.Server.Reload(c)
	}
	p = testenv.StartProxy(t, pg, base, testenv.ProxyOptions{Reload: reload})
	setNext := func(f func(*proxy.Config)) {
		mu.Lock()
		defer mu.Unlock()
		f(&next)
	}
	console := p.URLWithPassword("ops", "ops-secret", "fenceproxy")
	simple := p.URLWithPassword("ops", "ops-secret", "fenceproxy", "default_query_exec_mode=simple_protocol")

	// A fenced session of billing, token 5, open through the proxy: what the lists show.
	app := connect(t, p.FenceURL("app", "postgres", "billing", 5)+"&password=app")
	mustExec(t, app, "SELECT 1")
	// And a stale token refused: what SHOW REFUSALS shows.
	wantStale(t, connectErr(p.FenceURL("app", "postgres", "billing", 4)+"&password=app"))

	t.Run("psql every command", func(t *testing.T) {
		for _, tc := range []struct{ cmd, want string }{
			{"SHOW HELP", "SHOW FENCES|"},
			{"show version;", "fenceproxy "},
			{"SHOW FENCES", "billing|bare|5|||"},
			{"SHOW BINDINGS", "billing|5|1|f"},
			{"SHOW CLIENTS", "|app|postgres|billing|5|f|idle|"},
			{"SHOW REFUSALS", "|start|billing|4|ZF001|stale fencing token"},
			{"SHOW STATS", "fenceproxy_leader_token|resource=billing|5\n"},
			{"SHOW FENCES; SHOW VERSION", "fenceproxy "},
		} {
			out, stderr, err := runPsql(t, pg, console, nil, "-c", tc.cmd)
			if err != nil || stderr != "" {
				t.Fatalf("psql -c %q: %v\n%s%s", tc.cmd, err, stderr, out)
			}
			if !strings.Contains(out, tc.want) {
				t.Errorf("psql -c %q: want %q in\n%s", tc.cmd, tc.want, out)
			}
		}
		out, stderr, err := runPsql(t, pg, console, nil, "-c", "SHOW FENCES")
		if err != nil || !strings.Contains(out, "other|bare|0||||0|f|no token yet|0|f|0") || !strings.Contains(out, "|led|1|f|0") {
			t.Errorf("SHOW FENCES: %v %s\n%s", err, stderr, out)
		}
	})

	t.Run("pgx simple protocol", func(t *testing.T) {
		conn := connect(t, simple)
		ctx := ctxT(t)
		rows, err := conn.Query(ctx, "SHOW FENCES")
		if err != nil {
			t.Fatal(err)
		}
		type fenceRow struct {
			Resource, Store    string
			Token              int64
			Holder, HolderName *string
			AdmittedAt         *time.Time
			Changes            int64
			Flapping           bool
			State              string
			Sessions           int64
			Paused             bool
			Waiting            int64
		}
		got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[fenceRow])
		if err != nil {
			t.Fatal(err)
		}
		// One source: what /status says.
		st := p.Server.Status(ctx)
		if len(got) != len(st.Resources) {
			t.Fatalf("SHOW FENCES has %d rows, /status %d resources", len(got), len(st.Resources))
		}
		for i, r := range st.Resources {
			g := got[i]
			if g.Resource != r.Resource || g.Token != r.Token || g.Store != r.Store || (g.AdmittedAt == nil) != (r.AdmittedAt == nil) {
				t.Errorf("SHOW FENCES row %d %+v, /status %+v", i, g, r)
			}
		}
		if got[0].Resource != "billing" || got[0].Token != 5 || got[0].Sessions != 1 || got[0].AdmittedAt == nil || got[0].State != "led" {
			t.Errorf("billing: %+v", got[0])
		}
		var id, pid int64
		var user, state string
		var token *int64
		if err := conn.QueryRow(ctx, "SHOW CLIENTS").Scan(&id, new(string), &user, new(string), new(*string), &token, new(bool), &state, &pid, new(time.Time)); err != nil {
			t.Fatal(err)
		}
		if user != "app" || token == nil || *token != 5 || state != "idle" || pid == 0 {
			t.Errorf("SHOW CLIENTS: user %q token %v state %q pid %d", user, token, state, pid)
		}
		var version string
		if err := conn.QueryRow(ctx, "SHOW VERSION").Scan(&version); err != nil || !strings.HasPrefix(version, "fenceproxy ") {
			t.Errorf("SHOW VERSION: %q %v", version, err)
		}
		var n int
		var value float64
		rows, _ = conn.Query(ctx, "SHOW STATS")
		_, err = pgx.ForEachRow(rows, []any{new(string), new(string), &value}, func() error { n++; return nil })
		if err != nil || n == 0 {
			t.Errorf("SHOW STATS: %d rows, %v", n, err)
		}
		for cmd, tag := range map[string]string{"SHOW BINDINGS": "SHOW 1", "SHOW HELP": "SHOW 10", "SHOW REFUSALS": "SHOW 1", "show fences": "SHOW 2"} {
			got, err := conn.Exec(ctx, cmd)
			if err != nil || got.String() != tag {
				t.Errorf("%s: %q %v, want %s", cmd, got, err, tag)
			}
		}
	})

	t.Run("tls", func(t *testing.T) {
		conn := connect(t, p.URLWithPassword("ops", "ops-secret", "fenceproxy", "sslmode=require"))
		if _, err := conn.Exec(ctxT(t), "SHOW VERSION"); err != nil {
			t.Errorf("the console over TLS: %v", err)
		}
	})

	t.Run("not an admin", func(t *testing.T) {
		err := connectErr(p.URLWithPassword("app", "app", "fenceproxy"))
		wantCode(t, err, "28000")
		if !strings.Contains(err.Error(), `user "app" may not use the fenceproxy admin console`) || !strings.Contains(err.Error(), "--admin-users") {
			t.Errorf("refusal: %v", err)
		}
		if pe := pgErrorOf(err); pe != nil && !strings.Contains(pe.Hint, "--admin-database") {
			t.Errorf("hint %q does not say how to reach a server database of that name", pe.Hint)
		}
		_, stderr, err := runPsql(t, pg, p.URLWithPassword("app", "app", "fenceproxy"), nil, "-c", "SHOW FENCES")
		if err == nil || !strings.Contains(stderr, "--admin-users") {
			t.Errorf("psql as app: %v %s", err, stderr)
		}
		// An admin user with a wrong password: the server refuses it.
		wantCode(t, connectErr(p.URLWithPassword("ops", "wrong", "fenceproxy")), "28P01")
	})

	t.Run("garbage", func(t *testing.T) {
		conn := connect(t, console) // pgx's default: the extended protocol
		ctx := ctxT(t)
		_, err := conn.Query(ctx, "SHOW FENCES")
		wantCode(t, err, "0A000")
		if !strings.Contains(err.Error(), "simple query protocol") {
			t.Errorf("extended protocol: %v", err)
		}
		for _, tc := range []struct{ sql, code, want string }{
			{"SELECT 1", "42601", "not a fenceproxy admin console command"},
			{"SHOW POOLS", "42601", "SHOW takes FENCES"},
			{"COPY x FROM STDIN", "0A000", "COPY is not supported"},
			{"PAUSE nosuch", "42704", `no resource "nosuch"`},
		} {
			_, err := conn.Exec(ctx, tc.sql) // no arguments: the simple protocol
			wantCode(t, err, tc.code)
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s: %v", tc.sql, err)
			}
		}
		if _, err := conn.Exec(ctx, ";"); err != nil {
			t.Errorf("an empty query: %v", err)
		}
		if err := conn.Ping(ctx); err != nil { // "-- ping"
			t.Errorf("pgx's Ping: %v", err)
		}
		if _, err := conn.Exec(ctx, "SHOW VERSION"); err != nil {
			t.Errorf("after the errors the console answers no more: %v", err)
		}
		// Raw messages: COPY data outside a COPY (ignored), a function call (an error), then
		// an unknown message type (FATAL, closed).
		fe := conn.PgConn().Frontend()
		fe.Send(&pgproto3.CopyData{Data: []byte("1\n")})
		fe.Send(&pgproto3.CopyDone{})
		fe.Send(&pgproto3.FunctionCall{Function: 1})
		fe.Send(&pgproto3.Query{String: "SHOW VERSION"})
		if err := fe.Flush(); err != nil {
			t.Fatal(err)
		}
		var seen []string
		readyLeft := 2
		deadline := time.Now().Add(10 * time.Second)
		conn.PgConn().Conn().SetReadDeadline(deadline) //nolint:errcheck
		for readyLeft > 0 {
			m, err := fe.Receive()
			if err != nil {
				t.Fatalf("after %v: %v", seen, err)
			}
			switch m := m.(type) {
			case *pgproto3.ErrorResponse:
				seen = append(seen, "E "+m.Code)
			case *pgproto3.ReadyForQuery:
				readyLeft--
				seen = append(seen, "Z")
			case *pgproto3.DataRow:
				seen = append(seen, "D "+string(m.Values[0][:10]))
			}
		}
		if want := "[E 0A000 Z D fenceproxy Z]"; fmt.Sprint(seen) != want {
			t.Errorf("answers %v, want %s", seen, want)
		}
		raw := conn.PgConn().Conn()
		if _, err := raw.Write([]byte{'~', 0, 0, 0, 4}); err != nil {
			t.Fatal(err)
		}
		m, err := fe.Receive()
		if e, ok := m.(*pgproto3.ErrorResponse); !ok || e.Severity != "FATAL" || e.Code != "08P01" {
			t.Errorf("an unknown message type: %#v %v", m, err)
		}
		if _, err := fe.Receive(); err == nil {
			t.Errorf("the console did not close the connection after its FATAL")
		}
		// An oversized query: FATAL 54000, closed.
		big := connect(t, simple)
		_, err = big.Exec(ctx, "SHOW "+strings.Repeat("x", 70<<10))
		wantCode(t, err, "54000")
		// psql: an error on stderr, exit code 1, not a hang.
		_, stderr, err := runPsql(t, pg, console, nil, "-c", "COPY x FROM STDIN")
		if err == nil || !strings.Contains(stderr, "COPY is not supported") {
			t.Errorf("psql COPY: %v %s", err, stderr)
		}
	})

	t.Run("pause and resume", func(t *testing.T) {
		admin := connect(t, simple)
		ctx := ctxT(t)
		if _, err := admin.Exec(ctx, "PAUSE billing"); err != nil {
			t.Fatal(err)
		}
		waited := make(chan error, 1)
		go func() { waited <- connectErr(p.FenceURL("app", "postgres", "billing", 5) + "&password=app") }()
		eventually(t, time.Minute, "the session of billing waiting", func() error {
			var paused bool
			var waiting int64
			err := admin.QueryRow(ctx, "SHOW FENCES").Scan(new(string), new(string), new(int64), new(*string), new(*string), new(*time.Time),
				new(int64), new(bool), new(string), new(int64), &paused, &waiting)
			if err == nil && paused && waiting == 1 {
				return nil
			}
			return fmt.Errorf("paused %v waiting %d %v", paused, waiting, err)
		})
		// Another resource is not paused.
		if err := connectErr(p.FenceURL("app", "postgres", "other", 1) + "&password=app"); err != nil {
			t.Errorf("a session of other while billing is paused: %v", err)
		}
		select {
		case err := <-waited:
			t.Fatalf("the session of billing did not wait: %v", err)
		default:
		}
		if _, err := admin.Exec(ctx, "RESUME billing"); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-waited:
			if err != nil {
				t.Fatalf("the waiting session after RESUME: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("the waiting session did not start after RESUME")
		}
		if st := p.Server.Status(ctx); st.Paused || st.Waiting != 0 {
			t.Errorf("/status after RESUME: paused %v waiting %d", st.Paused, st.Waiting)
		}
	})

	t.Run("reload", func(t *testing.T) {
		// app becomes an admin, the login timeout 2 s.
		setNext(func(c *proxy.Config) { c.AdminUsers = []string{"ops", "app"}; c.LoginTimeout = 2 * time.Second })
		_, stderr, err := runPsql(t, pg, console, nil, "-c", "RELOAD")
		if err != nil || !strings.Contains(stderr, "NOTICE:  reloaded: login-timeout 2s (was 15s)") || !strings.Contains(stderr, "admin-users [ops app]") {
			t.Fatalf("RELOAD: %v\n%s", err, stderr)
		}
		if out, stderr, err := runPsql(t, pg, p.URLWithPassword("app", "app", "fenceproxy"), nil, "-c", "SHOW VERSION"); err != nil {
			t.Errorf("app after it became an admin: %v %s %s", err, stderr, out)
		}
		// An invalid configuration changes nothing.
		setNext(func(c *proxy.Config) { c.Upstream = "-" })
		_, stderr, err = runPsql(t, pg, console, nil, "-c", "RELOAD")
		if err == nil || !strings.Contains(stderr, "reload failed, nothing changed") {
			t.Errorf("a failed RELOAD: %v %s", err, stderr)
		}
		setNext(func(c *proxy.Config) { c.Upstream = "" })
	})

	t.Run("paused past the login timeout", func(t *testing.T) { // after reload: 2 s
		admin := connect(t, simple)
		ctx := ctxT(t)
		if _, err := admin.Exec(ctx, "PAUSE"); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		err := connectErr(p.FenceURL("app", "postgres", "billing", 5) + "&password=app")
		wantCode(t, err, "57P03")
		if !strings.Contains(err.Error(), "fenceproxy is paused (PAUSE on its admin console) and was not resumed within") || time.Since(start) > 10*time.Second {
			t.Errorf("after %s: %v", time.Since(start), err)
		}
		// The console itself is not paused, and RESUME of one resource does not end a PAUSE of all.
		_, err = admin.Exec(ctx, "RESUME billing")
		wantCode(t, err, "55000")
		if _, err := admin.Exec(ctx, "RESUME"); err != nil {
			t.Fatal(err)
		}
		if err := connectErr(p.FenceURL("app", "postgres", "billing", 5) + "&password=app"); err != nil {
			t.Errorf("after RESUME: %v", err)
		}
	})

	t.Run("renamed", func(t *testing.T) {
		setNext(func(c *proxy.Config) { c.AdminDatabase = "fenceproxy_admin" })
		if _, stderr, err := runPsql(t, pg, console, nil, "-c", "RELOAD"); err != nil {
			t.Fatalf("RELOAD: %v %s", err, stderr)
		}
		// fenceproxy is now a name for the server, which has no such database.
		wantCode(t, connectErr(p.FenceURL("ops", "fenceproxy", "other", 1)+"&password=ops-secret"), "3D000")
		renamed := p.URLWithPassword("ops", "ops-secret", "fenceproxy_admin")
		out, stderr, err := runPsql(t, pg, renamed, nil, "-c", "SHOW VERSION")
		if err != nil || !strings.Contains(out, "fenceproxy ") {
			t.Errorf("the renamed console: %v %s %s", err, stderr, out)
		}
		// No admin users: the console is closed to everyone, and says what opens it.
		setNext(func(c *proxy.Config) { c.AdminUsers = nil })
		if _, stderr, err := runPsql(t, pg, renamed, nil, "-c", "RELOAD"); err != nil {
			t.Fatalf("RELOAD: %v %s", err, stderr)
		}
		err = connectErr(renamed)
		wantCode(t, err, "28000")
		if !strings.Contains(err.Error(), `the fenceproxy admin console (database "fenceproxy_admin") is closed: fenceproxy --admin-users is empty`) {
			t.Errorf("the closed console: %v", err)
		}
	})
	t.Run("shutdown", func(t *testing.T) {
		// An idle console and a session waiting for RESUME do not hold the shutdown: the
		// console is closed, the session refused.
		setNext(func(c *proxy.Config) { c.AdminUsers = []string{"ops"}; c.LoginTimeout = time.Minute })
		if _, _, err := reload(); err != nil { // the console was closed: as SIGHUP would
			t.Fatal(err)
		}
		admin := connect(t, p.URLWithPassword("ops", "ops-secret", "fenceproxy_admin", "default_query_exec_mode=simple_protocol"))
		ctx := ctxT(t)
		if _, err := admin.Exec(ctx, "PAUSE"); err != nil {
			t.Fatal(err)
		}
		waited := make(chan error, 1)
		go func() { waited <- connectErr(p.FenceURL("app", "postgres", "billing", 5) + "&password=app") }()
		eventually(t, time.Minute, "a session waiting", func() error {
			if st := p.Server.Status(ctx); st.Waiting != 1 {
				return fmt.Errorf("%d waiting", st.Waiting)
			}
			return nil
		})
		start := time.Now()
		p.Stop(t)
		if d := time.Since(start); d > 20*time.Second {
			t.Errorf("the shutdown took %s", d)
		}
		err := <-waited
		wantCode(t, err, "57P03")
		if !strings.Contains(err.Error(), "shutting down") {
			t.Errorf("the waiting session at shutdown: %v", err)
		}
		if _, err := admin.Exec(ctx, "SHOW VERSION"); err == nil {
			t.Error("the console still answers after the shutdown")
		}
	})
}
