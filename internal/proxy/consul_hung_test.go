package proxy_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/faulthop"
	"github.com/fenceproxy/fenceproxy/internal/fence"
	"github.com/fenceproxy/fenceproxy/internal/proxy"
)

// TestHungConsulRefusesQuickly: when Consul stops answering (its connections accepted, nothing
// sent back), a session start gets a fencing refusal (ZF007) naming Consul and what to do
// within --consul-answer-timeout, not 08P01 "login timeout" after the 15 s login timeout.
func TestHungConsulRefusesQuickly(t *testing.T) {
	t.Parallel()
	var hop *faulthop.Hop
	s := startConsulProxy(t, func(c *proxy.Config) {
		h, err := faulthop.Start("", c.ConsulAddr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = h.Close(context.Background()) })
		hop, c.ConsulAddr = h, h.Addr
		c.LoginTimeout = 15 * time.Second
	})
	_, tok := consulLock(t, s.client, "locks/billing")
	connect(t, s.url(tok)) // Consul answers: admitted

	hop.Stall(time.Minute)
	start := time.Now()
	err := connectErr(s.url(tok))
	took := time.Since(start)
	wantCode(t, err, fence.CodeUnavailable)
	if took > 8*time.Second {
		t.Errorf("refused after %s: want well under the 15 s login timeout", took)
	}
	pe := pgErrorOf(err)
	if pe == nil {
		t.Fatalf("%v: not the server's error", err)
	}
	for _, w := range []string{"Consul at " + hop.Addr, "no token is admitted without Consul's word"} {
		if !strings.Contains(pe.Message, w) {
			t.Errorf("%q not in %q", w, pe.Message)
		}
	}
	if strings.Contains(pe.Message, "login timeout") || !strings.Contains(pe.Hint, "--consul-down trust-database") {
		t.Errorf("message %q, hint %q: want Consul named and what to do", pe.Message, pe.Hint)
	}
}
