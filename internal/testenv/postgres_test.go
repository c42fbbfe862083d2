package testenv_test

import (
	"errors"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

func connect(t *testing.T, url string) *pgx.Conn { return testenv.Connect(t, url) }

func queryString(t *testing.T, conn *pgx.Conn, sql string) string {
	t.Helper()
	var s string
	if err := conn.QueryRow(t.Context(), sql).Scan(&s); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return s
}

// socketURL reaches the cluster over its unix socket.
func socketURL(pg *testenv.Postgres, userinfo string) string {
	return "postgres://" + userinfo + "@/postgres?host=" + pg.SocketDir + "&port=" + strconv.Itoa(pg.Port)
}

func TestStartPostgres(t *testing.T) {
	tests := []struct {
		name string
		opts []testenv.PGOption
		auth string
		ssl  bool
	}{
		{name: "trust", auth: "trust", opts: []testenv.PGOption{testenv.WithConf("work_mem", "8MB")}},
		{name: "scram+ssl", auth: "scram-sha-256", ssl: true,
			opts: []testenv.PGOption{testenv.WithAuth("scram-sha-256"), testenv.WithSSL()}},
		{name: "md5", auth: "md5", opts: []testenv.PGOption{testenv.WithAuth("md5")}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			pg := testenv.StartPostgres(t, tt.opts...)
			if pg.Host != "127.0.0.1" || pg.Port == 0 {
				t.Fatalf("address %s:%d", pg.Host, pg.Port)
			}
			if _, err := os.Stat(pg.Bin("pgbench")); err != nil {
				t.Errorf("Bin(pgbench): %v", err)
			}

			admin := connect(t, pg.AdminURL())
			settings := map[string]string{
				"max_prepared_transactions": "10",
				"fsync":                     "off",
				"listen_addresses":          "127.0.0.1",
				"unix_socket_directories":   pg.SocketDir,
				"ssl":                       map[bool]string{true: "on", false: "off"}[tt.ssl],
			}
			if tt.name == "trust" {
				settings["work_mem"] = "8MB"
			}
			for name, want := range settings {
				if got := queryString(t, admin, "SHOW "+name); got != want {
					t.Errorf("SHOW %s = %q, want %q", name, got, want)
				}
			}

			pg.CreateRole(t, "alice", "it's secret")
			pg.Exec(t, "GRANT pg_read_all_stats TO alice")
			wantPrefix := map[string]string{"trust": "SCRAM-SHA-256$", "scram-sha-256": "SCRAM-SHA-256$", "md5": "md5"}[tt.auth]
			if got := queryString(t, admin, "SELECT rolpassword FROM pg_authid WHERE rolname = 'alice'"); !strings.HasPrefix(got, wantPrefix) {
				t.Errorf("alice's stored password %.16q..., want prefix %q", got, wantPrefix)
			}

			alice := connect(t, pg.URLWithPassword("alice", "it's secret", "postgres"))
			if got := queryString(t, alice, "SELECT current_user"); got != "alice" {
				t.Errorf("current_user = %q", got)
			}
			connect(t, socketURL(pg, "alice:it's%20secret"))

			if tt.auth != "trust" {
				_, err := pgx.Connect(t.Context(), pg.URLWithPassword("alice", "wrong", "postgres"))
				var pgErr *pgconn.PgError
				if !errors.As(err, &pgErr) || pgErr.Code != "28P01" {
					t.Errorf("wrong password: err = %v, want SQLSTATE 28P01", err)
				}
			}

			if tt.ssl {
				for _, host := range []string{"127.0.0.1", "localhost"} {
					url := pg.URLWithPassword("alice", "it's secret", "postgres", "sslmode=verify-full", "sslrootcert="+pg.CAFile)
					url = strings.Replace(url, "127.0.0.1", host, 1)
					conn := connect(t, url)
					if got := queryString(t, conn, "SELECT ssl::text FROM pg_stat_ssl WHERE pid = pg_backend_pid()"); got != "true" {
						t.Errorf("%s: ssl = %s", host, got)
					}
				}
			}
		})
	}
}

