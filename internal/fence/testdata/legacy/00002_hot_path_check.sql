-- The hot path: fence.check and fence.check_readonly run at the commit point of every fenced
-- transaction. Measured on PostgreSQL 15 (pgbench tpcb-like without branch updates, 8 clients,
-- 2 cores; bench/check-variants.sh, numbers in docs/BENCHMARKS.md), version 1 cost about a
-- fifth of write throughput, from three sources this version removes or reduces:
--
-- 1. The SET search_path clause (about 4 points): a SET clause saves and restores the setting and
--    recomputes the active search path on every call. check and check_readonly now resolve
--    nothing through search_path instead: every table, function and operator is
--    schema-qualified (OPERATOR(pg_catalog.>)), casts name pg_catalog types, and variables use
--    SQL keyword types (bigint). A caller's search_path (even one that puts its own schema
--    before pg_catalog) cannot change what they run; test/sql/40_grants.sql proves it with
--    hostile operators. raise and reset, not on the hot path, keep their SET clause.
-- 2. FOR SHARE on one hot row under READ COMMITTED (4-6 points with 8 writers): every check
--    dirtied the row's page, wrote a WAL record and, with concurrent writers, created a
--    MultiXact. Under READ COMMITTED the check now takes a shared transaction-level advisory
--    lock on the resource instead, and reads the token with a fresh snapshot; raise and reset
--    take the same lock exclusively. Proof obligations (the guarantee of version 1, kept):
--    * Ordering. The shared lock is held until the checked transaction ends, the exclusive one
--      until the raise ends, and PostgreSQL releases a transaction's locks only after its
--      commit is visible to new snapshots. So either the check locks first and the raise
--      waits until the checked transaction has committed (its commit precedes the admission
--      of the newer token), or the raise locks first and the check waits, then reads the
--      token with a snapshot taken after the lock was granted: it sees the raise and fails.
--    * Only at commit time. The lock is taken by the check, immediately before the commit,
--      never at the first write: a leader frozen in the middle of a transaction holds
--      nothing, and the new leader's raise does not wait for it.
--    * REPEATABLE READ and SERIALIZABLE read with the transaction's snapshot, which cannot see
--      a raise that committed after it: there the check keeps version 1's FOR SHARE, which
--      fails with serialization_failure (reported as ZF001) when the row changed after the
--      snapshot. raise still updates the row, so FOR SHARE conflicts with it as before.
--    * The key is the pair (1717919331, hashtext(resource)); 1717919331 is "fenc" in ASCII.
--      Two resources whose names hash alike share a lock: more waiting, never less ordering.
--      An application's own two-key advisory locks with that first key would interfere.
-- 3. Parsing and planning the check at every commit (proxy side, not in this file): the proxy
--    now PREPAREs the check once per session and EXECUTEs it.

-- +goose Up

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.check(resource text, token bigint)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
AS $fn$
DECLARE
    p_resource ALIAS FOR $1;
    p_token    ALIAS FOR $2;
    stored     bigint;
BEGIN
    -- First: a transaction without an xid wrote nothing (and FOR SHARE would assign one).
    IF pg_catalog.pg_current_xact_id_if_assigned() IS NULL THEN
        RETURN;
    END IF;

    IF p_token IS NULL OR p_token OPERATOR(pg_catalog.<=) 0::bigint THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = pg_catalog.format('malformed fencing token: %s (a fencing token is an integer greater than 0)',
                                        pg_catalog.quote_nullable(p_token));
    END IF;
    IF p_resource IS NULL OR p_resource OPERATOR(pg_catalog.!~) '^[a-z][a-z0-9_.-]{0,62}$'::pg_catalog.text THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = pg_catalog.format('malformed fencing resource name: %s', pg_catalog.quote_nullable(p_resource));
    END IF;

    IF pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.=) 'read committed'::pg_catalog.text THEN
        -- Ordered against raise by the advisory lock (see the top of this file); the SELECT
        -- that follows takes its snapshot after the lock is granted.
        PERFORM pg_catalog.pg_advisory_xact_lock_shared(1717919331, pg_catalog.hashtext(p_resource));
        SELECT t.token INTO stored
        FROM fence.tokens AS t
        WHERE t.resource OPERATOR(pg_catalog.=) p_resource;
    ELSE
        BEGIN
            SELECT t.token INTO stored
            FROM fence.tokens AS t
            WHERE t.resource OPERATOR(pg_catalog.=) p_resource
            FOR SHARE;
        EXCEPTION WHEN serialization_failure THEN
            RAISE EXCEPTION USING
                ERRCODE = 'ZF001',
                MESSAGE = pg_catalog.format('stale fencing token: resource "%s" token %s was superseded by a token admitted while this transaction ran',
                                            p_resource, p_token),
                DETAIL = 'The transaction was rolled back; none of its changes were committed.',
                HINT = pg_catalog.format('This process is no longer the leader for "%s": stop writing, acquire the lock again to get a new fencing token, and reconnect with it.',
                                         p_resource);
        END;
    END IF;

    IF NOT FOUND THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF001',
            MESSAGE = pg_catalog.format('stale fencing token: resource "%s" token %s was not admitted (no token is stored for this resource)',
                                        p_resource, p_token),
            DETAIL = 'The transaction was rolled back; none of its changes were committed.',
            HINT = 'The token must be raised (fence.raise) before a session writes with it; reconnect through fenceproxy, which does so.';
    END IF;

    IF stored OPERATOR(pg_catalog.>) p_token THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF001',
            MESSAGE = pg_catalog.format('stale fencing token: resource "%s" token %s is lower than the highest admitted token %s',
                                        p_resource, p_token, stored),
            DETAIL = 'The transaction was rolled back; none of its changes were committed.',
            HINT = pg_catalog.format('This process is no longer the leader for "%s": stop writing, acquire the lock again to get a new fencing token, and reconnect with it.',
                                     p_resource);
    END IF;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.check_readonly()
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
AS $fn$
BEGIN
    IF pg_catalog.pg_current_xact_id_if_assigned() IS NOT NULL THEN
        RAISE EXCEPTION USING
            ERRCODE = '25006', -- read_only_sql_transaction
            MESSAGE = 'fenceproxy: this session is read-only (no fencing token); its transaction tried to write',
            DETAIL = 'The transaction was rolled back; none of its changes were committed.',
            HINT = 'Connect with a fencing token (the fence.token connection option) to write through fenceproxy.';
    END IF;
