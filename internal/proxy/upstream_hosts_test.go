package proxy_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
	"github.com/fenceproxy/fenceproxy/internal/wire"
)

// TestUpstreamMultiHostSyntax: --upstream takes libpq's multi-host URL and keyword forms and
// target_session_attrs.
func TestUpstreamMultiHostSyntax(t *testing.T) {
	for _, tc := range []struct {
		raw   string
		hosts []string
		attrs string
	}{
		{"postgres://h1:5432,h2:5433/?target_session_attrs=read-write", []string{"h1:5432", "h2:5433"}, "read-write"},
		{"postgresql://h1,h2:5433", []string{"h1:5432", "h2:5433"}, "any"},
		{"postgres://[::1]:6000,db.example/", []string{"[::1]:6000", "db.example:5432"}, "any"},
		{"postgres://h1,h2/?port=6000", []string{"h1:6000", "h2:6000"}, "any"},
		{"postgres:///?host=/var/run/postgresql,h2&port=5432,5433&target_session_attrs=prefer-standby", []string{"/var/run/postgresql/.s.PGSQL.5432", "h2:5433"}, "prefer-standby"},
		{"host=h1,h2 port=5432,5433 target_session_attrs=primary", []string{"h1:5432", "h2:5433"}, "primary"},
		{"host='h1,h2'  port=6000 sslmode=disable target_session_attrs=standby", []string{"h1:6000", "h2:6000"}, "standby"},
		{"host=h1 target_session_attrs=read-only", []string{"h1:5432"}, "read-only"},
		{"postgres://127.0.0.1:5432", []string{"127.0.0.1:5432"}, "any"},
	} {
		hosts, attrs, err := proxy.UpstreamHosts(tc.raw)
		if err != nil {
			t.Errorf("%s: %v", tc.raw, err)
			continue
		}
		if !slices.Equal(hosts, tc.hosts) || attrs != tc.attrs {
			t.Errorf("%s: hosts %q attrs %s, want %q %s", tc.raw, hosts, attrs, tc.hosts, tc.attrs)
		}
	}
}

// TestBadMultiHostUpstreamFailsAtStart: a multi-host --upstream that cannot work is refused
// when the proxy starts, with its cause (it used to start and fail every session with a DNS
// error for "h1:5432,h2").
func TestBadMultiHostUpstreamFailsAtStart(t *testing.T) {
	for _, tc := range []struct {
		raw, want string
	}{
		{"postgres://h1,h2,h3/?port=5432,5433", "2 ports for 3 hosts"},
		{"postgres://h1:5432,h2:x/", `bad port "x"`},
		{"postgres://h1,h2/?target_session_attrs=master", `target_session_attrs "master"`},
		{"postgres://app@h1,h2/", "user and database come from each client"},
		{"postgres://h1,h2/app", "user and database come from each client"},
		{"host=h1,h2 dbname=app", "user and database come from each client"},
		{"host=h1,h2 connect_timeout=3", `"connect_timeout" is not a setting fenceproxy uses`},
		{"host='h1,h2 port=5432", "unterminated quoted value"},
		{"h1:5432,h2:5432", "is not a postgres:// URL"},
	} {
		_, err := proxy.New(proxy.Config{Upstream: tc.raw}, proxy.Options{})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.raw, err, tc.want)
		}
	}
	// Fenced sessions with several hosts need the control database, where the proxy learns
	// which host is the primary before a session authenticates.
	_, err := proxy.New(proxy.Config{Upstream: "postgres://h1,h2/", Resources: []string{"billing"}, Key: testenv.Key}, proxy.Options{})
	if err == nil || !strings.Contains(err.Error(), "needs control-database") {
		t.Errorf("two hosts, a resource, no control database: %v", err)
	}
}

// TestUpstreamNamesResolvedAtEverySession: the upstream's host name is resolved at every
// session start, never cached: a name moved to another address is followed by the next
// session (DNS-based failover).
func TestUpstreamNamesResolvedAtEverySession(t *testing.T) {
	pg := testenv.StartPostgres(t)
	var addr atomic.Value
	addr.Store("127.0.0.1") // 127.0.0.2 is loopback too, where the server does not listen
	var lookups atomic.Int32
	px := testenv.StartProxy(t, pg, proxy.Config{Upstream: fmt.Sprintf("postgres://db.fenceproxy.test:%d", pg.Port), Unfenced: proxy.UnfencedAllow},
		testenv.ProxyOptions{LookupHost: func(_ context.Context, host string) ([]string, error) {
			if host != "db.fenceproxy.test" {
				return nil, errors.New("no such host")
			}
			lookups.Add(1)
			return []string{addr.Load().(string)}, nil
		}})
	url := px.URLWithPassword(testenv.AdminUser, testenv.AdminPassword, "postgres")

	connect(t, url).Close(ctxT(t))
	addr.Store("127.0.0.2")
	err := connectErr(url)
	wantCode(t, err, wire.CodeConnectionFailure)
	if !strings.Contains(err.Error(), "127.0.0.2") {
		t.Fatalf("the session did not dial the name's new address: %v", err)
	}
	addr.Store("127.0.0.1")
	connect(t, url).Close(ctxT(t))
	if n := lookups.Load(); n != 3 {
		t.Fatalf("%d look-ups for 3 sessions, want one each", n)
	}
}
