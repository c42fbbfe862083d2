package pglease_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/lease/pglease"
)

// An application leads billing through the PostgreSQL lease of the protected database: no
// Consul. (Not run: it needs a database with the fence schema.)
func ExampleStore() {
	store := &pglease.Store{URL: "postgres://billing_lock@127.0.0.1:5432/app", TTL: 10 * time.Second}
	l, err := store.Campaign(context.Background(), "billing")
	if err != nil {
		log.Fatal(err)
	}
	defer l.Release(context.Background()) //nolint:errcheck // it expires on its own otherwise

	// The generation is the token; the proxy's bind checks it against the lease row.
	url, _ := lease.FencedURL("postgres://app@127.0.0.1:7432/app", "billing", l.Token(), "")
	fmt.Println("leading with", url)

	<-l.Done() // lost (taken over, expired, database unreachable past the TTL): stop working
	fmt.Println("lost leadership:", l.Err())
}
