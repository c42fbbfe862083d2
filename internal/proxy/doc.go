// Package proxy is fenceproxy's server: it accepts clients, negotiates TLS,
// relays authentication to PostgreSQL unchanged, binds each fenced session's
// backend to its token (fence.bind) before the client sees ReadyForQuery,
// and then relays messages in both directions, one upstream connection per
// client, looking inside none of them to keep the guarantee: PostgreSQL ends
// a stale backend at the raise (migrations/00004_bind_sessions.sql).
//
// Guards check a session's token against the lock service that issued it
// before the bind, and raise each new holder's token proactively: LockGuard,
// over a lease.Authority (an etcd election, a ZooKeeper lock), and
// internal/lease/consul's Guard against Consul. Each service's client lives in
// its package under internal/lease and is built in internal/proxy/guards: the
// proxy imports none.
//
// It must not parse SQL, predict what the server will do, or keep a received
// message past the next read.
package proxy
