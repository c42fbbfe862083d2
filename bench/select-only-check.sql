-- pgbench's built-in select-only script (-S) plus the commit-time check that fenceproxy injects
-- for a fenced session, run straight against PostgreSQL (bench.sh target direct-check): what the
-- check costs the database without the proxy's hop. The check goes in the same Query message,
-- after the client's statement, as the proxy does for an implicit transaction.
-- Resource and token are those bench.sh uses ("bench", 1); needs pgbench -M simple.
\set aid random(1, 100000 * :scale)
SELECT abalance FROM pgbench_accounts WHERE aid = :aid \; SELECT fence.check('bench', 1);
