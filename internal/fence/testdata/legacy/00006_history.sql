-- Version 6 of the fence schema: a durable history of the admitted tokens, written by the raise
-- itself, so that nothing that admits a token (a proxy's bind or raise, a PostgreSQL lease's
-- acquisition, an operator's fence.reset) can leave it out.
--
--   fence.history       one row per committed raise or reset: resource, token, the token
--                       before, the holder when known (the lease's holder for a token a lease
--                       acquisition admitted), when, and who raised it: the role, its
--                       application_name, client address and backend pid (for a bind or raise,
--                       the proxy's connection; for a lease, `fenceproxy lock`'s).
--   fence.record_raise  appends that row; fence.raise_locked and fence.reset (replaced, with
--                       one line added each) call it after they stored the token.
--
-- Versions 4 and 5's obligations (P1-P7, L1-L6) are kept: the two replaced functions are
-- version 4's, with the call added after the UPDATE of fence.tokens, while they hold the
-- resource's row lock and after the stale backends have exited. The history's own:
--
--  (H1) Recording never makes a raise fail, wait or change: fence.record_raise runs its INSERT
--       in a block that turns any error into a WARNING (the subtransaction rolls back, the raise
--       goes on), and nothing else can block it: a client with SELECT on fence.history may only
--       take ACCESS SHARE locks on it, which do not conflict with the INSERT's ROW EXCLUSIVE;
--       there is no unique key but the identity. Cancellation (query_canceled) is not caught,
--       as for the raise itself. A raise that rolls back takes its row with it: the history is
--       exactly the raises that committed.
--  (H2) No client writes the history: fence.history is written only by fence.record_raise, a
--       SECURITY DEFINER function with a pinned search_path and schema-qualified names, not
--       executable by PUBLIC, called only by the raise functions; no INSERT, UPDATE, DELETE or
--       TRUNCATE privilege on the table is granted (SELECT is, like fence.tokens). What a client
--       controls in a row (its application_name) is labelled as such.

-- +goose Up

CREATE TABLE fence.history (
    id               bigint GENERATED ALWAYS AS IDENTITY,
    resource         text NOT NULL,
    token            bigint NOT NULL,
    previous         bigint,          -- the token stored before (0 or NULL: none)
    holder           text,            -- the holder of token when known (a PostgreSQL lease's)
    reset            boolean NOT NULL, -- fence.reset (an operator), which may also lower it
    raised_at        timestamptz NOT NULL,
    role             name NOT NULL,   -- session_user of the raising backend
    application_name text,            -- that backend's application_name (its client's word)
    client_addr      inet,            -- that backend's client (NULL: a Unix socket)
    pid              integer NOT NULL,
    CONSTRAINT history_pkey PRIMARY KEY (id)
);
CREATE INDEX history_resource ON fence.history (resource, id);
COMMENT ON TABLE fence.history IS
    'fenceproxy: every committed raise and reset of a fencing token (fenceproxy fence history); written only by fence.record_raise';
REVOKE ALL ON TABLE fence.history FROM PUBLIC; -- (H2)
GRANT SELECT ON TABLE fence.history TO PUBLIC;

-- fence.record_raise(resource, previous, token, reset): appends token's row to fence.history,
-- never failing (H1). Not granted to PUBLIC (H2).
-- +goose StatementBegin
CREATE FUNCTION fence.record_raise(resource text, previous bigint, token bigint, reset boolean)
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
REVOKE ALL ON FUNCTION fence.record_raise(text, bigint, bigint, boolean) FROM PUBLIC;

-- Version 4's fence.raise_locked, recording the raise. CREATE OR REPLACE keeps the privileges
-- (none to PUBLIC).
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.raise_locked(resource text, token bigint)
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
    INSERT INTO fence.tokens AS t (resource, token) VALUES (p_resource, 0)
    ON CONFLICT ON CONSTRAINT tokens_pkey DO NOTHING;
    SELECT t.token INTO STRICT stored FROM fence.tokens AS t WHERE t.resource = p_resource FOR UPDATE;
    IF stored >= p_token THEN
        RETURN stored;
    END IF;
    PERFORM fence.end_stale(p_resource, p_token, interval '5 seconds');
    UPDATE fence.tokens AS t SET token = p_token, updated_at = now() WHERE t.resource = p_resource;
    PERFORM fence.record_raise(p_resource, stored, p_token, false); -- (H1, H2)
    PERFORM fence.notify(p_resource || ' ' || p_token);
    -- (P7) The session or its role may have turned synchronous_commit off.
    IF current_setting('synchronous_commit') = 'off' THEN
        PERFORM set_config('synchronous_commit', 'local', true);
    END IF;
    RETURN p_token;
END
$fn$;
-- +goose StatementEnd

-- Version 4's fence.reset, recording the reset.
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
    created    boolean;
BEGIN
    IF p_token IS NULL OR p_token < 0 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('malformed fencing token: %s (fence.reset takes an integer of 0 or more)',
                             coalesce(p_token::text, 'NULL'));
    END IF;
    IF p_resource IS NULL OR p_resource !~ '^[a-z][a-z0-9_.-]{0,62}$' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('malformed fencing resource name: %s', quote_nullable(p_resource));
    END IF;
    INSERT INTO fence.tokens AS t (resource, token) VALUES (p_resource, 0)
    ON CONFLICT ON CONSTRAINT tokens_pkey DO NOTHING;
    created := FOUND;
    SELECT t.token INTO STRICT previous FROM fence.tokens AS t WHERE t.resource = p_resource FOR UPDATE;
    IF p_token > previous THEN
        PERFORM fence.end_stale(p_resource, p_token, interval '5 seconds');
    END IF;
    UPDATE fence.tokens AS t SET token = p_token, updated_at = now() WHERE t.resource = p_resource;
    PERFORM fence.record_raise(p_resource, CASE WHEN created THEN NULL ELSE previous END, p_token, true); -- (H1, H2)
    PERFORM fence.notify(p_resource || ' ' || p_token || ' reset');
    IF current_setting('synchronous_commit') = 'off' THEN -- (P7)
        PERFORM set_config('synchronous_commit', 'local', true);
    END IF;
    RETURN CASE WHEN created THEN NULL ELSE previous END; -- NULL: no token was stored
END
$fn$;
-- +goose StatementEnd

-- +goose Down

-- Version 4's functions again, then the history goes.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.raise_locked(resource text, token bigint)
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
    INSERT INTO fence.tokens AS t (resource, token) VALUES (p_resource, 0)
    ON CONFLICT ON CONSTRAINT tokens_pkey DO NOTHING;
    SELECT t.token INTO STRICT stored FROM fence.tokens AS t WHERE t.resource = p_resource FOR UPDATE;
    IF stored >= p_token THEN
        RETURN stored;
    END IF;
    PERFORM fence.end_stale(p_resource, p_token, interval '5 seconds');
    UPDATE fence.tokens AS t SET token = p_token, updated_at = now() WHERE t.resource = p_resource;
    PERFORM fence.notify(p_resource || ' ' || p_token);
    -- (P7) The session or its role may have turned synchronous_commit off.
    IF current_setting('synchronous_commit') = 'off' THEN
        PERFORM set_config('synchronous_commit', 'local', true);
    END IF;
    RETURN p_token;
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
    created    boolean;
BEGIN
    IF p_token IS NULL OR p_token < 0 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('malformed fencing token: %s (fence.reset takes an integer of 0 or more)',
                             coalesce(p_token::text, 'NULL'));
    END IF;
    IF p_resource IS NULL OR p_resource !~ '^[a-z][a-z0-9_.-]{0,62}$' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('malformed fencing resource name: %s', quote_nullable(p_resource));
    END IF;
    INSERT INTO fence.tokens AS t (resource, token) VALUES (p_resource, 0)
    ON CONFLICT ON CONSTRAINT tokens_pkey DO NOTHING;
    created := FOUND;
    SELECT t.token INTO STRICT previous FROM fence.tokens AS t WHERE t.resource = p_resource FOR UPDATE;
    IF p_token > previous THEN
        PERFORM fence.end_stale(p_resource, p_token, interval '5 seconds');
    END IF;
    UPDATE fence.tokens AS t SET token = p_token, updated_at = now() WHERE t.resource = p_resource;
    PERFORM fence.notify(p_resource || ' ' || p_token || ' reset');
    IF current_setting('synchronous_commit') = 'off' THEN -- (P7)
        PERFORM set_config('synchronous_commit', 'local', true);
    END IF;
    RETURN CASE WHEN created THEN NULL ELSE previous END; -- NULL: no token was stored
END
$fn$;
-- +goose StatementEnd
DROP FUNCTION fence.record_raise(text, bigint, bigint, boolean);
DROP TABLE fence.history;
