package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// replicaNames are the billing replicas, as in docker-compose.yml.
var replicaNames = []string{"billing-1", "billing-2", "billing-3"}

// outcome is a run's figures, read from the database (the ground truth) and the events.
type outcome struct {
	customers, charged, pending, charges, duplicates int
	rejected                                         int
	duplicated                                       []string // "customer N charged by ..."
}

// runState is one run of the scenario.
type runState struct {
	d        *demo
	name, db string
	dir      string
	procs    map[string]*testenv.Process // replica -> its fenceproxy lock
	own      []event                     // the demo's own events (froze, thawed)
}

// scenario runs the replicas of run to the end against url, freezing the leader on the
// way, and prints the run's timeline. key is the Consul lock key or the etcd election's
// prefix; on the PostgreSQL lease the lease row is in database db.
func (d *demo) scenario(ctx context.Context, run, db, url, key string) (*outcome, error) {
	c := d.c
	r := &runState{d: d, name: run, db: db, dir: filepath.Join(d.work, run), procs: map[string]*testenv.Process{}}
	if err := os.MkdirAll(r.dir, 0o755); err != nil {
		return nil, err
	}
	if db != "billing" {
		if err := d.pg.ExecContext(ctx, "CREATE DATABASE "+pgx.Identifier{db}.Sanitize()); err != nil {
			return nil, err
		}
	}
	if _, err := d.psql(ctx, db, "-v", "customers="+strconv.Itoa(c.Customers), "-f", filepath.Join(d.root, "demo", "schema.sql")); err != nil {
		return nil, err
	}
	say("%s: %d customers pending in database %s", run, c.Customers, db)

	// The arguments of fenceproxy lock between --resource and --on-lost (with Consul, as
	// docker-compose.yml has them).
	var lease []string
	switch {
	case d.consul != nil:
		lease = []string{"--key", key, "--consul-addr", d.consul.Addr, "--database-url", url, "--ttl", c.TTL.String(), "--lock-delay", "0s"}
	case d.etcd != nil:
		lease = []string{"--store", "etcd", "--etcd-endpoints", d.etcd.Endpoint, "--prefix", key, "--database-url", url, "--ttl", c.TTL.String()}
	default:
		// The lease row lives in the database the replicas write to, reached directly (as
		// the schema's owner here; any role with EXECUTE on the lease functions will do).
		leaseURL := d.adminURL(db)
		if db != "billing" {
			if err := d.oneShot(ctx, run+"/migrate", "migrate", "--database", leaseURL); err != nil {
				return nil, err
			}
		}
		lease = []string{"--store", "postgres", "--database", leaseURL, "--database-url", url, "--ttl", c.TTL.String()}
	}
	for _, name := range replicaNames {
		vars := []string{"BILLING_REPLICA=" + name, "BILLING_TX_DELAY=" + c.TxDelay.String(), "BILLING_STEP_DELAY=" + c.StepDelay.String()}
		args := append(append([]string{"lock", "--resource", "billing"}, lease...), "--on-lost", "retry", "--log-format", "console", "--", "billing")
		p, err := d.service(run+"/"+name, r.dir, vars, args...)
		if err != nil {
			return nil, err
		}
		d.replicas = append(d.replicas, p)
		r.procs[name] = p
	}

	if err := r.freezeAndWake(ctx); err != nil {
		return nil, err
	}

	// The run ends when every replica has exited: the leader when nothing is pending, the
	// others after taking the lock in turn and finding nothing to do.
	var codes []string
	deadline := time.Now().Add(c.Timeout)
	for _, name := range replicaNames {
		p := r.procs[name]
		for p.Running() {
			if time.Now().After(deadline) {
				return nil, fmt.Errorf("%s: %s still running after %v", run, name, c.Timeout)
			}
			if err := sleep(ctx, 100*time.Millisecond); err != nil {
				return nil, err
			}
		}
		codes = append(codes, fmt.Sprintf("%s=%d", name, exitCode(p.Status())))
	}
	say("%s: all replicas exited (%s)", run, strings.Join(codes, " "))
	return r.report(ctx)
}

