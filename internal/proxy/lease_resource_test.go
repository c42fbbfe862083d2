package proxy_test

import (
	"math"
	"strings"
	"testing"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
)

// TestLeaseResourceAdmitsNoTokenBeforeItsLease: a resource declared with --lease-resource
// refuses every token (ZF006, saying to run fenceproxy lock --store postgres) until its lease
// exists, where a bare resource trusted any: a newcomer's application role presented the
// largest bigint, and from then on no acquisition could succeed. Once the lease is acquired,
// its generation binds and /status shows the lease's holder; a bare resource is marked bare.
func TestLeaseResourceAdmitsNoTokenBeforeItsLease(t *testing.T) {
	t.Parallel()
	pg, admin := fencedDB(t)
	px := fencedProxy(t, pg, func(c *proxy.Config) {
		c.Resources = []string{"billing"}
		c.LeaseResources = []string{"payouts"}
	})
	url := func(token int64) string { return px.FenceURL("app", "postgres", "payouts", token, "password=app") }

	err := connectErr(url(math.MaxInt64))
	wantCode(t, err, fence.CodeNotHeld)
	pe := pgErrorOf(err)
	if pe == nil {
		t.Fatalf("%v: not the server's error", err)
	}
	for _, w := range []string{"fencing lease missing", `resource "payouts"`, "fenceproxy lock --store postgres --resource payouts"} {
		if !strings.Contains(pe.Message+" "+pe.Hint, w) {
			t.Errorf("%q not in %q, hint %q", w, pe.Message, pe.Hint)
		}
	}
	if n := count(t, admin, "SELECT count(*) FROM fence.tokens WHERE resource = 'payouts'"); n != 0 {
		t.Fatalf("a token was stored for the lease resource before its lease existed (%d rows)", n)
	}

	var g int64
	if err := admin.QueryRow(ctxT(t), "SELECT generation FROM fence.lease_acquire('payouts', 'payouts-runner', '60 seconds') WHERE acquired").Scan(&g); err != nil {
		t.Fatalf("the first acquisition after the refused token: %v", err)
	}
	conn := connect(t, url(g))
	mustExec(t, conn, "INSERT INTO items (tag, token) VALUES ('payouts', $1)", g)
	wantCode(t, connectErr(url(g+1)), fence.CodeNotIssued)

	// A bare resource still binds any token, and says so.
	connect(t, px.FenceURL("app", "postgres", "billing", 7, "password=app"))
	st := px.Server.Status(ctxT(t))
	got := map[string]proxy.ResourceStatus{}
	for _, r := range st.Resources {
		got[r.Resource] = r
	}
	if r := got["payouts"]; r.Store != lease.StorePostgres || r.Bare || r.Holder != "payouts-runner" || r.Token != g {
		t.Errorf("status of the lease resource: %+v, want store postgres, holder payouts-runner, token %d", r, g)
	}
	if r := got["billing"]; r.Store != proxy.AuthorityBare || !r.Bare {
		t.Errorf("status of the bare resource: %+v, want store bare, bare true", r)
	}
}

// TestResourceDeclaredWithOneAuthority: a resource's tokens come from one place; declaring it
// with two lock services is refused at start, with both named.
func TestResourceDeclaredWithOneAuthority(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  proxy.Config
		want string
	}{
		{"Consul key and lease", proxy.Config{Resources: []string{"payouts=locks/payouts"}, LeaseResources: []string{"payouts"}},
			`resource "payouts" is declared with a Consul key (locks/payouts) and --lease-resource`},
		{"lease and etcd", proxy.Config{LeaseResources: []string{"payouts"}, EtcdResources: []string{"payouts=locks/payouts"}},
			`resource "payouts" is declared with --lease-resource and --etcd-resource`},
		{"bad lease resource name", proxy.Config{LeaseResources: []string{"Payouts"}}, `lease-resource: resource "Payouts": the name must match`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.cfg.Upstream, tc.cfg.Key = "postgres://127.0.0.1:5432", fence.Key("0123456789abcdef")
			_, err := proxy.New(tc.cfg, proxy.Options{})
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want %q", err, tc.want)
			}
		})
	}
}
