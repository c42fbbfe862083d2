package main_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
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

// binDir holds the binary buildBinary builds, removed by TestMain.
var (
	binDir   string
	binOnce  sync.Once
	binPath  string
	binError error
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "fenceproxy-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binDir = dir
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// buildBinary builds fenceproxy once per test binary run.
func buildBinary(t *testing.T) string {
	t.Helper()
	binOnce.Do(func() {
		bin := filepath.Join(binDir, "fenceproxy")
		out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
		if err != nil {
			binError = fmt.Errorf("go build: %w\n%s", err, out)
			return
		}
		binPath = bin
	})
	if binError != nil {
		t.Fatal(binError)
	}
	return binPath
}

func freeAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

func waitListening(t *testing.T, addr string) {
	t.Helper()
	eventually(t, 20*time.Second, "something listens on "+addr, func() error {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
		}
		return err
	})
}

// TestServeBinary runs the real binary: configuration from a file, the
// environment and flags (flag over file over environment), a session
// through it, migrate, and SIGTERM: the session in a transaction may finish,
// then the process exits 0.
func TestServeBinary(t *testing.T) {
	bin := buildBinary(t)
	pg := testenv.StartPostgres(t)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()

	// migrate --key-file creates the key file the proxy then reads.
	keyFile := filepath.Join(t.TempDir(), "proxy.key")
	out, err := exec.CommandContext(ctx, bin, "migrate", "--database", pg.AdminURL(), "--key-file", keyFile).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "applied migration 1") || !strings.Contains(string(out), "created key file "+keyFile) {
		t.Fatalf("migrate: %v\n%s", err, out)
	}
	// In the order it happens: the migrations, the summary, then the key.
	if o := string(out); strings.Index(o, "applied migration 1") > strings.Index(o, "fence schema installed") ||
		strings.Index(o, "fence schema installed") > strings.Index(o, "created key file") {
		t.Fatalf("migrate printed out of order:\n%s", out)
	}
	out, err = exec.CommandContext(ctx, bin, "migrate", "--database", pg.AdminURL()).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "up to date") {
		t.Fatalf("migrate again: %v\n%s", err, out)
	}

	addr := freeAddr(t)
	cfg := filepath.Join(t.TempDir(), "fenceproxy.json")
	conf, _ := json.Marshal(map[string]any{
		"listen": "127.0.0.1:1", "resource": []string{"billing"}, "unfenced": "reject", "shutdown-grace": "20s",
		"key-file": keyFile,
	})
	os.WriteFile(cfg, conf, 0o600) //nolint:errcheck
	cmd := exec.CommandContext(ctx, bin, "serve", "--config", cfg, "--listen", addr, "--log-format", "console")
	cmd.Env = append(os.Environ(),
		"FENCEPROXY_UPSTREAM=postgres://"+net.JoinHostPort(pg.Host, strconv.Itoa(pg.Port)),
		"FENCEPROXY_UNFENCED=allow", // the file says reject, and wins
	)
	var logs strings.Builder
	cmd.Stderr = &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waitListening(t, addr)

	url := "postgres://postgres:postgres@" + addr + "/postgres?sslmode=disable"
	if _, err := pgx.Connect(ctx, url); err == nil {
		t.Fatal("a session without a token was admitted: the config file's unfenced=reject was not applied")
	}
	conn, err := pgx.Connect(ctx, url+"&fence.resource=billing&fence.token=3")
	if err != nil {
		t.Fatalf("fenced session: %v\n%s", err, logs.String())
	}
	// Bound with the key from the file: the database holds the binding, and refuses a
	// lower token.
	var bound int64
	if err := conn.QueryRow(ctx, "SELECT token FROM fence.bindings WHERE pid = pg_backend_pid() AND resource = 'billing'").Scan(&bound); err != nil || bound != 3 {
		t.Fatalf("binding of the fenced session: %d, %v\n%s", bound, err, logs.String())
	}
	_, err = pgx.Connect(ctx, url+"&fence.resource=billing&fence.token=2")
	if pe := (*pgconn.PgError)(nil); !errors.As(err, &pe) || pe.Code != fence.CodeStale {
		t.Fatalf("a session with a lower token: %v, want SQLSTATE %s", err, fence.CodeStale)
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "CREATE TABLE bin_test (x int)"); err != nil {
		t.Fatal(err)
	}
	// SIGTERM while the session is inside a transaction: it may still commit.
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if _, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		t.Error("still accepting connections after SIGTERM")
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("commit during the grace period: %v", err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		var ee *exec.ExitError
		if errors.As(err, &ee) || err != nil {
			t.Fatalf("exit: %v\n%s", err, logs.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("did not exit after SIGTERM\n%s", logs.String())
	}
	if !strings.Contains(logs.String(), "fenceproxy stopped") {
		t.Errorf("no shutdown log line:\n%s", logs.String())
	}
	// The file's keys are the flag names, hyphens included: its shutdown-grace applied.
	if !strings.Contains(logs.String(), `"grace": "20s"`) {
		t.Errorf("the config file's shutdown-grace of 20s was not applied:\n%s", logs.String())
	}
}

// TestMigrateKeyFile: migrate --key-file creates the key file when it is missing (0600, a
// new random key) and stores its key in the database; it reuses a file that exists, and
// stores whatever key it holds; a file it cannot read is an error that changes nothing.
func TestMigrateKeyFile(t *testing.T) {
	bin := buildBinary(t)
	pg := testenv.StartPostgres(t)
	admin := testenv.Connect(t, pg.AdminURL())
	dir := t.TempDir()
	storedKey := func(t *testing.T) []byte {
		t.Helper()
		var k []byte
		err := admin.QueryRow(t.Context(), "SELECT key FROM fence.keys").Scan(&k)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			t.Fatal(err)
		}
		return k
	}
	migrate := func(t *testing.T, args ...string) (string, error) {
		t.Helper()
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
		defer cancel()
		out, err := exec.CommandContext(ctx, bin, append([]string{"migrate", "--database", pg.AdminURL()}, args...)...).CombinedOutput()
		return string(out), err
	}

	created := filepath.Join(dir, "created.key")
	var createdKey fence.Key
	t.Run("missing file is created and stored", func(t *testing.T) {
		out, err := migrate(t, "--key-file", created)
		if err != nil || !strings.Contains(out, "created key file "+created) || !strings.Contains(out, "proxy key stored in the database") {
			t.Fatalf("migrate: %v\n%s", err, out)
		}
		fi, err := os.Stat(created)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Fatalf("key file mode %v, want 0600", fi.Mode().Perm())
		}
		if createdKey, err = fence.LoadKey(created); err != nil {
			t.Fatalf("the created key file: %v", err)
		}
		if len(createdKey) != fence.KeySize {
			t.Fatalf("created key has %d bytes, want %d", len(createdKey), fence.KeySize)
		}
		if k := storedKey(t); !bytes.Equal(k, createdKey) {
			t.Fatalf("the database holds %x, the file %x", k, createdKey)
		}
	})

	t.Run("present file is reused", func(t *testing.T) {
		before, err := os.ReadFile(created)
		if err != nil {
			t.Fatal(err)
		}
		out, err := migrate(t, "--key-file", created)
		if err != nil || strings.Contains(out, "created key file") || !strings.Contains(out, "proxy key stored in the database") || !strings.Contains(out, "up to date") {
			t.Fatalf("migrate: %v\n%s", err, out)
		}
		if after, _ := os.ReadFile(created); !bytes.Equal(after, before) {
			t.Fatalf("the key file changed: %q, was %q", after, before)
		}
		if k := storedKey(t); !bytes.Equal(k, createdKey) {
			t.Fatalf("the database holds %x, want the file's %x", k, createdKey)
		}
	})

	other := filepath.Join(dir, "other.key")
	otherKey := fence.Key(strings.Repeat("k", 24))
	if err := fence.WriteKeyFile(other, otherKey); err != nil {
		t.Fatal(err)
	}
	t.Run("another existing file replaces the stored key", func(t *testing.T) {
		out, err := migrate(t, "--key-file", other)
		if err != nil || strings.Contains(out, "created key file") {
			t.Fatalf("migrate: %v\n%s", err, out)
		}
		if k := storedKey(t); !bytes.Equal(k, otherKey) {
			t.Fatalf("the database holds %x, want %x", k, otherKey)
		}
	})

	malformed := filepath.Join(dir, "malformed.key")
	if err := os.WriteFile(malformed, []byte("not a key\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	short := filepath.Join(dir, "short.key")
	if err := os.WriteFile(short, []byte("abcdef\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name, path, msg string
	}{
		{"malformed file", malformed, "not hex"},
		{"short key", short, "has 3 bytes, needs 16 or more"},
		{"folder that does not exist", filepath.Join(dir, "no-such-folder", "k"), "no such file or directory"},
	} {
		t.Run(tt.name+" is an error that changes nothing", func(t *testing.T) {
			before, _ := os.ReadFile(tt.path)
			out, err := migrate(t, "--key-file", tt.path)
			var ee *exec.ExitError
			if !errors.As(err, &ee) || ee.ExitCode() != 1 {
				t.Fatalf("exit %v, want 1\n%s", err, out)
			}
			if !strings.Contains(out, tt.msg) || !strings.Contains(out, tt.path) {
				t.Fatalf("output does not say %q of %s:\n%s", tt.msg, tt.path, out)
			}
			if after, _ := os.ReadFile(tt.path); !bytes.Equal(after, before) {
				t.Fatalf("the file changed: %q, was %q", after, before)
			}
			if k := storedKey(t); !bytes.Equal(k, otherKey) {
				t.Fatalf("the database holds %x, want %x kept", k, otherKey)
			}
		})
	}

	t.Run("without --key-file the stored key stays", func(t *testing.T) {
		if out, err := migrate(t); err != nil || strings.Contains(out, "key") {
			t.Fatalf("migrate: %v\n%s", err, out)
		}
		if k := storedKey(t); !bytes.Equal(k, otherKey) {
			t.Fatalf("the database holds %x, want %x kept", k, otherKey)
		}
	})
}

// TestUsageErrors: bad flags and configuration fail with exit status 2 or
// 1 and a message, never a panic.
func TestUsageErrors(t *testing.T) {
	bin := buildBinary(t)
	dir := t.TempDir()
	badKey := filepath.Join(dir, "bad.key")
	if err := os.WriteFile(badKey, []byte("zz\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	goodKey := filepath.Join(dir, "good.key")
	if err := os.WriteFile(goodKey, []byte(strings.Repeat("ab", 32)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	twice := filepath.Join(dir, "twice.json")
	if err := os.WriteFile(twice, []byte(`{"key-file": "a", "key_file": "b"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	truncated := filepath.Join(dir, "truncated.json")
	if err := os.WriteFile(truncated, []byte(`{"max-clients": 5, "resource": ["bill`), 0o600); err != nil {
		t.Fatal(err)
	}
	misspelled := filepath.Join(dir, "misspelled.json")
	if err := os.WriteFile(misspelled, []byte(`{"max_client": 5, "keyFile": "k"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	serve := func(args ...string) []string {
		return append([]string{"serve", "--upstream", "postgres://127.0.0.1:1"}, args...)
	}
	tests := []struct {
		name string
		args []string
		code int
		msg  string
	}{
		{"unknown flag", []string{"serve", "--nope"}, 2, "unknown flag"},
		{"missing upstream", []string{"serve"}, 2, "upstream"},
		{"bad resource", serve("--resource", "Bad Name"), 1, "resource"},
		{"bad unfenced", serve("--unfenced", "sometimes"), 2, "unfenced"},
		{"upstream with a database", []string{"serve", "--upstream", "postgres://127.0.0.1:1/app"}, 1, "user and database come from each client"},
		{"upstream without postgres://", []string{"serve", "--upstream", "127.0.0.1:5432"}, 1, "is not a postgres:// URL: write postgres://127.0.0.1:5432"},
		{"upstream hosts without their ports", []string{"serve", "--upstream", "host=db1,db2 port=5432,5433,5434"}, 1, "3 ports for 2 hosts"},
		{"upstream hosts without a control database", []string{"serve", "--upstream", "postgres://db1,db2/?target_session_attrs=read-write", "--resource", "billing", "--key-file", goodKey}, 1, "needs control-database"},
		{"resource without a key file", serve("--resource", "billing"), 1, "key-file is required with resource"},
		{"missing key file", serve("--resource", "billing", "--key-file", filepath.Join(dir, "missing.key")), 1, "missing.key"},
		{"malformed key file", serve("--resource", "billing", "--key-file", badKey), 1, "not hex"},
		{"config key given twice", serve("--config", twice), 2, `configuration key "key`},
		{"negative max-clients", serve("--max-clients=-1"), 1, "max-clients -1: must not be negative"},
		{"negative login-timeout", serve("--login-timeout=-1s"), 1, "login-timeout -1s: must not be negative"},
		{"negative flap-window", serve("--flap-window=-5m"), 1, "flap-window -5m0s: must not be negative"},
		{"flap-changes 0", serve("--flap-changes=0"), 2, "flap-changes 0: must be 1 or more"},
		{"truncated config file", serve("--config", truncated), 2, "truncated.json: empty or truncated"},
		{"unknown config key", serve("--config", misspelled), 2, "misspelled.json: unknown key(s) max-client:"},
		{"fence reset to token 0", []string{"fence", "reset", "--database", "postgres://127.0.0.1:1/app", "--resource", "billing", "--token", "0"}, 1, "positive integer"},
		{"migrate without a database", []string{"migrate", "--key-file", filepath.Join(dir, "k")}, 2, "database"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, err := exec.Command(bin, tt.args...).CombinedOutput()
			var ee *exec.ExitError
			if !errors.As(err, &ee) || ee.ExitCode() != tt.code {
				t.Fatalf("exit %v, want %d\n%s", err, tt.code, out)
			}
			if !strings.Contains(strings.ToLower(string(out)), strings.ToLower(tt.msg)) {
				t.Fatalf("output does not mention %q:\n%s", tt.msg, out)
			}
			if strings.Contains(string(out), "panic") {
				t.Fatalf("panicked:\n%s", out)
			}
			if n := strings.Count(strings.ToLower(string(out)), strings.ToLower(tt.msg)); tt.code == 1 && n != 1 {
				t.Fatalf("the error is printed %d times, want once:\n%s", n, out)
			}
		})
	}
	if _, err := os.Stat(filepath.Join(dir, "k")); err == nil {
		t.Error("a migrate that failed its flags created a key file")
	}
}

// TestFenceCommands: fence show lists the stored tokens and the live bound sessions; fence
// reset stores the token, and raising through it ends the sessions bound to lower tokens.
func TestFenceCommands(t *testing.T) {
	bin := buildBinary(t)
	pg := testenv.StartPostgres(t)
	testenv.Migrate(t, pg.AdminURL())
	admin := testenv.Connect(t, pg.AdminURL())
	if _, err := testenv.Key.Raise(t.Context(), admin, "payroll", 2); err != nil {
		t.Fatal(err)
	}
	bound := testenv.Connect(t, pg.AdminURL())
	c, err := testenv.Key.BindCall("postgres", "billing", 5, bound.PgConn().PID())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bound.Exec(t.Context(), fence.BindQuery, c.Resource, c.Token, c.Proof); err != nil {
		t.Fatalf("bind: %v", err)
	}
	run := func(args ...string) string {
		t.Helper()
		out, err := exec.Command(bin, append([]string{"fence"}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("fence %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	lines := func(out string) [][]string {
		var ls [][]string
		for _, l := range strings.Split(out, "\n") {
			ls = append(ls, strings.Fields(l))
		}
		return ls
	}
	hasLine := func(out string, want ...string) bool {
		for _, f := range lines(out) {
			if len(f) >= len(want) && slices.Equal(f[:len(want)], want) {
				return true
			}
		}
		return false
	}

	if _, err := admin.Exec(t.Context(), "SELECT * FROM fence.lease_acquire('leased', 'worker-1', '1 hour')"); err != nil {
		t.Fatal(err)
	}
	out := run("show", "--database", pg.AdminURL())
	if !hasLine(out, "leased", "1", "worker-1,", "held,") {
		t.Fatalf("fence show does not list the lease:\n%s", out)
	}
	if !hasLine(out, "billing", "5") || !hasLine(out, "payroll", "2") {
		t.Fatalf("fence show does not list the stored tokens:\n%s", out)
	}
	if !strings.Contains(out, "live sessions") || !hasLine(out, "billing", "5", "1") {
		t.Fatalf("fence show does not list the bound session:\n%s", out)
	}

	out = run("reset", "--database", pg.AdminURL(), "--resource", "billing", "--token", "9")
	if !strings.Contains(out, `resource "billing": stored token set to 9`) {
		t.Fatalf("fence reset output:\n%s", out)
	}
	if _, err := bound.Exec(t.Context(), "SELECT 1"); err == nil {
		t.Fatal("the session bound to 5 survived a reset to 9")
	}
	out = run("show", "--database", pg.AdminURL())
	if !hasLine(out, "billing", "9") || hasLine(out, "billing", "5", "1") {
		t.Fatalf("fence show after the reset:\n%s", out)
	}
	// Lowering below a live session's token is refused without --force: it would go on next
	// to the holders of the lower tokens the reset admits again (a review had both commit).
	bound9 := testenv.Connect(t, pg.AdminURL())
	c9, err := testenv.Key.BindCall("postgres", "billing", 9, bound9.PgConn().PID())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bound9.Exec(t.Context(), fence.BindQuery, c9.Resource, c9.Token, c9.Proof); err != nil {
		t.Fatalf("bind to 9: %v", err)
	}
	if out, err := exec.Command(bin, "fence", "reset", "--database", pg.AdminURL(), "--resource", "billing", "--token", "1").CombinedOutput(); err == nil ||
		!strings.Contains(string(out), "1 live session(s) of resource \"billing\" are bound to tokens above it (up to 9)") {
		t.Fatalf("fence reset below a live session: %v\n%s", err, out)
	}
	bound9.Close(t.Context())
	// Lowering is allowed once they are gone (the way out of a LockIndex regression).
	eventually := time.Now().Add(10 * time.Second)
	for {
		out, err := exec.Command(bin, "fence", "reset", "--database", pg.AdminURL(), "--resource", "billing", "--token", "1").CombinedOutput()
		if err == nil {
			break
		}
		if time.Now().After(eventually) {
			t.Fatalf("fence reset after the session ended: %v\n%s", err, out)
		}
		time.Sleep(50 * time.Millisecond) // the backend exits after the client's Terminate
	}
	if out := run("show", "--database", pg.AdminURL()); !hasLine(out, "billing", "1") {
		t.Fatalf("fence show after lowering:\n%s", out)
	}

	// The history (migration 6): every raise and reset, oldest first, without the time.
	history := func(args ...string) [][]string {
		var h [][]string
		for _, f := range lines(run(append([]string{"history", "--database", pg.AdminURL()}, args...)...))[1:] {
			if len(f) > 6 {
				h = append(h, f[1:7])
			}
		}
		return h
	}
	want := [][]string{
		{"payroll", "2", "0", "raise", "-", "postgres@127.0.0.1"},
		{"billing", "5", "0", "raise", "-", "postgres@127.0.0.1"},
		{"leased", "1", "0", "raise", "worker-1", "postgres@127.0.0.1"},
		{"billing", "9", "5", "reset", "-", "postgres@127.0.0.1"},
		{"billing", "1", "9", "reset", "-", "postgres@127.0.0.1"},
	}
	if h := history(); !reflect.DeepEqual(h, want) {
		t.Fatalf("fence history:\n%v\nwant\n%v", h, want)
	}
	if h := history("--resource", "billing", "--limit", "2"); !reflect.DeepEqual(h, want[3:]) {
		t.Fatalf("fence history --resource billing --limit 2:\n%v\nwant\n%v", h, want[3:])
	}

	// Control characters in a holder (a lease holder named before migration 8 refused them)
	// reach the terminal escaped, never as they are: "\x1b[2J" would clear it.
	if _, err := admin.Exec(t.Context(), `INSERT INTO fence.history (resource, token, holder, reset, raised_at, role, pid)
		VALUES ('evil', 1, E'w\x1b[2J\x07\r\nforged', false, now(), 'postgres', 1)`); err != nil {
		t.Fatal(err)
	}
	out = run("history", "--database", pg.AdminURL(), "--resource", "evil")
	if strings.ContainsAny(out, "\x1b\x07\r") || strings.Contains(out, "\nforged") {
		t.Fatalf("fence history printed control characters: %q", out)
	}
	if !strings.Contains(out, `"w\x1b[2J\a\r\nforged"`) {
		t.Fatalf("fence history does not show the holder escaped: %q", out)
	}
	// A resource led by the PostgreSQL lease is not reset below its generation without
	// --force: a review's reset let a released holder's older generation bind again.
	for _, q := range []string{
		"SELECT * FROM fence.lease_release('leased', 'worker-1', 1)",
		"SELECT * FROM fence.lease_acquire('leased', 'worker-2', '1 hour')", // generation 2
	} {
		if _, err := admin.Exec(t.Context(), q); err != nil {
			t.Fatal(err)
		}
	}
	low := exec.Command(bin, "fence", "reset", "--database", pg.AdminURL(), "--resource", "leased", "--token", "1")
	if out, err := low.CombinedOutput(); err == nil || !strings.Contains(string(out), "led by the PostgreSQL lease, at generation 2") {
		t.Fatalf("fence reset below the lease generation: %v\n%s", err, out)
	}
	run("reset", "--database", pg.AdminURL(), "--resource", "leased", "--token", "1", "--force")
}