// freezeAndWake waits for a leader, freezes it in the middle of a charge, waits until
// another replica took over and charged some customers, and wakes the old leader.
func (r *runState) freezeAndWake(ctx context.Context) error {
	c := r.d.c
	var first event
	if err := r.waitFor(ctx, "a leader", func() bool {
		var ok bool
		first, ok = r.firstStarted("")
		return ok
	}); err != nil {
		return err
	}
	leader := first.kv["replica"]
	child, _ := strconv.Atoi(first.kv["pid"])
	say("%s: %s leads with token %s", r.name, leader, first.kv["token"])
	if err := r.waitFor(ctx, fmt.Sprintf("%d charges", c.BeforeFreeze), func() bool {
		return r.count(leader, "charged") >= c.BeforeFreeze
	}); err != nil {
		return err
	}

	// Freeze the leader in the middle of a charge: right after it logged "charging" (its
	// charge row inserted, not committed). Then make sure the charge really is uncommitted:
	// the process may have been stopped between its COMMIT and the "charged" line. Otherwise
	// wake it and try again with its next charge.
	lock := r.procs[leader].Pid()
	var groups []int
	var customer string
	var frozenAt time.Time
	for attempt := 1; ; attempt++ {
		if err := r.waitFor(ctx, leader+" to start a charge", func() bool {
			return r.last(leader).kv["event"] == "charging"
		}); err != nil {
			return err
		}
		pgid, err := syscall.Getpgid(child)
		if err != nil {
			return fmt.Errorf("%s's billing process %d: %w", leader, child, err)
		}
		groups = []int{pgid, lock}
		signalGroups(groups, syscall.SIGSTOP)
		frozenAt = time.Now()
		if err := r.waitFor(ctx, leader+" to stop", func() bool { return stopped(child) && stopped(lock) }); err != nil {
			return err
		}
		if err := sleep(ctx, 200*time.Millisecond); err != nil { // a COMMIT sent just before the stop has landed by now
			return err
		}
		last := r.last(leader)
		customer = last.kv["customer"]
		committed, err := r.charged(ctx, customer)
		if err != nil {
			return err
		}
		if last.kv["event"] == "charging" && !committed {
			break
		}
		signalGroups(groups, syscall.SIGCONT)
		if attempt == 10 {
			return fmt.Errorf("could not freeze %s in the middle of a charge", leader)
		}
	}
	r.mark("froze", "who", leader, "customer", customer, "pids", fmt.Sprintf("%d,%d", child, lock))
	say("%s: froze %s (SIGSTOP to process groups %d %d) with customer %s's charge uncommitted", r.name, leader, groups[0], groups[1], customer)

	// Consul invalidates the frozen leader's session after TTL to 2 x TTL (the PostgreSQL
	// lease expires TTL after its last renewal); another replica takes the lock and resumes
	// the run.
	var next event
	if err := r.waitFor(ctx, "another replica to take over", func() bool {
		var ok bool
		next, ok = r.firstStarted(leader)
		return ok
	}); err != nil {
		return err
	}
	successor := next.kv["replica"]
	say("%s: %s took over with token %s after %ds", r.name, successor, next.kv["token"], int(time.Since(frozenAt).Seconds()))
	if err := r.waitFor(ctx, fmt.Sprintf("%d charges by %s", c.AfterTakeover, successor), func() bool {
		return r.count(successor, "charged") >= c.AfterTakeover
	}); err != nil {
		return err
	}
	frozenFor := int(time.Since(frozenAt).Seconds())
	r.mark("thawed", "who", leader, "frozen_s", strconv.Itoa(frozenFor))
	signalGroups(groups, syscall.SIGCONT)
	say("%s: thawed %s after %ds", r.name, leader, frozenFor)
	return nil
}

// waitFor polls cond until it holds, failing after the demo's timeout or when every
// replica of the run has exited.
func (r *runState) waitFor(ctx context.Context, what string, cond func() bool) error {
	deadline := time.Now().Add(r.d.c.Timeout)
	for !cond() {
		alive := false
		for _, p := range r.procs {
			alive = alive || p.Running()
		}
		if !alive {
			var tails []string
			for _, name := range replicaNames {
				tails = append(tails, name+": "+tail(r.procs[name].LogFile, 5))
			}
			return fmt.Errorf("%s: every replica exited while waiting for %s:\n%s", r.name, what, strings.Join(tails, "\n"))
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: timed out after %v waiting for %s", r.name, r.d.c.Timeout, what)
		}
		if err := sleep(ctx, 50*time.Millisecond); err != nil {
			return err
		}
	}
	return nil
}

