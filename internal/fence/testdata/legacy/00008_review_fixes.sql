-- Version 8 of the fence schema: the findings of a review of versions 5 to 7.
--
--   fence.consul_admit    (replaced) a token recorded for one Consul session and now shown held by
--                         another is a regression, as in version 7 (C2), and now also deposes
--                         its first holder: the backends bound to it are ended before the
--                         regression commits (C5). The proxy now calls it on every session's
--                         own connection, in the bind's transaction (the protected database
--                         always has the record, with or without --control-database), and
--                         admissions of the recorded holder share the row instead of queueing
--                         on it.
--   fence.consul_depose   (new) ends the backends bound to a resource's token and those below.
--   fence.lease_acquire   (replaced) takes a lease only when it is free or expired (L1'): the
--                         holder's name is not a secret, so "already ours" let the lock role
--                         take the current holder's lease at once by naming it.
--   fence.check_lease_args (replaced) refuses control characters in holder names (they reached
--                         terminals through `fenceproxy fence history`).
--   fence.record_raise    (replaced) records the Consul session of a token a proxy admitted on
--                         Consul's word (fence.consul_tokens), when no lease holder is known.
--
-- The obligations of versions 4 to 7 (P1-P7, L1-L6, H1-H2, C1-C4) are kept. The new ones:
--
--  (C5) One token, one holder, also in time: when consul_admit finds the recorded token held by
--       another session, it locks the resource's row of fence.tokens FOR UPDATE (P1: no bind
--       commits meanwhile) and ends every live backend bound to that token or a lower one
--       (fence.end_stale, P2), in the transaction that records the regression. Binds of a
--       Consul-validated token run consul_admit first in their own transaction, which holds the
--       consul_tokens row (FOR SHARE when the record admits them, FOR UPDATE when it changes),
--       so a bind of the first holder either committed before the deposition (and is ended by
--       it) or runs after it (and is refused by the regression, C1). Without this, Consul
--       handing one create-lock token to a second session (a transaction that writes the held
--       key, unlocks it and locks it for another session: LockIndex back to 0, then 1 again)
--       left the first holder's open transaction free to commit after the second's writes.
--  (L1') A lease is won only by winning it: fence.lease_acquire updates a lease that is free or
--       expired, never one held (by the caller's name or another). A holder extends its lease
--       with fence.lease_renew; a restarted process waits for its old lease to expire, or is
--       given a new name (fenceproxy lock draws one per campaign).
--  (L7)  A holder name is printable: no control characters (ZF004), so that what the history
--       shows an operator is what was written.
--  (L8)  No lease on a resource whose tokens a lock service issues: fence.lease_acquire refuses
--       (ZF004) a resource with a row in fence.consul_tokens (a proxy admitted a token of it on
--       Consul's, etcd's or ZooKeeper's word). A review's lock role took such a lease, and the
--       lease row then refused every holder of the real lock (ZF006) until a superuser deleted
--       it. fence.reset forgets the record: the operator's way to move a resource to the lease.

-- +goose Up

-- fence.consul_depose(resource, token): (C5) ends every live backend bound to resource with
-- token or a lower one, holding resource's row of fence.tokens FOR UPDATE until the caller
-- commits. Returns how many it ended. Not granted to PUBLIC.
-- +goose StatementBegin
CREATE FUNCTION fence.consul_depose(resource text, token bigint)
RETURNS integer
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    INSERT INTO fence.tokens AS t (resource, token) VALUES ($1, 0)
    ON CONFLICT ON CONSTRAINT tokens_pkey DO NOTHING;
    PERFORM 1 FROM fence.tokens AS t WHERE t.resource = $1 FOR UPDATE; -- (P1)
    RETURN fence.end_stale($1, $2 + 1, interval '5 seconds'); -- (P2): bound to token or lower
END
$fn$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fence.consul_depose(text, bigint) FROM PUBLIC;

-- fence.consul_admit: version 7's, with the share lock for the recorded holder and the
-- deposition (C5). CREATE OR REPLACE keeps its comment and privileges.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.consul_admit(resource text, token bigint, holder text, proof text,
                                              OUT recorded bigint, OUT recorded_holder text, OUT regression text)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    p_resource ALIAS FOR $1;
    p_token    ALIAS FOR $2;
    p_holder   ALIAS FOR $3;
    cur        fence.consul_tokens%ROWTYPE;
BEGIN
    PERFORM fence.verify('consul', p_resource, p_token, proof); -- (C4)
    IF p_holder IS NULL OR p_holder = '' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = 'malformed fencing holder: fence.consul_admit needs the Consul session that holds the lock';
    END IF;
    -- (C5) Every session start of the current holder comes here: a share lock, so that they do
    -- not queue on each other, and a deposition (FOR UPDATE below) waits for those in flight.
    -- Under the share lock the row can only have been deleted (fence.reset) or not match any
    -- more; either way the exclusive path below decides.
    SELECT c.* INTO cur FROM fence.consul_tokens AS c WHERE c.resource = p_resource;
    IF FOUND AND cur.regression IS NULL AND cur.token = p_token AND cur.holder = p_holder THEN
        SELECT c.* INTO cur FROM fence.consul_tokens AS c WHERE c.resource = p_resource FOR SHARE;
        IF FOUND AND (cur.regression IS NOT NULL OR cur.token > p_token
                      OR (cur.token = p_token AND cur.holder = p_holder)) THEN
            recorded := cur.token; -- nothing to write: admitted, or answered (C1, C3)
            recorded_holder := cur.holder;
            regression := cur.regression;
            RETURN;
        END IF;
    END IF;
    INSERT INTO fence.consul_tokens AS c (resource) VALUES (p_resource)
    ON CONFLICT ON CONSTRAINT consul_tokens_pkey DO NOTHING;
    SELECT c.* INTO STRICT cur FROM fence.consul_tokens AS c WHERE c.resource = p_resource FOR UPDATE; -- (C2)
    IF cur.regression IS NULL AND p_token = cur.token AND p_holder <> cur.holder THEN -- (C2)
        cur.regression := format('token %s was admitted for Consul session %s and is now held by session %s: '
                                 'Consul issued the number twice (its sequence went back and came up again)',
                                 p_token, cur.holder, p_holder);
        UPDATE fence.consul_tokens AS c SET regression = cur.regression, regressed_at = now(), updated_at = now()
        WHERE c.resource = p_resource;
        PERFORM fence.consul_depose(p_resource, p_token); -- (C5)
    ELSIF cur.regression IS NULL AND p_token > cur.token THEN -- (C3)
        cur.token := p_token;
        cur.holder := p_holder;
        UPDATE fence.consul_tokens AS c SET token = p_token, holder = p_holder, updated_at = now()
        WHERE c.resource = p_resource;
    END IF;
    recorded := cur.token;
    recorded_holder := cur.holder;
    regression := cur.regression; -- (C1)
END
$fn$;
-- +goose StatementEnd

-- fence.check_lease_args: version 5's, refusing control characters in a holder name (L7).
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.check_lease_args(resource text, holder text, ttl interval)
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
    IF $2 IS NULL OR $2 = '' OR length($2) > 200 OR $2 ~ '[[:cntrl:]]' THEN -- (L7)
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('malformed lease holder: %s (a holder is 1 to 200 characters, none of them control characters)',
                             quote_nullable(pg_catalog.regexp_replace($2, '[[:cntrl:]]', '?', 'g')));
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

-- fence.lease_acquire: version 5's, taking only a free or expired lease (L1').
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.lease_acquire(resource text, holder text, ttl interval)
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
    -- (L8) No lease on a resource whose tokens a lock service issues.
    IF EXISTS (SELECT 1 FROM fence.consul_tokens AS c WHERE c.resource = p_resource) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('fencing lease refused: resource "%s" is led through a lock service (Consul, etcd or ZooKeeper: fence.consul_tokens records its holders)', p_resource),
            HINT = 'Take the lock from that service. To lead the resource through the PostgreSQL lease instead, stop its lock holders and run fenceproxy fence reset first.';
    END IF;
    INSERT INTO fence.leases AS l (resource) VALUES (p_resource)
    ON CONFLICT ON CONSTRAINT leases_pkey DO NOTHING;

    -- (L1', L2, L3) The one conditional UPDATE that hands out a generation.
    UPDATE fence.leases AS l
    SET holder = p_holder,
        generation = GREATEST(l.generation,
            coalesce((SELECT t.token FROM fence.tokens AS t WHERE t.resource = p_resource), 0)) + 1,
        expires_at = pg_catalog.clock_timestamp() + p_ttl,
        acquired_at = pg_catalog.clock_timestamp(),
        renewed_at = pg_catalog.clock_timestamp()
    WHERE l.resource = p_resource
      AND (l.holder IS NULL OR l.expires_at <= pg_catalog.clock_timestamp())
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

-- fence.record_raise: version 6's, with the Consul session as the holder when no lease holder
-- is known (H1, H2 unchanged).
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.record_raise(resource text, previous bigint, token bigint, reset boolean)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    BEGIN
        INSERT INTO fence.history (resource, token, previous, holder, reset, raised_at, role, application_name, client_addr, pid)
        SELECT $1, $3, $2,
               coalesce((SELECT l.holder FROM fence.leases AS l WHERE l.resource = $1 AND l.generation = $3),
                        (SELECT 'consul session ' OPERATOR(pg_catalog.||) c.holder FROM fence.consul_tokens AS c
                         WHERE c.resource = $1 AND c.token = $3 AND c.holder <> '')),
               $4, pg_catalog.clock_timestamp(), session_user,
               NULLIF(pg_catalog.current_setting('application_name'), ''),
               pg_catalog.inet_client_addr(), pg_catalog.pg_backend_pid();
    EXCEPTION WHEN OTHERS THEN
        RAISE WARNING 'fenceproxy: raise of resource "%" to token % not recorded in fence.history: % (SQLSTATE %)',
            $1, $3, SQLERRM, SQLSTATE;
    END;
END
$fn$;
-- +goose StatementEnd

-- +goose Down

-- Versions 5, 6 and 7's functions again, then the deposition goes.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.record_raise(resource text, previous bigint, token bigint, reset boolean)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    BEGIN
        INSERT INTO fence.history (resource, token, previous, holder, reset, raised_at, role, application_name, client_addr, pid)
        SELECT $1, $3, $2,
               (SELECT l.holder FROM fence.leases AS l WHERE l.resource = $1 AND l.generation = $3),
               $4, pg_catalog.clock_timestamp(), session_user,
               NULLIF(pg_catalog.current_setting('application_name'), ''),
               pg_catalog.inet_client_addr(), pg_catalog.pg_backend_pid();
    EXCEPTION WHEN OTHERS THEN
        RAISE WARNING 'fenceproxy: raise of resource "%" to token % not recorded in fence.history: % (SQLSTATE %)',
            $1, $3, SQLERRM, SQLSTATE;
    END;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.lease_acquire(resource text, holder text, ttl interval)
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

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.check_lease_args(resource text, holder text, ttl interval)
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

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.consul_admit(resource text, token bigint, holder text, proof text,
                                              OUT recorded bigint, OUT recorded_holder text, OUT regression text)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    p_resource ALIAS FOR $1;
    p_token    ALIAS FOR $2;
    p_holder   ALIAS FOR $3;
    cur        fence.consul_tokens%ROWTYPE;
BEGIN
    PERFORM fence.verify('consul', p_resource, p_token, proof); -- (C4)
    IF p_holder IS NULL OR p_holder = '' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = 'malformed fencing holder: fence.consul_admit needs the Consul session that holds the lock';
    END IF;
    INSERT INTO fence.consul_tokens AS c (resource) VALUES (p_resource)
    ON CONFLICT ON CONSTRAINT consul_tokens_pkey DO NOTHING;
    SELECT c.* INTO STRICT cur FROM fence.consul_tokens AS c WHERE c.resource = p_resource FOR UPDATE; -- (C2)
    IF cur.regression IS NULL AND p_token = cur.token AND p_holder <> cur.holder THEN -- (C2)
        cur.regression := format('token %s was admitted for Consul session %s and is now held by session %s: '
                                 'Consul issued the number twice (its sequence went back and came up again)',
                                 p_token, cur.holder, p_holder);
        UPDATE fence.consul_tokens AS c SET regression = cur.regression, regressed_at = now(), updated_at = now()
        WHERE c.resource = p_resource;
    ELSIF cur.regression IS NULL AND p_token > cur.token THEN -- (C3)
        cur.token := p_token;
        cur.holder := p_holder;
        UPDATE fence.consul_tokens AS c SET token = p_token, holder = p_holder, updated_at = now()
        WHERE c.resource = p_resource;
    END IF;
    recorded := cur.token;
    recorded_holder := cur.holder;
    regression := cur.regression; -- (C1)
END
$fn$;
-- +goose StatementEnd
DROP FUNCTION fence.consul_depose(text, bigint);
