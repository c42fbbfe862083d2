package proxy_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/lease/consul"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
	"github.com/fenceproxy/fenceproxy/internal/proxy/guards"
	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// aclToken creates a Consul ACL token with the given rules (none: a token without any right).
func aclToken(t *testing.T, mgmt *api.Client, name, rules string) string {
	t.Helper()
	tok := &api.ACLToken{Description: name}
	if rules != "" {
		pol, _, err := mgmt.ACL().PolicyCreate(&api.ACLPolicy{Name: name, Rules: rules}, nil)
		if err != nil {
			t.Fatal(err)
		}
		tok.Policies = []*api.ACLTokenPolicyLink{{ID: pol.ID}}
	}
	created, _, err := mgmt.ACL().TokenCreate(tok, nil)
	if err != nil {
		t.Fatal(err)
	}
	return created.SecretID
}

// TestConsulACLRefusalFailsFast: against a Consul with ACLs on (default deny), a proxy whose
// token may not read the lock key fails its start check at once with the cause (`fenceproxy
// serve` exits with it), instead of retrying until the start timeout and refusing every
// session; and `fenceproxy lock`'s campaign stops with lease.ErrRefused on a 403 (no right to
// create a session, or none to write the key) instead of retrying for ever.
func TestConsulACLRefusalFailsFast(t *testing.T) {
	t.Parallel()
	c := testenv.StartConsulACL(t)
	mgmt := c.Client(t)
	none := aclToken(t, mgmt, "nothing", "")
	sessionOnly := aclToken(t, mgmt, "session-only", `session_prefix "" { policy = "write" }`)
	reader := aclToken(t, mgmt, "reader", `key_prefix "locks/" { policy = "read" }`)

	check := func(token string) error {
		cfg := proxy.Config{Upstream: "postgres://127.0.0.1:1", Resources: []string{"billing=locks/billing"},
			ConsulAddr: c.Addr, ConsulToken: token, Key: testenv.Key}
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		g, err := guards.Consul(ctx, cfg, consul.GuardOptions{Registry: fence.NewRegistry(), Logger: zapNop()})
		if err != nil {
			t.Fatal(err)
		}
		err = g.Check(ctx)
		if err != nil && ctx.Err() != nil {
			t.Fatalf("the check retried until its deadline: %v", err)
		}
		return err
	}
	err := check(none)
	if err == nil || !strings.Contains(err.Error(), "--consul-token") || !strings.Contains(err.Error(), "403") {
		t.Fatalf("start check with a token without key read: %v, want a 403 naming --consul-token", err)
	}
	t.Logf("start check: %v", err)
	if err := check(reader); err != nil {
		t.Fatalf("start check with key read: %v", err)
	}

	for name, token := range map[string]string{"no session write": none, "no key write": sessionOnly} {
		client, err := api.NewClient(&api.Config{Address: c.Addr, Token: token})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		l, err := (&consul.Store{Client: client, Key: "locks/billing", Logger: zapNop()}).Campaign(ctx, "billing")
		if l != nil {
			l.Release(context.Background()) //nolint:errcheck
		}
		if !errors.Is(err, lease.ErrRefused) || ctx.Err() != nil {
			t.Errorf("%s: campaign = %v (deadline passed: %v), want lease.ErrRefused at once", name, err, ctx.Err() != nil)
		}
		t.Logf("%s: %v", name, err)
		cancel()
	}
}