// events are the billing events in name's log, in order.
func (r *runState) events(name string) []event {
	evs, _ := readEvents(r.procs[name].LogFile)
	return evs
}

// last is name's last billing event (zero if none).
func (r *runState) last(name string) event {
	evs := r.events(name)
	if len(evs) == 0 {
		return event{kv: map[string]string{}}
	}
	return evs[len(evs)-1]
}

func (r *runState) count(name, kind string) int {
	n := 0
	for _, e := range r.events(name) {
		if e.kv["event"] == kind {
			n++
		}
	}
	return n
}

// firstStarted is the earliest "started" event of a replica other than except.
func (r *runState) firstStarted(except string) (event, bool) {
	var found []event
	for _, name := range replicaNames {
		if name == except {
			continue
		}
		for _, e := range r.events(name) {
			if e.kv["event"] == "started" {
				found = append(found, e)
			}
		}
	}
	if len(found) == 0 {
		return event{}, false
	}
	return slices.MinFunc(found, func(a, b event) int { return a.at.Compare(b.at) }), true
}

// charged reports whether customer's charge is committed.
func (r *runState) charged(ctx context.Context, customer string) (bool, error) {
	id, err := strconv.ParseInt(customer, 10, 64)
	if err != nil {
		return false, nil // no customer in the line: not a charge in hand
	}
	conn, err := pgx.Connect(ctx, r.d.adminURL(r.db))
	if err != nil {
		return false, err
	}
	defer conn.Close(context.Background())
	var charged bool
	err = conn.QueryRow(ctx, "SELECT charged FROM customers WHERE id = $1", id).Scan(&charged)
	return charged, err
}

// mark adds one of the demo's own events to the run's timeline.
func (r *runState) mark(name string, kv ...string) {
	e := event{at: time.Now().UTC(), kv: map[string]string{"replica": "demo", "token": "-", "event": name}}
	for i := 0; i+1 < len(kv); i += 2 {
		e.kv[kv[i]] = kv[i+1]
	}
	r.own = append(r.own, e)
}

// report reads the run's outcome from the database and prints its timeline.
func (r *runState) report(ctx context.Context) (*outcome, error) {
	out, err := r.d.psql(ctx, r.db, "-A", "-t", "-F", " ", "-f", filepath.Join(r.d.root, "demo", "report.sql"))
	if err != nil {
		return nil, err
	}
	o := &outcome{}
	figures := map[string]*int{"customers": &o.customers, "charged": &o.charged, "pending": &o.pending, "charges": &o.charges, "duplicates": &o.duplicates}
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		name, value, _ := strings.Cut(sc.Text(), " ")
		if p, ok := figures[name]; ok {
			*p, _ = strconv.Atoi(value)
		} else if name == "duplicate" {
			id, who, _ := strings.Cut(value, " ")
			o.duplicated = append(o.duplicated, fmt.Sprintf("customer %s charged by %s", id, who))
		}
	}

	timeline := slices.Clone(r.own)
	for _, name := range replicaNames {
		evs := r.events(name)
		for _, e := range evs {
			if e.kv["event"] == "rejected" {
				o.rejected++
			}
		}
		timeline = append(timeline, evs...)
		// fenceproxy lock's own "lost leadership" lines.
		timeline = append(timeline, logEvents(r.procs[name].LogFile, name)...)
	}
	if r.name == "fenced" {
		// And fenceproxy's, in the run that goes through it.
		timeline = append(timeline, logEvents(r.d.proxy.LogFile, "fenceproxy")...)
	}
	fmt.Printf("\n== timeline: %s ==\n", r.name)
	render(os.Stdout, timeline)
	if len(o.duplicated) > 0 {
		fmt.Println("charged more than once:")
		for _, l := range o.duplicated {
			fmt.Println("  " + l)
		}
	}
	return o, nil
}

func signalGroups(groups []int, sig syscall.Signal) {
	for _, g := range groups {
		_ = syscall.Kill(-g, sig)
	}
}

// stopped reports whether pid is stopped (state T in /proc/PID/stat).
func stopped(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	i := bytes.LastIndexByte(b, ')')
	return i >= 0 && i+2 < len(b) && b[i+2] == 'T'
}

func exitCode(err error) int {
	var ee interface{ ExitCode() int }
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	if err != nil {
		return -1
	}
	return 0
}

func sleep(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

// tail is the last n lines of the file at path.
func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
