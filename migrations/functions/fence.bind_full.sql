-- fence.bind_full(resource, token, proof): fence.bind's every path but the common one (see
-- fence.bind): the raise of a higher token, each refusal with its own error, the first bind of a
-- resource, a pid of a previous backend's binding and the sweep of exited backends' bindings.
-- Binds the calling backend to (resource, token), raising the stored token first when token is
-- higher (ending the backends bound to lower ones). Returns the stored token. Refuses (and so
-- binds nothing) with ZF001 when a higher token is stored (P3), ZF008 when this backend is bound
-- already, ZF010 without the proxy's proof (P5). For a resource with a lease row it refuses,
-- before anything is raised, a token no acquisition issued (ZF002) and the generation of a lease
-- that expired or was released (ZF006) (L6). A bind that raises commits with synchronous_commit
-- on (D1); one that raises nothing does not wait for the WAL flush, unless synchronous standbys
-- are configured (D3). Called by fence.bind only: not granted to PUBLIC.
CREATE OR REPLACE FUNCTION fence.bind_full(resource text, token bigint, proof text)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    p_resource ALIAS FOR $1;
    p_token    ALIAS FOR $2;
    p_proof    ALIAS FOR $3;
    me         integer := pg_backend_pid();
    expected   text;
    started    timestamptz;
    stored     bigint;
    bound      text;
    lease_gen  bigint;
    lease_live boolean;
BEGIN
    -- The expected proof, this backend's start, the stored token (unlocked: it only chooses
    -- the lock below) and this backend's binding, if any.
    SELECT fence.mac(k.key, 'bind', p_resource, p_token, me), a.backend_start,
           (SELECT t.token FROM fence.tokens AS t WHERE t.resource = p_resource),
           (SELECT pg_catalog.format('resource "%s" token %s', b.resource, b.token)
            FROM fence.bindings AS b WHERE b.pid = me AND b.backend_start = a.backend_start),
           l.generation, l.holder IS NOT NULL AND l.expires_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()
    INTO expected, started, stored, bound, lease_gen, lease_live
    FROM pg_stat_get_activity(me) AS a LEFT JOIN fence.keys AS k ON k.id = 1
    LEFT JOIN fence.leases AS l ON l.resource = p_resource;
    IF expected IS NULL OR p_proof IS DISTINCT FROM expected OR started IS NULL
       OR p_token IS NULL OR p_token <= 0 OR p_resource IS NULL OR p_resource !~ '^[a-z][a-z0-9_.-]{0,62}$'
       OR current_setting('transaction_isolation') <> 'read committed' THEN
        -- (P5) Raises the error that applies (malformed, isolation, no key, wrong proof).
        PERFORM fence.verify('bind', p_resource, p_token, p_proof);
        RAISE EXCEPTION USING
            ERRCODE = 'ZF007',
            MESSAGE = 'fencing unavailable: the bind cannot read this backend''s backend_start',
            HINT = 'The fence schema''s owner needs pg_read_all_stats (README: Privileges).';
    END IF;
    IF bound IS NOT NULL THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF008',
            MESSAGE = format('not allowed in a fenced session: this session is bound to %s already; a session is bound once', bound),
            HINT = 'Reconnect with the new token.';
    END IF;

    -- (L6) A resource with a lease row admits only what its acquisitions issued: never a token
    -- above the generation, and the current generation only while its lease is held. Checked
    -- before anything is raised. A lower token is refused below (ZF001): every acquisition
    -- raised its generation (L2).
    IF lease_gen IS NOT NULL AND p_token > lease_gen THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF002',
            MESSAGE = format('fencing token not issued: resource "%s" token %s is higher than the lease''s current generation %s',
                             p_resource, p_token, lease_gen),
            HINT = 'Use the generation fence.lease_acquire returned (fenceproxy lock --store postgres passes it as FENCE_TOKEN).';
    END IF;
    IF lease_gen IS NOT NULL AND p_token = lease_gen AND NOT lease_live THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF006',
            MESSAGE = format('fencing lock not held: the lease of resource "%s" (generation %s) expired or was released',
                             p_resource, p_token),
            HINT = 'This process is no longer the leader: acquire the lease again and use the new generation.';
    END IF;

    IF stored IS NULL OR stored < p_token THEN
        stored := fence.raise_locked(p_resource, p_token); -- (P1) FOR UPDATE
    ELSE
        -- (P1) FOR SHARE: waits for a raise in flight, then reads its token.
        SELECT t.token INTO STRICT stored FROM fence.tokens AS t WHERE t.resource = p_resource FOR SHARE;
        IF stored < p_token THEN
            -- Lowered by fence.reset since the first read: raise after all.
            stored := fence.raise_locked(p_resource, p_token);
        ELSE
            -- Nothing durable changes (the binding is unlogged, the row lock matters only
            -- until commit): no need to wait for the WAL flush. Unless something earlier in
            -- this transaction must be durable (D1: fence.consul_admit's record, in the same
            -- statement as this bind); a raise commits with synchronous_commit on (D1).
            -- (D3) Nor with synchronous standbys: a raise whose wait for them was cancelled
            -- (a client's or an administrator's cancel, the proxy's login timeout) is
            -- committed here and visible, yet not on the standbys a failover promotes; this
            -- bind then commits durably too, and its commit, after the raise's in the WAL,
            -- returns only once the standbys have both (the proxy refuses a session whose
            -- bind's commit wait was cancelled in turn: its WARNING).
            IF current_setting('synchronous_standby_names') <> '' THEN
                PERFORM fence.commit_durably();
            ELSIF current_setting('fence.commit_durably', true) IS DISTINCT FROM 'on' THEN
                PERFORM set_config('synchronous_commit', 'off', true);
            END IF;
        END IF;
    END IF;
    IF stored > p_token THEN -- (P3)
        RAISE EXCEPTION USING
            ERRCODE = 'ZF001',
            MESSAGE = format('stale fencing token: resource "%s" token %s is lower than the highest admitted token %s',
                             p_resource, p_token, stored),
            HINT = format('This process is no longer the leader for "%s": stop writing, acquire the lock again to get a new fencing token, and reconnect with it.',
                          p_resource);
    END IF;

    -- Rows of an earlier backend with this pid go: it has exited (pids are unique among live
    -- backends).
    WITH gone AS (DELETE FROM fence.bindings AS b WHERE b.pid = me)
    INSERT INTO fence.bindings (pid, backend_start, resource, token) VALUES (me, started, p_resource, p_token);
    -- Rows of exited backends whose pid is not reused stay until a raise; one bind in 64 (by
    -- pid) removes those of its resource, so that a leader that keeps its token for weeks of
    -- reconnections does not grow the table with the pid space.
    IF me % 64 = 0 THEN
        PERFORM fence.forget_exited(p_resource);
    END IF;
    RETURN stored;
END
$fn$;
REVOKE ALL ON FUNCTION fence.bind_full(text, bigint, text) FROM PUBLIC;
