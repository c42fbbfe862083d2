-- The connect cell's diagnostic target direct-bind (internal/bench): pgbench's select-only
-- transaction (-S) after the statements fenceproxy sends at the start of a fenced session
-- (internal/proxy/session.go, bind: its own READ COMMITTED transaction without timeouts, then
-- fence.bind), run with pgbench -C straight against PostgreSQL, so that every transaction has a
-- new backend to bind. Against target direct (-C -S without the bind) it is what the bind costs
-- the database alone, without the proxy's part. The proxy sends its messages in one write;
-- here they are one Query, one round trip. The proof is computed here by fence.proof (the
-- superuser may call it), which fence.bind computes again to compare: the proof counts twice,
-- and the proxy passes it as a parameter of the extended protocol, not in the text.
-- Resource and token are those of the benchmark's fenced target ("bench", 1).
\set aid random(1, 100000 * :scale)
BEGIN ISOLATION LEVEL READ COMMITTED READ WRITE \; SET LOCAL statement_timeout = 0 \; SET LOCAL lock_timeout = 0 \; SELECT fence.bind('bench', 1, fence.proof('bind', 'bench', 1, pg_backend_pid())) \; COMMIT;
SELECT abalance FROM pgbench_accounts WHERE aid = :aid;
