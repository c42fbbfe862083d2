// Package testenv starts and stops the real servers and processes that fenceproxy's tests,
// the chaos campaign, the demo and the benchmark run against: a private PostgreSQL 15
// cluster per call of StartPostgres, a Consul agent (StartConsul), an etcd server
// (StartEtcd, in the calling process), a ZooKeeper server (StartZooKeeper, Debian's jars
// in a JVM of its own), in-process proxies (StartProxy), and processes that
// can be frozen, killed and started again as a whole process group (StartProcess;
// StartProxyProcess for a `fenceproxy serve` on a fixed port; BuildGo for the binaries).
//
// A cluster lives in its own temporary folder, listens on 127.0.0.1 on a private
// port and on a unix socket in that folder, and is stopped and removed by
// tb.Cleanup. initdb and postgres refuse to run as root, so when the tests run as
// root the cluster runs as the `postgres` OS user. Settings trade durability for
// speed (fsync, synchronous_commit and full_page_writes off): a Kill simulates a
// server crash, not a power loss.
//
// # Two faces: tests and programs
//
// The helpers that take a testing.TB fail the test on an error and register their own
// cleanup. Each wraps a core that a program which is not a test (cmd/demo, a benchmark
// driver) uses instead: it takes a context where it waits, returns an error, and leaves
// the stopping to the caller's Close:
//
//	test helper (testing.TB)        program (error, caller closes)
//	StartPostgres(tb, opts...)      LaunchPostgres(ctx, opts...)    ... p.Close()
//	  p.Start / Stop / Kill           p.StartContext(ctx) / Shutdown() / Crash()
//	  p.Exec / CreateRole             p.ExecContext(ctx, sql) / CreateRoleContext(ctx, ...)
//	StartConsul(tb)                 LaunchConsul(ctx)               ... c.Close()
//	StartZooKeeper(tb)              LaunchZooKeeper(ctx)            ... z.Close()
//	  z.Start / Stop                  z.StartContext(ctx) / Shutdown()
//	  c.Start / Stop                  c.StartContext(ctx) / Shutdown()
//	  c.Pause / Resume / Client       c.Freeze() / Thaw() / NewClient()
//	ConsulBinary(tb)                FindConsulBinary()
//	StartProcess(tb, ...)           LaunchProcess(dir, name, argv, env) ... p.Close()
//	  p.Start / Kill / Stop           p.Launch() / KillWait(d) / Terminate(grace)
//	StartProxyProcess(tb, ...)      LaunchProxyProcess(ctx, ...)    ... p.Close()
//	StartPgBouncer(tb, pg, db, o)   LaunchPgBouncer(ctx, pg, db, o) ... b.Close()
//	BuildGo(tb, dir, pkgs...)       BuildGoContext(ctx, dir, pkgs...)
//	FreePort(tb)                    PickFreePort()
//	Migrate(tb, url)                MigrateContext(ctx, url)
//
// The benchmark (internal/bench, cmd/bench), for instance, starts its cluster and proxy like
// this, and PgBouncer with LaunchPgBouncer (any other program runs as a Process):
//
//	pg, err := testenv.LaunchPostgres(ctx, testenv.WithConf("max_connections", "300"))
//	if err != nil { return err }
//	defer pg.Close()
//	bins, err := testenv.BuildGoContext(ctx, dir, "./cmd/fenceproxy")
//	...
//	px, err := testenv.LaunchProxyProcess(ctx, dir, "fenceproxy", bins[0],
//		"--upstream", fmt.Sprintf("postgres://%s:%d", pg.Host, pg.Port), ...)
//	if err != nil { return err }
//	defer px.Close()
//
// Every Launch* cleans up what it started when it fails. Waits poll for a condition (a
// real connection, a consistent read, a listening port) instead of sleeping.
//
// The package owns starting, stopping and crashing servers and the addresses to reach
// them. The product (cmd/fenceproxy and the packages it imports) must not import it; the
// tests, the chaos campaign (internal/chaos), the demo (cmd/demo) and benchmark drivers
// may. It must not mock what the servers decide: callers ask the real server.
//
// Missing binaries are an error that names `make deps` (a fatal test error in the TB
// helpers), never a skip: a suite that silently skips its database tests proves nothing.
package testenv