END
$fn$;
-- +goose StatementEnd

-- raise and reset take the resource's advisory lock exclusively before they touch its row, so
-- that READ COMMITTED checks are ordered against them (see the top of this file).
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.raise(resource text, token bigint)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    p_resource ALIAS FOR $1;
    p_token    ALIAS FOR $2;
    stored     bigint;
BEGIN
    IF p_token IS NULL OR p_token <= 0 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = pg_catalog.format('malformed fencing token: %s (a fencing token is an integer greater than 0)',
                                        coalesce(p_token::text, 'NULL')),
            HINT = 'Use the LockIndex of the Consul lock that this process holds.';
    END IF;
    IF p_resource IS NULL OR p_resource !~ '^[a-z][a-z0-9_.-]{0,62}$' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = pg_catalog.format('malformed fencing resource name: %s', pg_catalog.quote_nullable(p_resource)),
            HINT = 'A resource name is 1 to 63 characters of a-z, 0-9, "_", "." and "-", starting with a letter.';
    END IF;

    PERFORM pg_catalog.pg_advisory_xact_lock(1717919331, pg_catalog.hashtext(p_resource));

    INSERT INTO fence.tokens AS t (resource, token)
    VALUES (p_resource, p_token)
    ON CONFLICT ON CONSTRAINT tokens_pkey DO UPDATE
        SET token = excluded.token, updated_at = pg_catalog.now()
        WHERE t.token < excluded.token
    RETURNING t.token INTO stored;

    IF FOUND THEN
        PERFORM pg_catalog.pg_notify('fence_raise', p_resource || ' ' || p_token);
        RETURN stored;
    END IF;

    SELECT t.token INTO stored FROM fence.tokens AS t WHERE t.resource = p_resource;
    RETURN stored;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.reset(resource text, token bigint)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    p_resource ALIAS FOR $1;
    p_token    ALIAS FOR $2;
    previous   bigint;
BEGIN
    IF p_token IS NULL OR p_token < 0 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = pg_catalog.format('malformed fencing token: %s (fence.reset takes an integer of 0 or more)',
                                        coalesce(p_token::text, 'NULL'));
    END IF;
    IF p_resource IS NULL OR p_resource !~ '^[a-z][a-z0-9_.-]{0,62}$' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = pg_catalog.format('malformed fencing resource name: %s', pg_catalog.quote_nullable(p_resource));
    END IF;

    PERFORM pg_catalog.pg_advisory_xact_lock(1717919331, pg_catalog.hashtext(p_resource));

    SELECT t.token INTO previous FROM fence.tokens AS t WHERE t.resource = p_resource FOR UPDATE;

    INSERT INTO fence.tokens AS t (resource, token)
    VALUES (p_resource, p_token)
    ON CONFLICT ON CONSTRAINT tokens_pkey DO UPDATE
        SET token = excluded.token, updated_at = pg_catalog.now();

    PERFORM pg_catalog.pg_notify('fence_raise', p_resource || ' ' || p_token || ' reset');
    RETURN previous;
END
$fn$;
-- +goose StatementEnd

-- +goose Down

-- Puts the SET clauses back; the advisory-lock ordering stays (raise and check of this version
-- agree with each other, and version 1's checks under REPEATABLE READ are unchanged).

ALTER FUNCTION fence.check(text, bigint) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION fence.check_readonly() SET search_path = pg_catalog, pg_temp;
