package proxy_test

import (
	"strings"
	"testing"
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
	pe := pgErrorOf(err)
	if !strings.Contains(pe.Hint, `Consul key "locks/billing"`) {
		t.Fatalf("the hint does not name the validated key: %q", pe.Hint)
	}
}
