// Package fence owns fencing itself: what a resource and a token are, the
// SQLSTATEs and messages of every rejection, the SQL the proxy injects (check
// and raise, built from validated values, never from client text), the
// per-proxy registry of the highest token known for each resource, the
// listener that learns of raises made through other proxy instances, and the
// migrations that install the `fence` schema.
//
// The guarantee (for a resource R, once token t' is admitted, no transaction
// under t < t' commits a change) is discharged by PostgreSQL: fence.check runs
// inside the client's transaction immediately before it commits and, only
// when the transaction wrote, reads R's token from the sequence
// fence_token."R" (taking a lock that the raise's ALTER SEQUENCE conflicts
// with); fence.raise updates R's row in its own short transaction, and a
// trigger moves the sequence with it. Everything in the registry
// is an optimisation (early refusal, cancellation of in-flight queries) that
// may be late or lost without breaking the guarantee.
//
// This package must not import the proxy; it never logs except through a
// logger it is given.
package fence
