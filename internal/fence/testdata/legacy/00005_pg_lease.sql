-- Version 5 of the fence schema: a lease per resource in the protected database itself, so that
-- fencing needs no service but PostgreSQL (`fenceproxy lock --store postgres`).
--
--   fence.leases         one row per resource: holder, expires_at, generation.
--   fence.lease_acquire  takes the lease when it is free, expired or already ours, increments the
--                        generation in the same UPDATE, and admits it (fence.raise_locked) in the
--                        same transaction. The generation is the fencing token.
--   fence.lease_renew    moves expires_at on, for the holder of the current generation only.
--   fence.lease_release  frees the lease, for the holder of the current generation only.
--   fence.bind           (replaced) also refuses, for a resource that has a lease row, a token
--                        no acquisition issued (ZF002) and the token of a lease that expired
--                        or was released (ZF006).
--
-- Fencing itself (version 4's bind and raise, P1-P7) does not depend on the lease being right:
-- even two processes that both believe they hold it cannot both commit after the later one's
-- token is admitted. What the lease must give is tokens that mean something: each generation
-- held by one process only, generations that only grow, and no way to obtain one except by
-- winning the lease. The proof obligations, each discharged by the code marked with its number:
--
--  (L1) One generation, one holder. Every acquisition sets the holder and increments the
--       generation in ONE conditional UPDATE of the resource's row, whose WHERE admits only a
--       lease that is free, expired or already held by the caller. Concurrent acquisitions of
--       one row serialize on its row lock; under READ COMMITTED the one that waited re-evaluates
--       the WHERE on the row the winner committed (which is held and unexpired: no update), under
--       REPEATABLE READ or SERIALIZABLE it fails with a serialization error. Either way a
--       generation is returned to one caller only. Re-acquiring by the same holder also
--       increments it (as Consul's LockIndex does): a holder name reused by a second process (a
--       restarted one) never shares a token with the first.
--  (L2) Generations only grow, and past every token ever admitted for the resource: the new
--       generation is greatest(generation, stored token) + 1, so a resource that was led through
--       another store before (Consul's LockIndex 34) goes on at 35, never below. The acquire
--       admits its generation (fence.raise_locked: P1-P7) in the same transaction: when it
--       commits, every backend bound to an older token has exited and no older token can be
--       bound. If the raise fails (ZF011) or stores another token, the acquire fails and grants
--       nothing.
--  (L3) Expiry is decided by the database's clock: expires_at is set from clock_timestamp() on
--       the server and compared with clock_timestamp() on the server; a client sends a duration
--       (ttl), never a time. A holder counts its lease lost ttl after it SENT the request that
--       set expires_at, which is before the server's expires_at when the two clocks tick at the
--       same rate (their offset does not matter).
--  (L4) Only the holder of the current generation renews or releases, and renewing needs an
--       unexpired lease: an expired holder must acquire again and gets a new generation, so it
--       can never extend a lease another process may have taken over in between.
--  (L5) Nobody forges a generation, and client SQL does not move the stored token.
--       fence.leases is written only by these SECURITY DEFINER functions (no INSERT, UPDATE,
--       DELETE or TRUNCATE privilege is granted; SELECT is, like fence.tokens), whose
--       search_path is pinned and whose every name is schema-qualified. They are not executable
--       by PUBLIC: an acquisition raises the stored token (L2), so a role that may call
--       fence.lease_acquire could, whenever the lease is free, take it for up to a day and keep
--       every real leader out that long; or hold an acquisition's transaction open and stall
--       the resource's binds on its row locks. The operator grants EXECUTE to the role that
--       `fenceproxy lock --store postgres` logs in as, never to application roles. Even that
--       role moves a generation only by one, only by winning the lease, and only for itself.
--       The TTL is bounded (1 s to 24 h).
--  (L6) A token no acquisition issued is never admitted: fence.bind refuses a token above the
--       lease's generation (ZF002) before anything is raised, so a client that makes up a
--       token through the proxy cannot raise the stored token and lock every real leader out.
--       It also refuses the current generation once its lease expired or was released (ZF006):
--       a holder that lost its lease starts no new session. Sessions bound before the expiry go
--       on until a takeover's raise ends them (L2). Resources without a lease row (Consul's) are
--       checked as before.
--
-- Who may campaign: the roles granted EXECUTE on the three lease functions (L5), e.g.
--   GRANT EXECUTE ON FUNCTION fence.lease_acquire(text, text, interval),
--       fence.lease_renew(text, text, bigint, interval), fence.lease_release(text, text, bigint)
--       TO billing_lock;
-- The holder name is not a secret: such a role can release or renew a lease in another
-- holder's name, which forces a failover (a higher generation, the old holder fenced) but never
-- lets two holders share a token.

-- +goose Up

-- One row per resource that was ever leased. holder and expires_at are NULL when free; the
-- generation stays across releases and expiries (L2).
CREATE TABLE fence.leases (
    resource    text COLLATE "C" NOT NULL,
    holder      text,
    generation  bigint           NOT NULL DEFAULT 0,
    expires_at  timestamptz,
    acquired_at timestamptz,
    renewed_at  timestamptz,
    CONSTRAINT leases_pkey PRIMARY KEY (resource),
    CONSTRAINT leases_resource_valid CHECK (resource ~ '^[a-z][a-z0-9_.-]{0,62}$'),
    CONSTRAINT leases_generation_nonnegative CHECK (generation >= 0),
    CONSTRAINT leases_held_or_free CHECK ((holder IS NULL) = (expires_at IS NULL))
);
COMMENT ON TABLE fence.leases IS
    'fenceproxy: one lease per resource (fenceproxy lock --store postgres); the generation is the fencing token; written only through fence.lease_acquire, fence.lease_renew and fence.lease_release';
REVOKE ALL ON TABLE fence.leases FROM PUBLIC; -- (L5)
GRANT SELECT ON TABLE fence.leases TO PUBLIC;

-- fence.check_lease_args(resource, holder, ttl): raises ZF004 for a malformed argument. Not
-- granted to PUBLIC.
-- +goose StatementBegin
CREATE FUNCTION fence.check_lease_args(resource text, holder text, ttl interval)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF $1 IS NULL OR $1 !~ '^[a-z][a-z0-9_.-]{0,62}$' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('malformed fencing resource name: %s', quote_nullable($1)),
            HINT = 'A resource name is 1 to 63 characters of a-z, 0-9, "_", "." and "-", starting with a letter.';
    END IF;
    IF $2 IS NULL OR $2 = '' OR length($2) > 200 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('malformed lease holder: %s (a holder is 1 to 200 characters)', quote_nullable($2));
    END IF;
    -- (L5) A lease held for ever would stop every failover; too short a one cannot be renewed.
    -- Only a time part: interval comparison counts a month as 30 days, but adding months and
    -- days to a timestamp follows the calendar, so '1200 mon -35999 days' compares equal to
    -- a day and expires about 525 days later.
    IF $3 IS NOT NULL AND ($3 < interval '1 second' OR $3 > interval '24 hours'
                           OR extract(year FROM $3) <> 0 OR extract(month FROM $3) <> 0
                           OR extract(day FROM $3) <> 0) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('malformed lease TTL: %s (a TTL is 1 second to 24 hours, in hours, minutes and seconds)', $3);
    END IF;
END
$fn$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fence.check_lease_args(text, text, interval) FROM PUBLIC;

-- fence.lease_acquire(resource, holder, ttl): takes the lease for holder when it is free, expired
-- or held by holder already (L1), with a new generation (L2) that it admits before it commits,
-- and an expiry ttl from now by the server's clock (L3). Returns one row: acquired, the
-- generation (the new one when acquired, the current one otherwise), the holder afterwards and
-- its expires_at. Run it in a transaction of its own (autocommit): the raise ends stale backends
-- and waits for them while it holds the resource's rows.
-- +goose StatementBegin
CREATE FUNCTION fence.lease_acquire(resource text, holder text, ttl interval)
RETURNS TABLE (acquired boolean, generation bigint, current_holder text, expires_at timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    p_resource ALIAS FOR $1;
    p_holder   ALIAS FOR $2;
    p_ttl      ALIAS FOR $3;
    stored     bigint;
BEGIN
    PERFORM fence.check_lease_args(p_resource, p_holder, coalesce(p_ttl, interval '0'));
    INSERT INTO fence.leases AS l (resource) VALUES (p_resource)
    ON CONFLICT ON CONSTRAINT leases_pkey DO NOTHING;

    -- (L1, L2, L3) The one conditional UPDATE that hands out a generation.
    UPDATE fence.leases AS l
    SET holder = p_holder,
        generation = GREATEST(l.generation,
            coalesce((SELECT t.token FROM fence.tokens AS t WHERE t.resource = p_resource), 0)) + 1,
        expires_at = pg_catalog.clock_timestamp() + p_ttl,
        acquired_at = pg_catalog.clock_timestamp(),
        renewed_at = pg_catalog.clock_timestamp()
    WHERE l.resource = p_resource
      AND (l.holder IS NULL OR l.expires_at <= pg_catalog.clock_timestamp() OR l.holder = p_holder)
    RETURNING true, l.generation, l.holder, l.expires_at
    INTO acquired, generation, current_holder, expires_at;

    IF NOT FOUND THEN
        SELECT false, l.generation, l.holder, l.expires_at INTO acquired, generation, current_holder, expires_at
        FROM fence.leases AS l WHERE l.resource = p_resource;
        RETURN NEXT;
        RETURN;
    END IF;

    -- (L2) Admit the generation now: ends the older holders' backends and waits until they have
    -- exited (or fails with ZF011, and so does the acquisition).
    stored := fence.raise_locked(p_resource, generation);
    IF stored IS DISTINCT FROM generation THEN
        -- A higher token was stored since the UPDATE read it (fence.reset, or another store
        -- leading the same resource): this generation would be stale on arrival.
        RAISE EXCEPTION USING
            ERRCODE = 'ZF007',
            MESSAGE = format('fencing unavailable: lease of resource "%s" not acquired: generation %s is not above the admitted token %s',
                             p_resource, generation, stored),
            HINT = 'Is the resource also led through another lock (Consul)? Lead each resource through one store.';
    END IF;
    RETURN NEXT;
END
$fn$;
-- +goose StatementEnd

-- fence.lease_renew(resource, holder, generation, ttl): sets expires_at to ttl from now (L3) when
-- holder holds generation and the lease has not expired (L4). Returns true when renewed, false
-- when the lease is lost (expired, released, taken over).
-- +goose StatementBegin
CREATE FUNCTION fence.lease_renew(resource text, holder text, generation bigint, ttl interval)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    PERFORM fence.check_lease_args($1, $2, coalesce($4, interval '0'));
    UPDATE fence.leases AS l
    SET expires_at = pg_catalog.clock_timestamp() + $4, renewed_at = pg_catalog.clock_timestamp()
    WHERE l.resource = $1 AND l.holder = $2 AND l.generation = $3
      AND l.expires_at > pg_catalog.clock_timestamp();
    RETURN FOUND;
END
$fn$;
-- +goose StatementEnd

-- fence.lease_release(resource, holder, generation): frees the lease when holder holds
-- generation (L4); the generation stays (L2). Returns true when released, false when it was not
-- held by holder with generation (lost already). An expired lease that nobody took over is
-- released as well.
-- +goose StatementBegin
CREATE FUNCTION fence.lease_release(resource text, holder text, generation bigint)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    PERFORM fence.check_lease_args($1, $2, NULL);
    UPDATE fence.leases AS l
    SET holder = NULL, expires_at = NULL
    WHERE l.resource = $1 AND l.holder = $2 AND l.generation = $3;
    RETURN FOUND;
END
$fn$;
-- +goose StatementEnd

-- (L5) Only the roles an operator grants EXECUTE to may campaign.
REVOKE ALL ON FUNCTION fence.lease_acquire(text, text, interval), fence.lease_renew(text, text, bigint, interval),
    fence.lease_release(text, text, bigint) FROM PUBLIC;

-- fence.bind: version 4's, with the lease check (L6) before anything is raised. Its proof
-- obligations (P1-P7) are migration 4's.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.bind(resource text, token bigint, proof text)
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
    -- One statement for what the common case needs: the expected proof, this backend's
    -- start, the stored token (unlocked: it only chooses the lock below) and this backend's
    -- binding, if any. Every session start runs this, so it is kept to few statements.
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
            -- until commit): no need to wait for the WAL flush. A raise, which stores a
            -- token, keeps synchronous_commit as the session has it.
            PERFORM set_config('synchronous_commit', 'off', true);
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
-- +goose StatementEnd

-- CREATE OR REPLACE keeps fence.bind's comment and privileges (EXECUTE to PUBLIC).

-- +goose Down

-- Version 4's fence.bind, without the lease check; then the lease objects go. Tokens admitted
-- through leases stay in fence.tokens.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.bind(resource text, token bigint, proof text)
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
BEGIN
    -- One statement for what the common case needs: the expected proof, this backend's
    -- start, the stored token (unlocked: it only chooses the lock below) and this backend's
    -- binding, if any. Every session start runs this, so it is kept to few statements.
    SELECT fence.mac(k.key, 'bind', p_resource, p_token, me), a.backend_start,
           (SELECT t.token FROM fence.tokens AS t WHERE t.resource = p_resource),
           (SELECT pg_catalog.format('resource "%s" token %s', b.resource, b.token)
            FROM fence.bindings AS b WHERE b.pid = me AND b.backend_start = a.backend_start)
    INTO expected, started, stored, bound
    FROM pg_stat_get_activity(me) AS a LEFT JOIN fence.keys AS k ON k.id = 1;
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
            -- until commit): no need to wait for the WAL flush. A raise, which stores a
            -- token, keeps synchronous_commit as the session has it.
            PERFORM set_config('synchronous_commit', 'off', true);
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
-- +goose StatementEnd
DROP FUNCTION fence.lease_acquire(text, text, interval);
DROP FUNCTION fence.lease_renew(text, text, bigint, interval);
DROP FUNCTION fence.lease_release(text, text, bigint);
DROP FUNCTION fence.check_lease_args(text, text, interval);
DROP TABLE fence.leases;
