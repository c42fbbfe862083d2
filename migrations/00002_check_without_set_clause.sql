-- fence.check and fence.check_readonly run at the commit point of every fenced transaction, so
-- their cost is on the hot path. Version 1 pinned search_path with a SET clause, as every
-- SECURITY DEFINER function should unless it resolves nothing through search_path. Measured on
-- PostgreSQL 15 (pgbench, tpcb-like without branch updates, 8 clients, the check before END;
-- see bench/ and docs/BENCHMARKS.md): the SET clause cost about 7% of throughput, the check
-- itself (xid test, FOR SHARE) about 2%. A SET clause saves and restores the setting and
-- recomputes the active search path on every call.
--
-- So these two functions now resolve nothing through search_path instead: every table, function
-- and operator is schema-qualified (OPERATOR(pg_catalog.>)), casts name pg_catalog types, and
-- variables are declared with SQL keywords (bigint), which never depend on search_path. A
-- caller's search_path (even one that puts its own schema before pg_catalog, or pg_temp first)
-- cannot change what they run; test/sql/40_grants.sql proves it with hostile operators.
-- fence.raise and fence.reset keep their SET clause: they are not on the hot path.
--
-- The proof obligations of version 1 are unchanged (see 00001_fence_schema.sql).

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
        SELECT t.token INTO stored
        FROM fence.tokens AS t
        WHERE t.resource OPERATOR(pg_catalog.=) p_resource
        FOR SHARE;
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

-- +goose Down

ALTER FUNCTION fence.check(text, bigint) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION fence.check_readonly() SET search_path = pg_catalog, pg_temp;
