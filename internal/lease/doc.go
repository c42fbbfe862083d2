// Package lease turns leases into fencing tokens, behind one interface for every store: Lease
// and Store (ctx first, Token, Done, Err, Release), and RunLocked, which runs a command as the
// leader of a resource (`fenceproxy lock`) with an optional Watchdog that gives the lease up
// when the command stops making progress, store-agnostic. What the stores share lives here
// too: the sentinel errors the proxy maps to its SQLSTATEs, Consul's token modes (TokenMode,
// EncodeToken; the proxy's configuration reads them), backoff, the lease's outcome, the
// keep-alive's Clock, and Authority: a lock service as the proxy asks it (the current holder
// and token of a resource, a watch of changes).
//
// Each store has a package of its own, with both sides: the campaign `fenceproxy lock` uses,
// and what the proxy asks.
//
//   - consul: Consul locks (Session, Acquire, Lock, Store), the Watcher that follows lock
//     keys with consistent blocking queries and detects LockIndex regressions, and the
//     proxy's Guard.
//   - pglease: the PostgreSQL lease of the fence schema (fence.leases), whose generation the
//     database's own bind checks, so the proxy needs no other service for it.
//   - etcd: etcd elections; the token is the leader key's CreateRevision.
//   - zookeeper: ZooKeeper's lock recipe; the token is the lock node's czxid.
//
// Only internal/proxy/guards builds the services' clients for the proxy, so that
// internal/proxy imports none of them.
//
// A campaign talks to its store and nothing else: of PostgreSQL it only calls the lease
// functions of the fence schema (never a bind or a raise: those are the proxy's side, the
// Authority's LockGuard and consul.Guard), and it logs only through the *zap.Logger it is
// given, naming the store (key `store`).
package lease
