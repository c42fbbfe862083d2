package proxy_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// consulLockJob is the job script the README shows for `consul lock -n 1 locks/billing
// ./job.sh`: it reads its token from the lock key its parent holds (consul lock's key
// is <prefix>/.lock) and writes through the proxy with it. Keep the two in step.
const consulLockJob = `#!/bin/sh
set -eu
key=locks/billing/.lock
info=$(consul kv get -detailed "$key")
field() { echo "$info" | awk -v f="$1" '$1 == f { print $2 }'; }
token=$(( $(field CreateIndex) * 16777216 + $(field LockIndex) ))
export PGOPTIONS="-c fence.resource=billing -c fence.token=$token -c fence.session=$(field Session)"
psql -X -q -v ON_ERROR_STOP=1 -c "INSERT INTO items (tag, token) VALUES ('$1', $token)"
`

// createLockProxy is a proxy in --consul-token-mode create-lock for the lock key.
func createLockProxy(t *testing.T, key string) *consulSetup {
	return startConsulProxy(t, func(c *proxy.Config) {
		c.Resources = []string{"billing=" + key}
		c.ConsulTokenMode = string(lease.TokenCreateLock)
	})
}

// TestConsulLockHandOvers: three runs in a row of the real `consul lock -n 1`, which
// deletes the key after each release (so LockIndex is 1 every time), each job reading its
// token the README's way and writing through the proxy: all three commit, with growing
// tokens, and no operator in between.
func TestConsulLockHandOvers(t *testing.T) {
	t.Parallel()
	s := createLockProxy(t, "locks/billing/.lock")
	bin := testenv.ConsulBinary(t)
	dir := t.TempDir()
	job := filepath.Join(dir, "job.sh")
	if err := os.WriteFile(job, []byte(consulLockJob), 0o755); err != nil {
		t.Fatal(err)
	}
	env := append(os.Environ(),
		"PATH="+filepath.Dir(bin)+string(os.PathListSeparator)+filepath.Dir(s.pg.Bin("psql"))+string(os.PathListSeparator)+os.Getenv("PATH"),
		"CONSUL_HTTP_ADDR="+s.consul.Addr,
		"PGHOST="+s.proxy.Host, "PGPORT="+strconv.Itoa(s.proxy.Port),
		"PGUSER=app", "PGPASSWORD=app", "PGDATABASE=postgres", "PGSSLMODE=disable",
	)
	var tokens []int64
	for i := 1; i <= 3; i++ {
		tag := fmt.Sprintf("run%d", i)
		ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
		cmd := exec.CommandContext(ctx, bin, "lock", "-n", "1", "locks/billing", job, tag)
		cmd.Env = env
		out, err := cmd.CombinedOutput()
		cancel()
		if err != nil {
			t.Fatalf("consul lock run %d: %v\n%s", i, err, out)
		}
		var tok int64
		if err := s.admin.QueryRow(ctxT(t), "SELECT token FROM items WHERE tag = $1", tag).Scan(&tok); err != nil {
			t.Fatalf("run %d committed nothing: %v\n%s", i, err, out)
		}
		if _, li := lease.DecodeToken(tok); li != 1 {
			t.Errorf("run %d: LockIndex %d, want 1 (consul lock re-creates the key)", i, li)
		}
		tokens = append(tokens, tok)
	}
	for i := 1; i < len(tokens); i++ {
		if tokens[i] <= tokens[i-1] {
			t.Errorf("tokens %v do not grow", tokens)
		}
	}
	var stored int64
	if err := s.admin.QueryRow(ctxT(t), "SELECT token FROM fence.tokens WHERE resource = 'billing'").Scan(&stored); err != nil || stored != tokens[2] {
		t.Errorf("stored token %d (%v), want the last run's %d", stored, err, tokens[2])
	}
}

// TestConsulAPILockDestroyHandOvers: an application with its own Consul client, api.Lock
// and Destroy after every release (the key is re-created each time), computing its token
// as the README shows: every holder's writes commit, the previous holder's are refused.
func TestConsulAPILockDestroyHandOvers(t *testing.T) {
	t.Parallel()
	const key = "locks/billing"
	s := createLockProxy(t, key)
	var prev string // the previous holder's URL
	for i := 1; i <= 3; i++ {
		sid, _, err := s.client.Session().Create(&api.SessionEntry{TTL: "30s", LockDelay: time.Millisecond, Behavior: api.SessionBehaviorRelease}, nil)
		if err != nil {
			t.Fatal(err)
		}
		lock, err := s.client.LockOpts(&api.LockOptions{Key: key, Session: sid})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := lock.Lock(nil); err != nil {
			t.Fatal(err)
		}
		// The README's way: a consistent read of the key, checked to show our session.
		pair, _, err := s.client.KV().Get(key, &api.QueryOptions{RequireConsistent: true})
		if err != nil || pair == nil || pair.Session != sid {
			t.Fatalf("read back: %+v %v", pair, err)
		}
		tok, err := lease.EncodeToken(pair.CreateIndex, pair.LockIndex)
		if err != nil {
			t.Fatal(err)
		}
		url := s.url(tok, "fence.session="+sid)
		eventually(t, 15*time.Second, fmt.Sprintf("holder %d admitted", i), func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			conn, err := pgx.Connect(ctx, url)
			if err != nil {
				return err
			}
			defer conn.Close(context.Background())
			_, err = conn.Exec(context.Background(), "INSERT INTO items (tag, token) VALUES ($1, $2)", fmt.Sprint("holder", i), tok)
			return err
		})
		if prev != "" {
			if err := connectErr(prev); err == nil {
				t.Errorf("holder %d's token admitted after holder %d took over", i-1, i)
			}
		}
		prev = url
		if err := lock.Unlock(); err != nil {
			t.Fatal(err)
		}
		if err := lock.Destroy(); err != nil {
			t.Fatal(err)
		}
		if _, err := s.client.Session().Destroy(sid, nil); err != nil {
			t.Fatal(err)
		}
	}
	if n := count(t, s.admin, "SELECT count(*)::int FROM items"); n != 3 {
		t.Errorf("%d rows committed, want 3", n)
	}
}
