package lease_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/lease"
)

// An application campaigns for the billing lock and writes with its token until it loses
// the lock. (Not run: it needs a Consul agent.)
func ExampleAcquire() {
	ctx := context.Background()
	client, err := lease.NewClient(lease.ConsulConfig{Addr: "127.0.0.1:8500"})
	if err != nil {
		log.Fatal(err)
	}
	sess, err := lease.NewSession(ctx, client, lease.WithTTL(10*time.Second), lease.WithLockDelay(0))
	if err != nil {
		log.Fatal(err)
	}
	defer sess.Close(context.Background())

	lock, err := lease.Acquire(ctx, sess, "locks/billing")
	if err != nil {
		log.Fatal(err)
	}
	// Connect through the proxy with the token; the database refuses this leader's
	// writes as soon as a later leader's token is admitted.
	url, _ := lease.FencedURL("postgres://app@127.0.0.1:7432/app", "billing", lock.Token(), sess.ID())
	fmt.Println("leading with", url)

	<-lock.Done() // lost: stop working
	fmt.Println("lost leadership:", lock.Err())
}

// The proxy watches the lock keys of its resources and checks tokens at session start.
// (Not run: it needs a Consul agent.)
func ExampleWatcher() {
	ctx := context.Background()
	client, err := lease.NewClient(lease.ConsulConfig{})
	if err != nil {
		log.Fatal(err)
	}
	w, err := lease.NewWatcher(client, lease.WatcherConfig{
		Keys: []string{"locks/billing"},
		OnChange: func(s lease.State) {
			switch tok, err := s.Token(); {
			case errors.Is(err, lease.ErrRegression):
				fmt.Println("fail closed:", err)
			case err == nil:
				fmt.Println("new leader, raise token", tok)
			}
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	go w.Run(ctx) //nolint:errcheck // returns only when ctx ends

	_, err = w.Validate(ctx, "locks/billing", 34, "")
	switch {
	case errors.Is(err, lease.ErrStale): // ZF001
	case errors.Is(err, lease.ErrNotIssued): // ZF002
	case errors.Is(err, lease.ErrNotHeld): // ZF006
	case errors.Is(err, lease.ErrUnavailable): // ZF007, regressions included
	case errors.Is(err, lease.ErrSessionMismatch): // ZF009
	}
}

// RunLocked is what `fenceproxy lock --resource billing -- ./billing` does.
// (Not run: it needs a Consul agent.)
func ExampleRunLocked() {
	client, err := lease.NewClient(lease.ConsulConfig{})
	if err != nil {
		log.Fatal(err)
	}
	err = lease.RunLocked(context.Background(), lease.RunConfig{
		Store:       &lease.ConsulStore{Client: client},
		Resource:    "billing",
		Command:     []string{"./billing"},
		DatabaseURL: "postgres://app@127.0.0.1:7432/app",
		OnLost:      lease.OnLostRetry,
	})
	var exit *lease.ExitError
	if errors.As(err, &exit) {
		fmt.Println("billing exited with status", exit.Code)
	}
}

// An application leads billing through the PostgreSQL lease of the protected database: no
// Consul. (Not run: it needs a database with the fence schema.)
func ExamplePostgresStore() {
	store := &lease.PostgresStore{URL: "postgres://billing_lock@127.0.0.1:5432/app", TTL: 10 * time.Second}
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
