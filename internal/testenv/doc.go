// Package testenv starts the real servers that fenceproxy's tests run against:
// a private PostgreSQL 15 cluster per call of StartPostgres, a Consul agent
// (StartConsul), an etcd server (StartEtcd, in the test process), in-process proxies (StartProxy), and processes that can be frozen,
// killed and started again as a whole process group (StartProcess; StartProxyProcess
// for a `fenceproxy serve` on a fixed port; BuildGo for the binaries).
//
// A cluster lives in its own temporary folder, listens on 127.0.0.1 on a private
// port and on a unix socket in that folder, and is stopped and removed by
// tb.Cleanup. initdb and postgres refuse to run as root, so when the tests run as
// root the cluster runs as the `postgres` OS user. Settings trade durability for
// speed (fsync, synchronous_commit and full_page_writes off): a Kill simulates a
// server crash, not a power loss.
//
// The package owns starting, stopping and crashing servers and the addresses to
// reach them. It must not be imported by non-test code (internal/chaos, the chaos
// campaign, is run only as a test), and it must not mock what the servers decide:
// tests ask the real server.
//
// Missing binaries are a fatal test error that names `make deps`, never a skip:
// a suite that silently skips its database tests proves nothing.
package testenv
