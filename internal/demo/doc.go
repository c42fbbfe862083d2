// Package demo holds the automated tests of the billing-run demo: cmd/demo (what `make demo`
// runs), the billing program in cmd/billing, and docker-compose.yml.
//
// The tests build and run the demo program itself, with short timings, against real
// PostgreSQL, Consul, fenceproxy and billing processes, and assert its outcome from the
// summary it prints: every customer charged, no duplicate through fenceproxy, at least one
// stale write rejected, and duplicates without it (the negative control that shows the
// scenario can fail). They validate docker-compose.yml with docker-compose and check that its
// services run the same commands as the local demo.
//
// The package has no code of its own; it must not be imported.
package demo
