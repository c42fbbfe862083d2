-- fence.commit_durably(): (D1) the calling transaction commits with synchronous_commit on, or
-- remote_apply when the session has that, whatever the role (ALTER ROLE ... SET), the database,
-- the session or the client's startup options set: off, local and remote_write are raised to on.
-- Its commit then returns only once the WAL is flushed here (P7) and, when
-- synchronous_standby_names names standbys, on those standbys, which a failover may promote. A
-- raise (or a record an admission rests on) counts as admitted only once it is durable there.
--
-- set_config with is_local: the setting lasts until the transaction ends, past this function's
-- return (its SET clause restores search_path only). A SET synchronous_commit clause on a
-- function would be undone when the function returns, before the commit; so would a later
-- set_config in the same transaction, which fence.bind therefore skips after this. Called by every
-- function that raises a stored token or writes what an admission rests on: fence.raise_locked
-- (fence.bind's raise, fence.raise, fence.lease_acquire), fence.reset, fence.consul_admit and
-- fence.consul_regress. Not granted to PUBLIC.
--
-- LANGUAGE sql, not PL/pgSQL: with synchronous standbys every bind calls it, and a new backend
-- pays for loading PL/pgSQL (docs/BENCHMARKS.md, Session start).
--
-- (D3) A commit whose wait for the synchronous standbys is cancelled returns with a WARNING,
-- the only sign that the standbys may not have it; fenceproxy refuses a session whose bind's
-- commit answered so. client_min_messages = error (a startup option, ALTER ROLE ... SET)
-- would suppress it, so it is lowered to warning for the transaction: the commit's wait runs
-- before the transaction's settings are undone (RecordTransactionCommit precedes AtEOXact_GUC
-- in PostgreSQL's CommitTransaction).
CREATE OR REPLACE FUNCTION fence.commit_durably()
RETURNS void
LANGUAGE sql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
SELECT pg_catalog.set_config('synchronous_commit', 'on', true)
WHERE pg_catalog.current_setting('synchronous_commit') <> 'remote_apply';
SELECT pg_catalog.set_config('client_min_messages', 'warning', true)
WHERE pg_catalog.current_setting('client_min_messages') NOT IN
    ('debug5', 'debug4', 'debug3', 'debug2', 'debug1', 'log', 'notice', 'warning');
-- Read by fence.bind, which otherwise turns synchronous_commit off for a bind that raises
-- nothing. A client that sets it itself only makes its binds wait for the flush.
SELECT pg_catalog.set_config('fence.commit_durably', 'on', true);
$fn$;
REVOKE ALL ON FUNCTION fence.commit_durably() FROM PUBLIC;
