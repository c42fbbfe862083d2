// Package bench is fenceproxy's benchmark, which cmd/bench runs (`make bench`): it starts a
// throwaway PostgreSQL 15, PgBouncer (session mode) and fenceproxy through internal/testenv,
// loads `pgbench -i`, and drives the real pgbench against each target:
//
//	direct       PostgreSQL itself
//	unfenced     fenceproxy, a session without a token (--unfenced allow): a plain relay
//	pgbouncer    PgBouncer in session mode
//	fenced       fenceproxy, a session with a token (PGOPTIONS='-c fence.resource=bench
//	             -c fence.token=1'): bound once at session start, then relayed as unfenced
//	direct-bind  (connect cell only) PostgreSQL itself with the proxy's bind statements before
//	             each SELECT (bind.sql): what the bind costs the database alone
//
// In one run, rounds interleaved (every cell and target once per round; the targets of even
// rounds in reverse order, so that the machine's drift spreads over all of them), it measures
// throughput (select-only -S and read-write -N under the simple and prepared protocols at
// each client count), the latency of every transaction at 1 client (pgbench -l: mean and 99th
// percentile, and what each target adds to direct's), the session start (pgbench -C -S: the
// fenced bind included), the CPU per transaction of the middleman (the proxy or pgbouncer
// process) and of PostgreSQL (the postmaster and all its processes), both from /proc/PID/stat,
// the middleman's system calls (perf stat's raw_syscalls tracepoint, or /proc/PID/io) and
// context switches (/proc/PID/task/*/status) per transaction; after every round the raise
// latency with N stale sessions open (and checks that none of them outlives the raise or
// commits); after the rounds the memory per idle session (VmRSS of the middleman before and
// after opening that many sessions through it). Report prints one table of medians with the
// ratios against PgBouncer and against direct.
//
// Before every measured run it does what pgbench does by default (VACUUM of branches and
// tellers, TRUNCATE of history) plus a CHECKPOINT, on PostgreSQL itself, and runs pgbench with
// -n, so that the preparation is the same for every target and outside the measurement.
//
// A benchmark measures and prints; it fails only when a target cannot be measured at all or a
// raise lets a stale session live or commit. Its tests check that a run produces every row,
// never how fast anything was.
package bench
