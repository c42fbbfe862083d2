-- fence.bind(resource, token, proof): binds the calling backend to (resource, token), raising
-- the stored token first when token is higher (ending the backends bound to lower ones).
-- Returns the stored token. Refuses (and so binds nothing) with ZF001 when a higher token is
-- stored (P3), ZF008 when this backend is bound already, ZF010 without the proxy's proof (P5).
-- The proxy calls it on the session's own connection, in its own READ COMMITTED transaction,
-- before the client sees ReadyForQuery. For a resource with a lease row it refuses, before
-- anything is raised, a token no acquisition issued (ZF002) and the generation of a lease that
-- expired or was released (ZF006) (L6). A bind that raises commits with synchronous_commit on
-- (D1); one that raises nothing does not wait for the WAL flush, unless synchronous standbys
-- are configured (D3).
--
-- Every fenced session start runs it in a brand-new backend, where each statement is parsed
-- and planned, each relation's cache entry built and each procedural language loaded for the
-- first time: that, not the work, is its cost (docs/BENCHMARKS.md, Session start). So the
-- common case, the token stored already, is this one SQL statement, without PL/pgSQL; every
-- other case (a raise, a refusal and its error, a first bind of the resource, a leftover
-- binding of this pid, the sweep of one bind in 64) takes none of its effects and goes to
-- fence.bind_full, which decides it all again with fresh snapshots.
--
-- The common case, in one statement:
--   (P5) the proof is checked in the WHERE clause below the row lock: a call without the
--        proxy's proof locks nothing (its open transaction could stall every raise);
--   (P1) R's row of fence.tokens is locked FOR SHARE, under READ COMMITTED only: a raise in
--        flight holds it FOR UPDATE, and once it commits the lock re-reads the row's newest
--        version and re-checks the WHERE clause (EvalPlanQual), so a raised token fails
--        t.token = token and the call goes to fence.bind_full;
--   (P3) it binds only when the stored token is the session's own (a lower one is
--        fence.bind_full's ZF001, a higher one its raise);
--   (L6) only when no lease row refuses the token: above the lease's generation, or the
--        generation of an expired or released lease;
--   (D1, D3) it turns synchronous_commit off for its transaction (nothing durable changes: the
--        binding is unlogged, the row lock matters only until commit) unless something earlier
--        in the transaction asked for durability (fence.consul_admit's record) or synchronous
--        standbys are configured, when it commits durably (fence.commit_durably) so that its
--        commit follows a raise whose wait for them was cancelled.
-- The binding's row replaces those of earlier backends with this pid (they have exited: pids
-- are unique among live backends) only when fence.bind_full does it; here this backend has
-- none, so the row is only inserted.
CREATE OR REPLACE FUNCTION fence.bind(resource text, token bigint, proof text)
RETURNS bigint
LANGUAGE sql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
WITH me AS MATERIALIZED (
    SELECT a.pid, a.backend_start
    FROM fence.keys AS k, pg_stat_get_activity(pg_backend_pid()) AS a, fence.tokens AS t
    WHERE k.id = 1 AND $3 = fence.mac(k.key, 'bind', $1, $2, a.pid) -- (P5)
      AND a.backend_start IS NOT NULL AND $2 > 0
      AND current_setting('transaction_isolation') = 'read committed' -- (P1)
      AND t.resource = $1 AND t.token = $2 -- (P1, P3)
      AND a.pid % 64 <> 0
      AND NOT EXISTS (SELECT FROM fence.bindings AS b WHERE b.pid = a.pid)
      AND NOT EXISTS (SELECT FROM fence.leases AS l -- (L6)
                      WHERE l.resource = $1
                        AND (l.generation < $2
                             OR (l.generation = $2 AND (l.holder IS NULL OR l.expires_at <= clock_timestamp()))))
    FOR SHARE OF t
), bound AS (
    INSERT INTO fence.bindings (pid, backend_start, resource, token)
    SELECT me.pid, me.backend_start, $1, $2 FROM me
)
SELECT CASE
    WHEN NOT EXISTS (SELECT FROM me) THEN fence.bind_full($1, $2, $3)
    WHEN current_setting('synchronous_standby_names') <> '' THEN (SELECT $2 FROM fence.commit_durably()) -- (D3)
    WHEN current_setting('fence.commit_durably', true) IS DISTINCT FROM 'on' -- (D1)
        THEN (SELECT $2 FROM set_config('synchronous_commit', 'off', true))
    ELSE $2
END
$fn$;
COMMENT ON FUNCTION fence.bind(text, bigint, text) IS
    'fenceproxy: bind this backend to (resource, token), raising the token first when it is higher; needs the proxy''s proof';
REVOKE ALL ON FUNCTION fence.bind(text, bigint, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fence.bind(text, bigint, text) TO PUBLIC;
