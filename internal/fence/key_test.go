package fence_test

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestKeyDatabase runs the Go side of the proxy key against the database's: the proof Key
// computes is the one fence.proof expects, SetKey decides which key the database accepts, and
// Key.Raise ends the backends bound to lower tokens before it returns.
func TestKeyDatabase(t *testing.T) {
	c := startSchemaCluster(t)

	t.Run("Proof equals fence.proof", func(t *testing.T) {
		// A database name with a space and non-ASCII letters: the proof covers it as UTF-8.
		const db = "Proof Ü-db"
		c.pg.Exec(t, `CREATE DATABASE "Proof Ü-db"`)
		url := c.pg.URL(testenv.AdminUser, db)
		if _, err := fence.Migrate(t.Context(), url); err != nil {
			t.Fatal(err)
		}
		owner := schemaConnect(t, url)
		var current string
		if err := owner.QueryRow(t.Context(), "SELECT current_database()").Scan(&current); err != nil || current != db {
			t.Fatalf("current_database() = %q, %v", current, err)
		}
		var none *string
		if err := owner.QueryRow(t.Context(), "SELECT fence.proof('bind', 'billing', 1, 1)").Scan(&none); err != nil || none != nil {
			t.Fatalf("fence.proof without a stored key = %v, %v; want NULL", none, err)
		}

		random, err := fence.GenerateKey()
		if err != nil {
			t.Fatal(err)
		}
		keys := map[string]fence.Key{
			"16 bytes":                    fixedKey,
			"random":                      random,
			"longer than a SHA-256 block": bytes.Repeat([]byte("0123456789"), 10),
			"NUL and high bytes":          append(bytes.Repeat([]byte{0}, 8), bytes.Repeat([]byte{0xff}, 8)...),
		}
		inputs := []struct {
			kind     string
			resource string
			token    int64
			pid      uint32
		}{
			{"bind", "billing", 34, 4242},
			{"raise", "billing", 34, 4242},
			{"bind", "eu-west.billing_2", 1, 1},
			{"raise", "a" + strings.Repeat("z", 62), 1<<63 - 1, 1<<31 - 1},
		}
		for name, key := range keys {
			t.Run(name, func(t *testing.T) {
				if err := fence.SetKey(t.Context(), url, key); err != nil {
					t.Fatalf("SetKey: %v", err)
				}
				for _, in := range inputs {
					var got string
					err := owner.QueryRow(t.Context(), "SELECT fence.proof($1, $2, $3, $4)",
						in.kind, in.resource, in.token, int32(in.pid)).Scan(&got)
					if err != nil {
						t.Fatalf("fence.proof: %v", err)
					}
					if want := key.Proof(in.kind, db, in.resource, in.token, in.pid); got != want {
						t.Errorf("%+v: fence.proof = %s, Key.Proof = %s", in, got, want)
					}
				}
				// And the backend's own pid, as fence.verify computes it.
				var got string
				pid := owner.PgConn().PID()
				if err := owner.QueryRow(t.Context(), "SELECT fence.proof('bind', 'billing', 7, pg_backend_pid())").Scan(&got); err != nil {
					t.Fatal(err)
				}
				if want := key.Proof("bind", db, "billing", 7, pid); got != want {
					t.Errorf("proof for the backend's pid %d: fence.proof = %s, Key.Proof = %s", pid, got, want)
				}
			})
		}
		// The Go side proves itself to the database in the bind, too.
		if err := fence.SetKey(t.Context(), url, random); err != nil {
			t.Fatal(err)
		}
		if got, err := bind(t.Context(), schemaConnect(t, url), random, "billing", 3); err != nil || got != 3 {
			t.Fatalf("bind in %q = %d, %v", db, got, err)
		}
	})

	t.Run("SetKey", func(t *testing.T) {
		url := c.createDB(t)
		if err := fence.SetKey(t.Context(), url, testenv.Key); err == nil {
			t.Fatal("SetKey succeeded on a database without the fence schema")
		}
		if _, err := fence.Migrate(t.Context(), url); err != nil {
			t.Fatal(err)
		}
		k1, k2 := fence.Key(strings.Repeat("1", 32)), fence.Key(strings.Repeat("2", 32))
		owner := schemaConnect(t, url)

		_, err := bind(t.Context(), schemaConnect(t, url), k1, "billing", 1)
		wantPgError(t, err, fence.CodeUnavailable, "fencing unavailable: no proxy key is stored")

		for _, bad := range []fence.Key{nil, fence.Key("15 bytes, short")} {
			if err := fence.SetKey(t.Context(), url, bad); err == nil {
				t.Errorf("SetKey(%d bytes) succeeded", len(bad))
			}
		}
		if err := fence.SetKey(t.Context(), "postgres://%zz", k1); err == nil {
			t.Error("SetKey with a bad URL succeeded")
		}
		// The table refuses short keys by itself too.
		_, err = owner.Exec(t.Context(), "INSERT INTO fence.keys (id, key) VALUES (1, '\\x00')")
		wantPgError(t, err, "23514", `new row for relation "keys" violates check constraint "keys_long_enough"`)

		stored := func() []byte {
			t.Helper()
			var k []byte
			if err := owner.QueryRow(t.Context(), "SELECT key FROM fence.keys").Scan(&k); err != nil {
				t.Fatalf("read the stored key: %v", err)
			}
			return k
		}
		steps := []struct {
			name      string
			set       fence.Key
			good, bad fence.Key
		}{
			{"first key", k1, k1, k2},
			{"same key again", k1, k1, k2},
			{"another key replaces it", k2, k2, k1},
		}
		var token int64
		for _, s := range steps {
			t.Run(s.name, func(t *testing.T) {
				if err := fence.SetKey(t.Context(), url, s.set); err != nil {
					t.Fatalf("SetKey: %v", err)
				}
				if !bytes.Equal(stored(), s.set) || countRows(t, owner, "fence.keys") != 1 {
					t.Fatalf("fence.keys holds %q (%d rows), want %q alone", stored(), countRows(t, owner, "fence.keys"), s.set)
				}
				token++
				if got, err := bind(t.Context(), schemaConnect(t, url), s.good, "billing", token); err != nil || got != token {
					t.Fatalf("bind with the stored key = %d, %v; want %d", got, err, token)
				}
				wrong := schemaConnect(t, url)
				_, err := bind(t.Context(), wrong, s.bad, "billing", token)
				wantPgError(t, err, fence.CodeProof, `fencing proof invalid: fence.bind('billing', `)
				if res, _ := binding(t, owner, wrong.PgConn().PID()); res != "" {
					t.Fatal("a bind with another key bound its backend")
				}
				_, err = s.bad.Raise(t.Context(), owner, "billing", token+100)
				wantPgError(t, err, fence.CodeProof, `fencing proof invalid: fence.raise('billing', `)
				if got := storedToken(t, owner, "billing"); got == nil || *got != token {
					t.Fatalf("a raise with another key moved the token to %v", got)
				}
			})
		}
		// The same key again does not rewrite the row.
		var before, after time.Time
		if err := owner.QueryRow(t.Context(), "SELECT updated_at FROM fence.keys").Scan(&before); err != nil {
			t.Fatal(err)
		}
		if err := fence.SetKey(t.Context(), url, k2); err != nil {
			t.Fatal(err)
		}
		if err := owner.QueryRow(t.Context(), "SELECT updated_at FROM fence.keys").Scan(&after); err != nil {
			t.Fatal(err)
		}
		if !after.Equal(before) {
			t.Errorf("SetKey of the stored key rewrote it (updated_at %v, was %v)", after, before)
		}
	})

	t.Run("Raise ends the backends bound to lower tokens", func(t *testing.T) {
		url := c.migratedDB(t)
		control := schemaConnect(t, url)
		schemaExec(t, control, "CREATE TABLE charges (id serial PRIMARY KEY, who text NOT NULL)")
		schemaExec(t, control, "GRANT ALL ON TABLE charges, charges_id_seq TO PUBLIC")
		c.pg.Exec(t, "DO $$ BEGIN CREATE ROLE raise_app LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
		appURL := c.pg.URL("raise_app", dbName(t, url))

		// Bound the way the proxy binds: BindSQL's text for the backend's pid and database.
		bindApp := func(resource string, token int64) *pgx.Conn {
			t.Helper()
			conn := schemaConnect(t, appURL)
			q, err := testenv.Key.BindSQL(dbName(t, url), resource, token, conn.PgConn().PID())
			if err != nil {
				t.Fatal(err)
			}
			var stored int64
			if err := conn.QueryRow(t.Context(), q).Scan(&stored); err != nil || stored != token {
				t.Fatalf("bind(%s, %d) = %d, %v", resource, token, stored, err)
			}
			return conn
		}
		// An old leader idle in a transaction with an uncommitted insert, and one in autocommit.
		inTx := bindApp("billing", 33)
		schemaExec(t, inTx, "BEGIN")
		schemaExec(t, inTx, "INSERT INTO charges (who) VALUES ('stale, uncommitted')")
		idle := bindApp("billing", 33)
		otherResource := bindApp("payroll", 1)

		began := time.Now()
		stored, err := testenv.Key.Raise(t.Context(), control, "billing", 34)
		if err != nil || stored != 34 {
			t.Fatalf("Raise(34) = %d, %v", stored, err)
		}
		t.Logf("the raise ended 2 backends in %v", time.Since(began))
		// Gone before the raise returned, not soon after.
		for name, conn := range map[string]*pgx.Conn{"in a transaction": inTx, "idle": idle} {
			if alive(t, control, conn.PgConn().PID()) {
				t.Errorf("the backend bound to 33 %s is alive after the raise to 34", name)
			}
		}
		wantEnded(t, inTx)
		wantEnded(t, idle)
		if n := countRows(t, control, "charges"); n != 0 {
			t.Fatalf("the ended transaction's insert is visible: %d rows", n)
		}
		if !alive(t, control, otherResource.PgConn().PID()) {
			t.Fatal("a backend bound to another resource was ended")
		}
		if got := storedToken(t, control, "billing"); got == nil || *got != 34 {
			t.Fatalf("stored token %v, want 34", got)
		}
		if n := countRows(t, control, "fence.bindings WHERE resource = 'billing'"); n != 0 {
			t.Fatalf("%d bindings of the ended backends are left", n)
		}

		current := bindApp("billing", 34)
		higher := bindApp("billing", 40) // raises to 40 itself: ends current
		if alive(t, control, current.PgConn().PID()) {
			t.Fatal("the backend bound to 34 survived a bind of 40")
		}
		for _, tt := range []struct {
			name  string
			token int64
		}{{"equal", 40}, {"lower", 35}} {
			stored, err := testenv.Key.Raise(t.Context(), control, "billing", tt.token)
			if err != nil || stored != 40 {
				t.Fatalf("%s Raise(%d) = %d, %v; want 40 stored", tt.name, tt.token, stored, err)
			}
			if !alive(t, control, higher.PgConn().PID()) {
				t.Fatalf("an %s raise ended the backend bound to 40", tt.name)
			}
		}
		schemaExec(t, higher, "INSERT INTO charges (who) VALUES ('current leader')")

		// Malformed arguments never reach the database.
		for _, tt := range []struct {
			resource string
			token    int64
		}{{"Bad", 50}, {"billing", 0}} {
			if _, err := testenv.Key.Raise(t.Context(), control, tt.resource, tt.token); !errors.Is(err, fence.ErrMalformed) {
				t.Errorf("Raise(%q, %d) = %v, want ZF004", tt.resource, tt.token, err)
			}
		}
		if got := storedToken(t, control, "billing"); got == nil || *got != 40 {
			t.Fatalf("stored token %v, want 40", got)
		}
	})

	t.Run("Raise whatever the connection's defaults", func(t *testing.T) {
		url := c.migratedDB(t)
		for i, set := range []string{
			"SET default_transaction_isolation = 'serializable'",
			"SET default_transaction_isolation = 'repeatable read'",
			"SET default_transaction_read_only = on",
		} {
			t.Run(set, func(t *testing.T) {
				conn := schemaConnect(t, url)
				schemaExec(t, conn, set)
				resource := fmt.Sprintf("defaults-%d", i)
				if got, err := testenv.Key.Raise(t.Context(), conn, resource, 5); err != nil || got != 5 {
					t.Fatalf("Raise = %d, %v; want 5", got, err)
				}
				// The raw statement, in the session's default transaction, is refused.
				q, err := testenv.Key.RaiseSQL(dbName(t, url), resource, 6, conn.PgConn().PID())
				if err != nil {
					t.Fatal(err)
				}
				if _, err := conn.Exec(t.Context(), q); err == nil {
					t.Fatalf("the raise ran under %q", set)
				}
			})
		}
	})

	t.Run("Raise on a connection without a database name", func(t *testing.T) {
		// PostgreSQL's default database is the user's name: the proof must name it.
		testenv.Migrate(t, c.pg.AdminURL()) // database postgres, user postgres
		conn := testenv.Connect(t, c.pg.AdminURL(), func(cfg *pgx.ConnConfig) { cfg.Database = "" })
		if got, err := testenv.Key.Raise(t.Context(), conn, "no-database", 3); err != nil || got != 3 {
			t.Fatalf("Raise = %d, %v; want 3", got, err)
		}
	})
}
