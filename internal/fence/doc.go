// Package fence owns fencing itself: what a resource and a token are, the
// SQLSTATEs and messages of every rejection, the SQL the proxy sends (bind and
// raise, built from validated values and the proxy key's proof, never from
// client text), the per-proxy registry of the highest token known for each
// database and resource, the listener that learns of raises made through
// other proxy instances, and the migrations that install the `fence` schema.
//
// The guarantee (for a resource R, once token t' is admitted, no transaction
// under t < t' commits afterwards) is discharged by PostgreSQL, in
// migrations/functions (docs/proof.md): every fenced backend is bound to its
// token before its client can send anything, and a raise ends every backend
// bound to a lower token and waits for it to exit before it commits. The
// proxy's part is to bind each fenced session before its ReadyForQuery;
// everything in the registry is an optimisation (early refusal, a clear
// ZF001 for a session the raise ended) that may be late or lost without
// breaking the guarantee.
//
// This package must not import the proxy; it never logs except through a
// logger it is given.
package fence
