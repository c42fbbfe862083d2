// Package proxy is fenceproxy's server: it accepts clients, negotiates TLS,
// relays authentication to PostgreSQL unchanged, and then relays messages in
// both directions, one upstream connection per client, tracking the
// transaction status from every ReadyForQuery.
//
// In a fenced session it also injects fence.check at every commit point and
// swallows the check's own results (see relay.go for the proof obligations),
// and refuses, in order and through the server itself, statements that could
// commit past the check. It asks internal/sqltx to split and classify SQL and
// never parses SQL itself.
package proxy
