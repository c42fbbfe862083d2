// Command demo is the billing-run demo, as real processes on loopback (`make demo` runs it).
//
// Three replicas of a billing scheduler (cmd/billing) elect a leader through a Consul lock
// (--store consul, the default), the PostgreSQL lease of the protected database itself
// (--store postgres, `make demo STORE=postgres`: nothing but PostgreSQL, no Consul) or an
// etcd election (--store etcd, `make demo STORE=etcd`: etcd's server runs in the demo's
// process), each under `fenceproxy lock`. The leader charges customers one transaction at a time. In the
// middle of a charge the demo freezes the leader (SIGSTOP to its process groups, like a GC
// pause or a VM freeze) for longer than its lease; the store hands the lease to another
// replica, which resumes the run; then the demo wakes the old leader (SIGCONT), which still
// believes it leads and tries to finish its charge.
//
//  1. through fenceproxy: the new leader's token is raised (by the proxy when Consul shows
//     the new holder, by the acquisition itself on the PostgreSQL lease), which ends the old
//     leader's session (its uncommitted charge rolls back); the old leader's next statement
//     is refused (SQLSTATE ZF001), every customer is charged exactly once;
//  2. the same scenario straight to PostgreSQL: the old leader's charge commits, a customer
//     is charged twice.
//
// It prints a timeline of each run, then a summary with the lines
//
//	customers charged: N
//	duplicates: N                (must be 0)
//	stale writes rejected: N     (at least 1)
//
// and exits non-zero if fencing let a duplicate through, rejected nothing, or a run did not
// complete. The servers come from internal/testenv (the tests' own), and every process and
// folder the demo starts is removed when it ends, whatever happens. PostgreSQL runs as the
// `postgres` OS user when the demo runs as root. Run it from the source tree (it builds
// fenceproxy and billing, and reads demo/schema.sql and demo/report.sql); `make deps`
// installs what it needs.
//
// Lines starting with "demo: service NAME:" show the exact command each service runs; the
// docker-compose.yml services run the same ones (internal/demo's test checks it).
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/alecthomas/kong"
)

// config is the demo's settings: flags, or the DEMO_* variables of the former script.
type config struct {
	Store         string        `help:"Where the replicas win their lease: consul, postgres (the PostgreSQL lease: nothing else needed) or etcd (an etcd server in the demo's process)." enum:"consul,postgres,etcd" default:"consul" env:"DEMO_STORE"`
	Customers     int           `help:"Customers to charge in each run." default:"30" env:"DEMO_CUSTOMERS"`
	TxDelay       time.Duration `help:"Pause inside each charge's transaction (BILLING_TX_DELAY)." default:"300ms" env:"DEMO_TX_DELAY"`
	StepDelay     time.Duration `help:"Pause between two charges (BILLING_STEP_DELAY)." default:"200ms" env:"DEMO_STEP_DELAY"`
	TTL           time.Duration `help:"Lease TTL (Consul may take up to 2 x TTL to hand the lock over; the PostgreSQL lease expires TTL after its last renewal)." default:"10s" env:"DEMO_TTL"`
	BeforeFreeze  int           `help:"Charges by the first leader before it is frozen." default:"3" name:"charges-before-freeze" env:"DEMO_CHARGES_BEFORE_FREEZE"`
	AfterTakeover int           `help:"Charges by the new leader before the old one is woken." default:"3" name:"charges-after-takeover" env:"DEMO_CHARGES_AFTER_TAKEOVER"`
	Timeout       time.Duration `help:"Time allowed for each wait (a takeover, the end of a run)." default:"120s" env:"DEMO_TIMEOUT"`
	Unfenced      bool          `help:"Also run the scenario straight to PostgreSQL (--no-unfenced: skip it)." default:"true" negatable:"" env:"DEMO_UNFENCED"`
	BinDir        string        `help:"Where fenceproxy and billing are built." default:"bin" type:"path" env:"DEMO_BIN_DIR"`
	Keep          bool          `help:"Keep the temporary folder (the logs) and print its path." env:"DEMO_KEEP"`
}

func main() {
	var c config
	parser, err := kong.New(&c, kong.Name("demo"),
		kong.Description("The fenceproxy billing demo: a frozen leader wakes after a takeover, with and without fencing."),
		kong.UsageOnError())
	if err == nil {
		_, err = parser.Parse(os.Args[1:])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err = run(ctx, c)
	interrupted := ctx.Err() != nil
	stop()
	if interrupted {
		// Everything the demo started is stopped and removed by now.
		fmt.Println("demo: interrupted")
		os.Exit(130)
	}
	if err != nil {
		fmt.Printf("demo: FAILED: %v\n", err)
		os.Exit(1)
	}
}

func say(format string, args ...any) { fmt.Printf("demo: "+format+"\n", args...) }

// run starts the servers, runs the scenario with and without fencing, prints the summary
// and returns an error when the fenced run failed its promise.
func run(ctx context.Context, c config) (err error) {
	started := time.Now()
	if c.BinDir, err = filepath.Abs(c.BinDir); err != nil {
		return err
	}
	d, err := setup(ctx, c)
	if d != nil {
		defer func() { err = errors.Join(err, d.close()) }()
	}
	if err != nil {
		return err
	}

	say("run 1: the replicas reach PostgreSQL through fenceproxy")
	fenced, err := d.scenario(ctx, "fenced", "billing", d.proxyURL("billing"), "locks/billing")
	if err != nil {
		return err
	}
	var direct *outcome
	if c.Unfenced {
		fmt.Println()
		say("run 2: the same scenario, the replicas connected straight to PostgreSQL (no fencing)")
		if direct, err = d.scenario(ctx, "direct", "billing_direct", d.directURL("billing_direct"), "locks/billing-direct"); err != nil {
			return err
		}
	}

	fmt.Printf("\n== summary ==\n")
	fmt.Printf("lease store: %s\n", c.Store)
	fmt.Printf("with fenceproxy (%d customers):\n", fenced.customers)
	fmt.Printf("customers charged: %d\n", fenced.charged)
	fmt.Printf("duplicates: %d\n", fenced.duplicates)
	fmt.Printf("stale writes rejected: %d\n", fenced.rejected)
	if direct != nil {
		fmt.Printf("straight to PostgreSQL, without fencing (%d customers):\n", direct.customers)
		fmt.Printf("customers charged without fencing: %d\n", direct.charged)
		fmt.Printf("duplicates without fencing: %d\n", direct.duplicates)
		fmt.Printf("stale writes rejected without fencing: %d\n", direct.rejected)
	}
	fmt.Printf("wall time: %ds\n", int(time.Since(started).Seconds()))

	var failed []error
	if fenced.duplicates != 0 {
		failed = append(failed, fmt.Errorf("fenceproxy let %d duplicate charge(s) through", fenced.duplicates))
	}
	if fenced.rejected < 1 {
		failed = append(failed, errors.New("no stale write was rejected"))
	}
	if fenced.pending != 0 {
		failed = append(failed, fmt.Errorf("the fenced run did not complete: %d customers pending", fenced.pending))
	}
	if direct != nil {
		if direct.pending != 0 {
			failed = append(failed, fmt.Errorf("the run without fencing did not complete: %d customers pending", direct.pending))
		}
		if direct.duplicates == 0 {
			say("note: this time the run without fencing charged nobody twice (the old leader's charge did not commit)")
		}
	}
	if len(failed) > 0 {
		return errors.Join(failed...)
	}
	say("ok: every customer charged exactly once through fenceproxy; the stale leader's write was refused")
	return nil
}
