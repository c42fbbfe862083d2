package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/fenceproxy/fenceproxy/internal/testenv"
)

// demo is what the runs share: the binaries, the servers and the proxy.
type demo struct {
	c          config
	root       string // the source tree: demo/schema.sql, demo/report.sql
	work       string // temporary folder: logs, the key file
	fenceBin   string
	billingBin string
	env        []string // the services' environment: the binaries first on PATH, TZ=UTC

	pg       *testenv.Postgres
	consul   *testenv.Consul // only with --store consul
	etcd     *testenv.Etcd   // only with --store etcd
	proxy    *testenv.ProxyProcess
	replicas []*testenv.Process // of every run, stopped by close
	keyFile  string
}

// setup builds the programs and starts PostgreSQL, the lease store (Consul, or etcd: an
// in-process server; the PostgreSQL lease needs none), the migration and fenceproxy. The demo it returns, even with an error, must be closed.
func setup(ctx context.Context, c config) (*demo, error) {
	root, err := testenv.ModuleRoot()
	if err != nil {
		return nil, fmt.Errorf("run the demo from fenceproxy's source tree: %w", err)
	}
	if err := os.MkdirAll(c.BinDir, 0o755); err != nil {
		return nil, err
	}
	say("building fenceproxy and billing into %s", c.BinDir)
	bins, err := testenv.BuildGoContext(ctx, c.BinDir, "./cmd/fenceproxy", "./cmd/billing")
	if err != nil {
		return nil, err
	}
	work, err := os.MkdirTemp("", "fenceproxy-demo-")
	if err != nil {
		return nil, err
	}
	d := &demo{c: c, root: root, work: work, fenceBin: bins[0], billingBin: bins[1]}
	// The services name the programs as the containers of docker-compose.yml do; every
	// timestamp in UTC, as the timeline merges the logs of several programs.
	d.env = append(os.Environ(), "PATH="+c.BinDir+string(os.PathListSeparator)+os.Getenv("PATH"), "TZ=UTC")

	if d.pg, err = testenv.LaunchPostgres(ctx, testenv.WithAuth("scram-sha-256")); err != nil {
		return d, err
	}
	say("PostgreSQL on %s:%d, folder %s", d.pg.Host, d.pg.Port, work)
	switch c.Store {
	case "consul":
		if d.consul, err = testenv.LaunchConsul(ctx); err != nil {
			return d, err
		}
		say("Consul v%s on %s", testenv.ConsulVersion, d.consul.Addr)
	case "etcd":
		// etcd's own server code (the embed package), in this process, on private ports.
		if d.etcd, err = testenv.LaunchEtcd(ctx); err != nil {
			return d, err
		}
		say("etcd on %s (in the demo's process)", d.etcd.Endpoint)
	default:
		say("no Consul: the replicas lead through the PostgreSQL lease (fence.leases in the protected database)")
	}
	if err := d.pg.ExecContext(ctx, "CREATE DATABASE billing"); err != nil {
		return d, err
	}

	// The proxy key: `fenceproxy migrate --key-file` creates the file (a random key) and
	// stores the key in the database; the proxy proves its binds and raises with it (`serve
	// --key-file`). In docker-compose.yml the file sits on a volume that the migrate and
	// fenceproxy services share. The schema's owner is the superuser postgres here, which may
	// end the billing role's backends at a raise.
	d.keyFile = filepath.Join(work, "keys", "fenceproxy.key")
	if err := os.MkdirAll(filepath.Dir(d.keyFile), 0o700); err != nil {
		return d, err
	}
	say("proxy key file %s", d.keyFile)
	if err := d.oneShot(ctx, "migrate", "migrate", "--database", d.adminURL("billing"), "--key-file", d.keyFile); err != nil {
		return d, err
	}
	if fi, err := os.Stat(d.keyFile); err != nil || fi.Size() == 0 {
		return d, fmt.Errorf("fenceproxy migrate created no key file %s", d.keyFile)
	}

	// With Consul or etcd the proxy validates each token against the lock or election (and
	// raises a new holder's token itself); with the PostgreSQL lease it needs no other
	// service: the acquisition raises the token, and fence.bind checks every token against
	// the lease row.
	port, err := testenv.PickFreePort()
	if err != nil {
		return d, err
	}
	args := []string{"serve", "--listen", "127.0.0.1:" + strconv.Itoa(port), "--upstream", fmt.Sprintf("postgres://%s:%d", d.pg.Host, d.pg.Port)}
	switch {
	case d.consul != nil:
		args = append(args, "--resource", "billing=locks/billing", "--key-file", d.keyFile, "--consul-addr", d.consul.Addr)
	case d.etcd != nil:
		// Each run has an election prefix of its own (the unfenced run's replicas connect
		// straight to PostgreSQL, but they elect their leader in the same etcd).
		args = append(args, "--resource", "billing", "--key-file", d.keyFile,
			"--etcd-endpoints", d.etcd.Endpoint, "--etcd-resource", "billing=locks/billing")
	default:
		args = append(args, "--resource", "billing", "--key-file", d.keyFile)
	}
	args = append(args, "--control-database", d.adminURL("billing"), "--log-format", "console")
	proc, err := d.service("fenceproxy", work, nil, args...)
	if err != nil {
		return d, err
	}
	d.proxy = &testenv.ProxyProcess{Process: proc, Host: "127.0.0.1", Port: port}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := d.proxy.WaitListeningContext(wctx); err != nil {
		return d, err
	}
	say("fenceproxy on %s", d.proxy.Addr())
	return d, nil
}

