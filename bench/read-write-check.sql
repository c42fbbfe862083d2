-- pgbench's built-in "simple-update" script (-N: tpcb-like without the branch and teller
-- updates) plus the commit-time check that fenceproxy injects before COMMIT in a fenced session,
-- run straight against PostgreSQL (bench.sh target direct-check): what the check costs the
-- database without the proxy's hop. The check shares the END's Query message, the cheapest way
-- a proxy could send it. Resource and token are those bench.sh uses ("bench", 1); needs -M simple.
\set aid random(1, 100000 * :scale)
\set bid random(1, 1 * :scale)
\set tid random(1, 10 * :scale)
\set delta random(-5000, 5000)
BEGIN;
UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid;
SELECT abalance FROM pgbench_accounts WHERE aid = :aid;
INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (:tid, :bid, :aid, :delta, CURRENT_TIMESTAMP);
SELECT fence.check('bench', 1) \; END;
