package proxy_test

import (
	"net"
	"reflect"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
)

// TestDefaultListenCollidesWithNoCommonPort: without --listen the proxy listens on 7432, a port
// no common PostgreSQL tool takes by default (PgBouncer, PgDog, pgcat and Odyssey: 6432;
// Supavisor: 6543; PostgreSQL and Debian's second cluster: 5432, 5433), and the flag's
// documented default says the same.
func TestDefaultListenCollidesWithNoCommonPort(t *testing.T) {
	srv, err := proxy.New(proxy.Config{Upstream: "postgres://127.0.0.1:5432"}, proxy.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if srv.Addr() != proxy.DefaultListen {
		t.Fatalf("default listen %q, want %q", srv.Addr(), proxy.DefaultListen)
	}
	_, port, err := net.SplitHostPort(srv.Addr())
	if err != nil {
		t.Fatal(err)
	}
	for _, taken := range []string{"5432", "5433", "6432", "6543"} {
		if port == taken {
			t.Errorf("default port %s is a common tool's", port)
		}
	}
	f, _ := reflect.TypeOf(proxy.Config{}).FieldByName("Listen")
	if tag := f.Tag.Get("default"); tag != proxy.DefaultListen {
		t.Errorf("--listen's default tag %q, want %q", tag, proxy.DefaultListen)
	}
}
