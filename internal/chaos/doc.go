// Package chaos is fenceproxy's chaos campaign: a ledger workload whose units of work must
// each happen exactly once, run by three replicas under `fenceproxy lock` (Consul) through
// two fenceproxy instances on one PostgreSQL, while each round injects faults at random
// times and in random combinations (frozen and killed leaders, killed proxies, PostgreSQL
// and Consul restarts, delay, loss, stalls and cuts on the app-proxy and proxy-PostgreSQL
// links through internal/faulthop). The history comes from the servers themselves (commit
// order from PostgreSQL's write-ahead log through a logical decoding slot; every raise of
// fence.tokens; every ledger row with the token its backend was bound to) and from the
// replicas (every outcome they saw), and internal/history checks it.
//
// A hang (units pending long after the faults were healed), a leaked backend, a lost
// acknowledged write and a stale commit fail the round; nothing is retried. The same
// campaign with the replicas straight to PostgreSQL is the negative control: the checker
// must find violations there.
//
// With a streaming standby (Config.Standby, asynchronous or synchronous) the campaign also
// fails over: the primary is killed and the standby promoted while the workload runs, the
// proxies follow through their multi-host upstreams, and the history is read on across the
// failover (decode.go: one decoding slot per primary, the old primary's lost commits told
// from the kept ones by the new timeline's switch point). Its negative control claims of an
// asynchronous standby that no acknowledged write is lost: the checker must find the ones
// the old primary took with it.
//
// Real servers only (internal/testenv starts them); the package is used by its tests, which
// `make test` (short) and `make chaos` (long) run.
package chaos
