package lease_test

import (
	"context"
	"errors"
	"fmt"
	"log"

	"github.com/fenceproxy/fenceproxy/internal/lease"
	"github.com/fenceproxy/fenceproxy/internal/lease/consul"
)

// RunLocked is what `fenceproxy lock --resource billing -- ./billing` does.
// (Not run: it needs a Consul agent.)
func ExampleRunLocked() {
	client, err := consul.NewClient(consul.Config{})
	if err != nil {
		log.Fatal(err)
	}
	err = lease.RunLocked(context.Background(), lease.RunConfig{
		Store:       &consul.Store{Client: client},
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