// adminURL reaches db as the superuser.
func (d *demo) adminURL(db string) string {
	return d.pg.URLWithPassword(testenv.AdminUser, testenv.AdminPassword, db)
}

// proxyURL is the billing role's URL through fenceproxy; directURL, straight to PostgreSQL.
func (d *demo) proxyURL(db string) string {
	return fmt.Sprintf("postgres://billing:billing@%s/%s?sslmode=disable", d.proxy.Addr(), db)
}

func (d *demo) directURL(db string) string {
	return d.pg.URLWithPassword("billing", "billing", db)
}

// commandLine is how a service is printed: its variables, then fenceproxy by name.
func commandLine(vars []string, args []string) string {
	return strings.Join(append(append(vars[:len(vars):len(vars)], "fenceproxy"), args...), " ")
}

// service starts `fenceproxy ARGS...` with vars (VAR=VALUE) as the service name, its output
// in dir/name.log, and prints its command line.
func (d *demo) service(name, dir string, vars []string, args ...string) (*testenv.Process, error) {
	say("service %s: %s", name, commandLine(vars, args))
	env := append(d.env[:len(d.env):len(d.env)], vars...)
	return testenv.LaunchProcess(dir, filepath.Base(name), append([]string{d.fenceBin}, args...), env)
}

// oneShot runs `fenceproxy ARGS...` to its end as the service name.
func (d *demo) oneShot(ctx context.Context, name string, args ...string) error {
	say("service %s: %s", name, commandLine(nil, args))
	cmd := exec.CommandContext(ctx, d.fenceBin, args...)
	cmd.Env = d.env
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("fenceproxy %s: %w\n%s", args[0], err, out)
	}
	return nil
}

// psql runs psql as the superuser in db and returns its output.
func (d *demo) psql(ctx context.Context, db string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, d.pg.Bin("psql"), append([]string{"-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", d.adminURL(db)}, args...)...)
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return "", fmt.Errorf("psql %s: %w\n%s", strings.Join(args, " "), err, ee.Stderr)
		}
		return "", fmt.Errorf("psql: %w", err)
	}
	return string(out), nil
}

// billingPids are the billing processes still running: fenceproxy lock starts each in a
// process group of its own, so that they outlive a killed supervisor.
func (d *demo) billingPids() []int {
	entries, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if exe, err := os.Readlink("/proc/" + e.Name() + "/exe"); err == nil && exe == d.billingBin {
			pids = append(pids, pid)
		}
	}
	return pids
}

// close stops everything the demo started, last started first, and removes its folder
// (unless --keep).
func (d *demo) close() error {
	// A frozen billing process would sit on the SIGTERM its supervisor sends.
	for _, pid := range d.billingPids() {
		_ = syscall.Kill(pid, syscall.SIGCONT)
	}
	var errs []error
	for i := len(d.replicas) - 1; i >= 0; i-- {
		// fenceproxy lock stops its billing child (SIGTERM) and releases the lock.
		errs = append(errs, d.replicas[i].Terminate(20*time.Second))
	}
	if d.proxy != nil {
		errs = append(errs, d.proxy.Terminate(20*time.Second))
	}
	for _, pid := range d.billingPids() {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	if d.consul != nil {
		errs = append(errs, d.consul.Close())
	}
	if d.etcd != nil {
		errs = append(errs, d.etcd.Close())
	}
	if d.pg != nil {
		errs = append(errs, d.pg.Close())
	}
	if d.c.Keep {
		say("kept %s", d.work)
	} else {
		errs = append(errs, os.RemoveAll(d.work))
	}
	return errors.Join(errs...)
}
