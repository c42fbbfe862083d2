package testenv_test

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestConsul checks what the Consul tests rely on: private ports, state kept across Stop
// and Start, a 1 s minimum session TTL, and Pause making the agent unresponsive.
func TestConsul(t *testing.T) {
	t.Parallel()
	c := testenv.StartConsul(t)
	if !strings.HasPrefix(c.Addr, "127.0.0.1:") || c.Addr == "127.0.0.1:8500" {
		t.Errorf("Addr = %s, want a private loopback port", c.Addr)
	}
	if _, err := os.Stat(testenv.ConsulBinary(t)); err != nil {
		t.Fatal(err)
	}
	client := c.Client(t)
	self, err := client.Agent().Self()
	if err != nil {
		t.Fatal(err)
	}
	if v := self["Config"]["Version"]; v != testenv.ConsulVersion {
		t.Errorf("agent version %v, want %s", v, testenv.ConsulVersion)
	}

	id, _, err := client.Session().Create(&api.SessionEntry{TTL: "1s"}, nil)
	if err != nil {
		t.Fatalf("session with a 1 s TTL: %v", err)
	}
	if ok, _, err := client.KV().Acquire(&api.KVPair{Key: "k", Value: []byte("v"), Session: id}, nil); !ok || err != nil {
		t.Fatalf("acquire: %v, %v", ok, err)
	}
	before, _, err := client.KV().Get("k", nil)
	if err != nil || before == nil {
		t.Fatalf("get: %v, %v", before, err)
	}

	c.Stop(t)
	if _, _, err := client.KV().Get("k", nil); err == nil {
		t.Error("a stopped agent answered")
	}
	c.Start(t)
	after, _, err := client.KV().Get("k", &api.QueryOptions{RequireConsistent: true})
	if err != nil || after == nil || after.LockIndex != before.LockIndex || after.CreateIndex != before.CreateIndex {
		t.Errorf("after restart: %+v, %v; want %+v", after, err, before)
	}

	c.Pause(t)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if _, _, err := client.KV().Get("k", (&api.QueryOptions{}).WithContext(ctx)); err == nil {
		t.Error("a paused agent answered")
	}
	c.Resume(t)
	if _, _, err := client.KV().Get("k", nil); err != nil {
		t.Errorf("after resume: %v", err)
	}
}
