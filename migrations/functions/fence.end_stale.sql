-- fence.end_stale(resource, token, timeout): (P2) and (P4) for a raise of resource to token.
-- The caller holds resource's row of fence.tokens FOR UPDATE. Ends every live backend bound
-- to a lower token, waits until each one has exited (at most timeout), removes the bindings
-- of the resource's exited backends, and refuses while prepared transactions exist. Returns
-- how many backends it ended. Not granted to PUBLIC.
CREATE OR REPLACE FUNCTION fence.end_stale(resource text, token bigint, timeout interval)
RETURNS integer
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    p_resource ALIAS FOR $1;
    p_token    ALIAS FOR $2;
    p_timeout  ALIAS FOR $3;
    victims    integer[];
    alive      integer[];
    deadline   timestamptz := clock_timestamp() + p_timeout;
    busy       text;
BEGIN
    -- (P1, P2) Only READ COMMITTED reads fence.bindings with a snapshot taken after the lock:
    -- under REPEATABLE READ the list would miss the bindings committed since the transaction's
    -- snapshot (fence.reset does not pass through fence.verify).
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF007',
            MESSAGE = format('fencing unavailable: a raise of resource "%s" must run under READ COMMITTED, not %s',
                             p_resource, current_setting('transaction_isolation'));
    END IF;
    -- (P2) The list: a fresh snapshot taken after the caller's FOR UPDATE lock. A live backend
    -- with a bound pid whose backend_start reads NULL (the owner lost pg_read_all_stats since
    -- the bind, which needed it) counts as bound: fail closed, never skip a stale backend.
    PERFORM pg_stat_clear_snapshot();
    SELECT array_agg(b.pid ORDER BY b.pid) INTO victims
    FROM fence.bindings AS b
    JOIN pg_stat_get_activity(NULL) AS a ON a.pid = b.pid
        AND (a.backend_start = b.backend_start OR a.backend_start IS NULL)
    WHERE b.resource = p_resource AND b.token < p_token;

    IF victims IS NOT NULL THEN
        -- (P4) first: refuse before ending anyone when the raise would fail anyway.
        PERFORM fence.refuse_prepared(p_resource, p_token);
        -- Signal all first, then poll: ending 100 backends takes the time of the slowest, not
        -- the sum. pg_terminate_backend raises an error when the owner may not signal one:
        -- the raise then fails, nothing raised.
        PERFORM pg_terminate_backend(v) FROM unnest(victims) AS v;
        LOOP
            PERFORM pg_stat_clear_snapshot();
            SELECT array_agg(b.pid ORDER BY b.pid) INTO alive
            FROM fence.bindings AS b
            JOIN pg_stat_get_activity(NULL) AS a ON a.pid = b.pid
                AND (a.backend_start = b.backend_start OR a.backend_start IS NULL)
            WHERE b.resource = p_resource AND b.token < p_token;
            EXIT WHEN alive IS NULL;
            IF clock_timestamp() > deadline THEN
                -- What each one is doing: a backend busy in code that does not check for
                -- interrupts (libxml2's XPath evaluation) exits only when that call returns.
                SELECT string_agg(format('pid %s (state %s, wait_event %s, statement running for %s: %s)',
                                         a.pid, coalesce(a.state, 'unknown'),
                                         coalesce(a.wait_event_type || ':' || a.wait_event, 'none'),
                                         coalesce(date_trunc('second', clock_timestamp() - a.query_start)::text, 'unknown'),
                                         left(coalesce(a.query, ''), 80)), '; ' ORDER BY a.pid)
                INTO busy
                FROM pg_stat_get_activity(NULL) AS a WHERE a.pid = ANY (alive);
                RAISE EXCEPTION USING
                    ERRCODE = 'ZF011',
                    MESSAGE = format('fencing raise failed: resource "%s" was not raised to token %s because backends bound to a lower token did not exit within %s: pids %s',
                                     p_resource, p_token, p_timeout, array_to_string(alive, ', ')),
                    DETAIL = format('Nothing was raised; the stale sessions were signalled to terminate. Still running: %s.', coalesce(busy, 'none')),
                    HINT = 'A backend busy inside a call that ignores termination (such as an XPath evaluation) exits when that call returns (this raise never commits before it has): retry once it has exited, and the raise succeeds. pg_cancel_backend does not stop such a call either; killing the backend process (SIGKILL) ends it at once but restarts the whole server.';
            END IF;
            PERFORM pg_sleep(0.001);
        END LOOP;
    END IF;

    -- Every backend bound to R that is not alive any more, lower token or not, leaves.
    PERFORM pg_stat_clear_snapshot();
    PERFORM fence.forget_exited(p_resource);

    -- (P4) After (P2): no stale backend is left to prepare a transaction.
    PERFORM fence.refuse_prepared(p_resource, p_token);
    RETURN coalesce(cardinality(victims), 0);
END
$fn$;
REVOKE ALL ON FUNCTION fence.end_stale(text, bigint, interval) FROM PUBLIC;
