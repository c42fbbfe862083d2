// Package history checks a recorded history of a fencing campaign for the violations of
// fenceproxy's guarantee and of the workload's exactly-once rule.
//
// A History is what the servers and the clients recorded: every raise of a resource's token
// and every committed write with its token, each at its commit position (an order PostgreSQL
// decided, such as the commit record's LSN: comparable within one database only), and every
// outcome a client observed for its attempts (acknowledged, an error with its SQLSTATE, or
// unknown). Check returns the violations:
//
//   - StaleCommit: a write of token t committed after a raise of the same database and
//     resource to t' > t had committed (the guarantee itself);
//   - Duplicate: a unit of work committed more than once;
//   - Missing: a unit the workload says must be done was not committed at all;
//   - LostAck: an attempt a client saw acknowledged has no committed write.
//
// Positions: a raise and a write at the same position committed together (one transaction),
// so the write is not after the raise. A raise that rolled back admitted nothing and is
// ignored. An error or an unknown outcome says nothing about whether the write committed
// (a COMMIT whose answer was lost may have committed): only the committed writes decide.
//
// The package owns the rules and nothing else: it reads no server, starts nothing and logs
// nothing, so that it can be tested on histories written by hand, including ones that must
// be flagged.
package history
