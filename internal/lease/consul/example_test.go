package consul_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/lease/consul"
)

// An application campaigns for the billing lock and writes with its token until it loses
// the lock. (Not run: it needs a Consul agent.)
func ExampleAcquire() {
	ctx := context.Background()
	client, err := consul.NewClient(consul.Config{Addr: "127.0.0.1:8500"})
	if err != nil {
		log.Fatal(err)
	}
	sess, err := consul.NewSession(ctx, client, consul.WithTTL(10*time.Second), consul.WithLockDelay(0))
	if err != nil {
		log.Fatal(err)
	}
	defer sess.Close(context.Background())

	lock, err := consul.Acquire(ctx, sess, "locks/billing")
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
	client, err := consul.NewClient(consul.Config{})
	if err != nil {
		log.Fatal(err)
	}
	w, err := consul.NewWatcher(client, consul.WatcherConfig{
		Keys: []string{"locks/billing"},
		OnChange: func(s consul.State) {
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