func TestPostgresLifecycle(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPostgres(t)
	pg.Exec(t, "CREATE TABLE t (v int); INSERT INTO t VALUES (1)")
	pg.Exec(t, "BEGIN; INSERT INTO t VALUES (2); PREPARE TRANSACTION 'p1'")

	t.Run("restart keeps data and prepared transactions", func(t *testing.T) {
		pg.Restart(t)
		conn := connect(t, socketURL(pg, "postgres"))
		if got := queryString(t, conn, "SELECT count(*)::text FROM t"); got != "1" {
			t.Errorf("rows after restart = %s, want 1", got)
		}
		if got := queryString(t, conn, "SELECT gid FROM pg_prepared_xacts"); got != "p1" {
			t.Errorf("prepared transaction = %q, want p1", got)
		}
		pg.Exec(t, "COMMIT PREPARED 'p1'")
	})

	t.Run("kill is a crash", func(t *testing.T) {
		conn := connect(t, pg.AdminURL())
		pg.Kill(t)
		if _, err := conn.Exec(t.Context(), "SELECT 1"); err == nil {
			t.Error("query on a killed server succeeded")
		}
		pg.Start(t)
		conn = connect(t, pg.AdminURL())
		queryString(t, conn, "SELECT 'up'")
		log, err := os.ReadFile(pg.LogFile)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(log), "automatic recovery in progress") {
			t.Errorf("no crash recovery in the server log:\n%s", log)
		}
	})

	t.Run("stop closes the port, start reopens it", func(t *testing.T) {
		pg.Stop(t)
		pg.Stop(t) // stopping a stopped cluster does nothing
		if c, err := net.Dial("tcp", net.JoinHostPort(pg.Host, strconv.Itoa(pg.Port))); err == nil {
			c.Close()
			t.Error("port still open after Stop")
		}
		pg.Start(t)
		connect(t, pg.AdminURL())
	})
}

func TestPostgresURL(t *testing.T) {
	pg := &testenv.Postgres{Host: "127.0.0.1", Port: 5999}
	tests := []struct {
		name string
		got  string
		want string
	}{
		{"plain", pg.URL("app", "db"), "postgres://app@127.0.0.1:5999/db?sslmode=disable"},
		{"params", pg.URL("app", "db", "application_name=x y"), "postgres://app@127.0.0.1:5999/db?application_name=x%20y&sslmode=disable"},
		{"sslmode overrides", pg.URL("app", "db", "sslmode=require"), "postgres://app@127.0.0.1:5999/db?sslmode=require"},
		{"password escaped", pg.URLWithPassword("app", "p@ss/w:rd", "db"), "postgres://app:p%40ss%2Fw%3Ard@127.0.0.1:5999/db?sslmode=disable"},
		{"admin", pg.AdminURL(), "postgres://postgres:postgres@127.0.0.1:5999/postgres?sslmode=disable"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.got != tt.want {
				t.Errorf("got  %s\nwant %s", tt.got, tt.want)
			}
			if _, err := pgx.ParseConfig(tt.got); err != nil {
				t.Errorf("pgx cannot parse it: %v", err)
			}
		})
	}
}

func TestFreePort(t *testing.T) {
	port := testenv.FreePort(t)
	l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		t.Fatalf("FreePort gave %d, which cannot be bound: %v", port, err)
	}
	l.Close()
}

// TestLaunchPostgres checks the face of the package that programs use: errors instead of a
// failed test, and a Close that leaves nothing behind.
func TestLaunchPostgres(t *testing.T) {
	t.Parallel()
	if _, err := testenv.LaunchPostgres(t.Context(), testenv.WithAuth("ident")); err == nil {
		t.Fatal("LaunchPostgres accepted WithAuth(ident)")
	}
	pg, err := testenv.LaunchPostgres(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	defer func() {
		if !closed {
			_ = pg.Close()
		}
	}()
	if err := pg.ExecContext(t.Context(), "CREATE DATABASE launched"); err != nil {
		t.Fatal(err)
	}
	if err := pg.ExecContext(t.Context(), "SELECT * FROM no_such_table"); err == nil {
		t.Fatal("ExecContext of a failing statement returned no error")
	}
	if err := pg.Close(); err != nil {
		t.Fatal(err)
	}
	closed = true
	if pg.Running() {
		t.Error("running after Close")
	}
	if _, err := os.Stat(pg.DataDir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("data folder %s after Close: %v", pg.DataDir, err)
	}
}
