-- Version 9 of the fence schema: the words of the lock services, and the last generation.
--
--   fence.holder_words   (new) how a holder recorded in fence.consul_tokens is named: the etcd
--                        and ZooKeeper guards record "etcd lease <id>" and "zookeeper session
--                        <id>", Consul's guard a bare session ID.
--   fence.consul_admit   (replaced) version 8's; a regression's text names the service that
--                        issued the number twice and its holders (it said "Consul session" for
--                        etcd's leases and ZooKeeper's sessions too).
--   fence.record_raise   (replaced) version 8's; the history's holder of a token admitted on a
--                        lock service's word through fence.holder_words (etcd's leases were
--                        recorded as "consul session etcd lease <id>").
--   fence.lease_acquire  (replaced) version 8's; refuses (ZF004) to take a lease when no higher
--                        generation exists (the stored token or generation is the largest
--                        bigint), where it failed with a bare "bigint out of range".
--
-- The obligations of versions 4 to 8 are kept; these change only words and one refusal:
--
--  (W1) A holder is named by its service: fence.holder_words(h) is h itself when it starts
--       with "etcd lease " or "zookeeper session ", and "consul session " || h otherwise; the
--       service is the first word of that name. The record's holder values are unchanged, so
--       every comparison of versions 7 and 8 (C1-C5) reads the same rows as before.
--  (L9) A lease generation is a bigint above the stored token and every earlier generation
--       (L2, L3): when either is 9223372036854775807 there is none, and fence.lease_acquire
--       refuses (ZF004, as L8: a refusal retrying cannot change, so fenceproxy lock stops with
--       it) before its UPDATE rather than overflow inside it. The operator's way out is
--       fence.reset to a lower token, with every holder stopped.

-- +goose Up

-- +goose StatementBegin
CREATE FUNCTION fence.holder_words(holder text)
RETURNS text
LANGUAGE sql
IMMUTABLE
STRICT
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT CASE WHEN $1 LIKE 'etcd lease %' OR $1 LIKE 'zookeeper session %' THEN $1
                ELSE 'consul session ' OPERATOR(pg_catalog.||) $1 END
$fn$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fence.holder_words(text) FROM PUBLIC;
COMMENT ON FUNCTION fence.holder_words(text) IS
    'fenceproxy: the name of a holder recorded in fence.consul_tokens, with its service (W1)';

-- fence.consul_admit: version 8's, with a regression text in its service's words (W1).
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
    service    text;
BEGIN
    PERFORM fence.verify('consul', p_resource, p_token, proof); -- (C4)
    IF p_holder IS NULL OR p_holder = '' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = 'malformed fencing holder: fence.consul_admit needs the session that holds the lock';
    END IF;
    -- (C5) The shared path of the recorded holder, as in version 8.
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
        service := CASE split_part(fence.holder_words(p_holder), ' ', 1)
                       WHEN 'etcd' THEN 'etcd' WHEN 'zookeeper' THEN 'ZooKeeper' ELSE 'Consul' END; -- (W1)
        cur.regression := format('token %s was admitted for %s and is now held by %s: '
                                 '%s issued the number twice (its sequence went back and came up again)',
                                 p_token, fence.holder_words(cur.holder), fence.holder_words(p_holder), service);
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

-- fence.record_raise: version 8's, naming a lock service's holder through fence.holder_words (W1).
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
                        (SELECT fence.holder_words(c.holder) FROM fence.consul_tokens AS c
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

-- fence.lease_acquire: version 8's, refusing when no higher generation exists (L9).
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

    -- (L9) No generation above the largest bigint.
    IF GREATEST((SELECT l.generation FROM fence.leases AS l WHERE l.resource = p_resource),
                (SELECT t.token FROM fence.tokens AS t WHERE t.resource = p_resource)) = 9223372036854775807 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('fencing lease refused: resource "%s" has token or generation 9223372036854775807, the largest a token can be, so no higher generation exists',
                             p_resource),
            HINT = 'Stop every holder of the resource, then lower its token with fenceproxy fence reset --force.';
    END IF;

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

-- +goose Down

-- Version 8's bodies again, then fence.holder_words goes.
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

DROP FUNCTION fence.holder_words(text);
