package proxy_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceproxy/fenceproxy/internal/fence"
)

// A leader holding another Consul key than the one the proxy validates the resource against
// is refused with a hint that names the proxy's key, so it sees the mismatch at once.
func TestConsulRefusalNamesTheValidatedKey(t *testing.T) {
	s := startConsulProxy(t)
	first, _ := consulLock(t, s.client, "locks/billing")
	if _, err := s.client.Session().Destroy(first, nil); err != nil {
		t.Fatal(err)
	}
	_, tok := consulLock(t, s.client, "locks/billing") // LockIndex 2
	mustExec(t, connect(t, s.url(tok)), "SELECT 1")
	_, other := consulLock(t, s.client, "wrong/billing") // another key: LockIndex 1
	if other >= tok {
		t.Fatalf("the other key's token %d is not below %d", other, tok)
	}
	err := connectErr(s.url(other))
	wantStale(t, err)
	var pe *pgconn.PgError
	errors.As(err, &pe)
	if !strings.Contains(pe.Hint, `Consul key "locks/billing"`) {
		t.Fatalf("the hint does not name the validated key: %q", pe.Hint)
	}
}

// On every lock service's path, a holder refused at session start (its token below the one
// a newer holder was admitted with) is told, in the hint, what the proxy validates the
// resource against: the Consul key, the etcd election prefix, the ZooKeeper lock folder.
func TestRefusalNamesTheValidatedLock(t *testing.T) {
	s := sharedServers(t)
	names := map[string]string{"consul-lockindex": "Consul key", "consul-create-lock": "Consul key",
		"etcd": "etcd election prefix", "zookeeper": "ZooKeeper lock folder"}
	for _, path := range admissionPaths {
		if !path.guarded() {
			continue
		}
		t.Run(path.name, func(t *testing.T) {
			t.Parallel()
			want, ok := names[path.name]
			if !ok {
				t.Fatalf("no name of the lock for path %s", path.name)
			}
			resource := "named." + path.name
			ctx := ctxT(t)
			p := startPathProxy(t, s, path, []string{resource}, nil)
			old, err := holder(ctx, s, path, resource, "old", 1)
			if err != nil {
				t.Fatal(err)
			}
			old.release()
			newer, err := holder(ctx, s, path, resource, "newer", 2)
			if err != nil {
				t.Fatal(err)
			}
			defer newer.release()
			_, err = pgx.ConnectConfig(ctx, mustConfig(t, p.URL("app", "postgres"), old.options(resource)))
			var pe *pgconn.PgError
			if !errors.As(err, &pe) {
				t.Fatalf("the old holder's session: want a refusal, got %v", err)
			}
			switch pe.Code {
			case fence.CodeStale, fence.CodeHolderMismatch, fence.CodeMissing:
			default:
				t.Fatalf("the old holder's session: want ZF001, ZF009 or ZF003, got %s: %s", pe.Code, pe.Message)
			}
			if !strings.Contains(pe.Hint, "This proxy validates resource") || !strings.Contains(pe.Hint, want) {
				t.Fatalf("the hint does not name the %s: %q", want, pe.Hint)
			}
		})
	}
}
