// Command bench is fenceproxy's benchmark (`make bench`, `make bench-quick`): it starts a
// throwaway PostgreSQL 15, PgBouncer (session mode) and fenceproxy through internal/testenv,
// drives them with the real pgbench in interleaved rounds, and prints one table of medians
// with the ratios against PgBouncer and against PostgreSQL directly. internal/bench holds
// what it measures and how; `go run ./cmd/bench --help` lists the settings.
//
// It fails when a server cannot start, a pgbench run fails, or a raise lets a stale session
// live or commit; the table is printed in every case where there is something to print.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/alecthomas/kong"

	"github.com/fenceproxy/fenceproxy/internal/bench"
)

type cli struct {
	bench.Config
	Quick bool `help:"The smoke test's size: 1 round of 1 s per run, no warm-up, scale 1, 100 idle sessions, raises of at most 10 stale sessions."`
}

func main() {
	var c cli
	kong.Parse(&c, kong.Description("fenceproxy's benchmark: fenceproxy fenced and unfenced against PgBouncer and PostgreSQL, one table."))
	if c.Quick {
		c.Config.Quick()
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	res, err := bench.Run(ctx, c.Config, os.Stdout)
	if res != nil {
		res.Report(os.Stdout)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "bench: %v\n", err)
		os.Exit(1)
	}
}
