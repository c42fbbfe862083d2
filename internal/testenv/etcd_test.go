package testenv_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// TestEtcd checks what the etcd tests rely on: a private port, data kept across Stop and
// Start, and Restore moving revisions back.
func TestEtcd(t *testing.T) {
	t.Parallel()
	e := testenv.StartEtcd(t)
	if !strings.HasPrefix(e.Endpoint, "http://127.0.0.1:") || strings.HasSuffix(e.Endpoint, ":2379") {
		t.Errorf("Endpoint = %s, want a private loopback port", e.Endpoint)
	}
	cli := e.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	put, err := cli.Put(ctx, "k", "v1")
	if err != nil {
		t.Fatal(err)
	}
	backup := e.Backup(t)
	if _, err := cli.Put(ctx, "k", "v2"); err != nil {
		t.Fatalf("put after Backup: %v", err)
	}

	e.Stop(t)
	short, cancelShort := context.WithTimeout(ctx, 300*time.Millisecond)
	if _, err := cli.Get(short, "k"); err == nil {
		t.Error("a stopped server answered")
	}
	cancelShort()
	e.Start(t)
	got, err := cli.Get(ctx, "k")
	if err != nil || len(got.Kvs) != 1 || string(got.Kvs[0].Value) != "v2" {
		t.Fatalf("after restart: %v, %v; want v2", got, err)
	}

	e.Restore(t, backup)
	got, err = cli.Get(ctx, "k")
	if err != nil || len(got.Kvs) != 1 || string(got.Kvs[0].Value) != "v1" {
		t.Fatalf("after restore: %v, %v; want v1", got, err)
	}
	if got.Header.Revision != put.Header.Revision {
		t.Errorf("revision after restore %d, want %d (the backup's)", got.Header.Revision, put.Header.Revision)
	}
}
