-- Version 7 of the fence schema: what the proxies learned from Consul, kept where every proxy
-- instance and a restart see it. (Version 6 is another change; this one does not depend on it.)
--
--   fence.consul_tokens   one row per resource validated against a Consul lock: the highest
--                         token a proxy admitted on Consul's word, the Consul session that held
--                         the lock with it, and, once a proxy saw the lock's token go
--                         backwards, the regression (the resource fails closed until reset).
--   fence.consul_admit    the proxy records a token Consul showed as current, with its holder,
--                         before admitting it (and when its watch shows a new holder), and
--                         learns whether the resource regressed.
--   fence.consul_regress  the proxy records a regression it detected.
--   fence.reset           (replaced) also forgets the resource's Consul row: the operator's
--                         reset is the one way out of a regression.
--
-- Why in the database: a proxy's memory of a regression ended with the process, and every other
-- proxy instance had its own. After a LockIndex regression (a plain PUT on the held key, a
-- Consul that lost its data) and a restart, once the LockIndex climbed back to the token stored
-- in fence.tokens, the old holder and the new one held the same number and both were admitted.
-- The proof obligations, each discharged by the code marked with its number:
--
--  (C1) A regression is never forgotten: consul_regress and consul_admit set
--       consul_tokens.regression and nothing but fence.reset clears it; while it is set,
--       consul_admit answers with it, whichever proxy asks, restarted or not, and the proxy
--       refuses the resource's sessions with ZF007.
--  (C2) One token, one holder: the first admission of a token records the Consul session that
--       held the lock in the proxy's consistent read; an admission of the same token with
--       another holder means Consul issued the number twice (its sequence went back and came up
--       again) and is recorded as a regression (C1). Admissions of one resource serialize on
--       its row (FOR UPDATE), so of two concurrent admissions of one token with different
--       holders the second sees the first's row.
--  (C3) A recorded token only grows (GREATEST). A lower token is not itself a regression here:
--       a proxy's watch can report an older hand-over after another proxy recorded a newer one.
--       consul_admit returns the recorded token, and the proxy decides with a consistent read
--       of Consul made after the call: Consul's current token below the recorded one is a
--       regression (it calls consul_regress); otherwise the lower token is merely stale.
--  (C4) Only the proxy writes: both functions need the proxy's proof (fence.verify, kind
--       'consul'); the table has no write privilege for anyone (SECURITY DEFINER functions,
--       search_path pinned, names schema-qualified).
--
-- The guarantee of versions 4 and 5 (bind, raise, P1-P7) does not depend on this table: it
-- refuses tokens lower than the stored one whatever Consul says. This table stops the one thing
-- the database cannot see, a number issued twice by Consul.

-- +goose Up

CREATE TABLE fence.consul_tokens (
    resource     text COLLATE "C" NOT NULL,
    token        bigint           NOT NULL DEFAULT 0,
    holder       text             NOT NULL DEFAULT '',
    regression   text,
    regressed_at timestamptz,
    updated_at   timestamptz      NOT NULL DEFAULT now(),
    CONSTRAINT consul_tokens_pkey PRIMARY KEY (resource),
    CONSTRAINT consul_tokens_resource_valid CHECK (resource ~ '^[a-z][a-z0-9_.-]{0,62}$'),
    CONSTRAINT consul_tokens_token_not_negative CHECK (token >= 0)
);
COMMENT ON TABLE fence.consul_tokens IS
    'fenceproxy: per Consul-validated resource, the highest token admitted, its holder session, and a regression (fail closed until fence.reset)';
REVOKE ALL ON TABLE fence.consul_tokens FROM PUBLIC;
GRANT SELECT ON TABLE fence.consul_tokens TO PUBLIC;

-- fence.consul_admit(resource, token, holder, proof): records that Consul showed token as the
-- current token of the lock, held by session holder. Returns the recorded token and holder
-- after the call, and the regression (NULL when none). The proxy admits token only when the
-- regression is NULL and the recorded token and holder are token and holder.
-- +goose StatementBegin
CREATE FUNCTION fence.consul_admit(resource text, token bigint, holder text, proof text,
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
COMMENT ON FUNCTION fence.consul_admit(text, bigint, text, text) IS
    'fenceproxy: records a token Consul showed as current and its holder; returns the recorded token, holder and regression; needs the proxy''s proof';

-- fence.consul_regress(resource, token, reason, proof): records a regression the proxy saw
-- (token: the highest token it knew of, for the proof). The first reason stays. Returns the
-- regression recorded.
-- +goose StatementBegin
CREATE FUNCTION fence.consul_regress(resource text, token bigint, reason text, proof text)
RETURNS text
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    p_resource ALIAS FOR $1;
    p_token    ALIAS FOR $2;
    p_reason   ALIAS FOR $3;
    recorded   text;
BEGIN
    PERFORM fence.verify('consul', p_resource, p_token, proof); -- (C4)
    IF p_reason IS NULL OR p_reason = '' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = 'malformed regression: fence.consul_regress needs a reason';
    END IF;
    INSERT INTO fence.consul_tokens AS c (resource, regression, regressed_at) VALUES (p_resource, p_reason, now())
    ON CONFLICT ON CONSTRAINT consul_tokens_pkey DO UPDATE
        SET regression = coalesce(c.regression, excluded.regression),
            regressed_at = coalesce(c.regressed_at, excluded.regressed_at),
            updated_at = now()
    RETURNING c.regression INTO recorded; -- (C1)
    RETURN recorded;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION fence.consul_regress(text, bigint, text, text) IS
    'fenceproxy: records a Consul token regression (the resource fails closed until fence.reset); needs the proxy''s proof';

REVOKE ALL ON FUNCTION fence.consul_admit(text, bigint, text, text), fence.consul_regress(text, bigint, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fence.consul_admit(text, bigint, text, text), fence.consul_regress(text, bigint, text, text) TO PUBLIC;

-- fence.reset: version 6's (which records the reset in fence.history), and it forgets the resource's Consul row (C1: the one way out). A
-- proxy that sees the reset's notification ('<resource> <token> reset') starts its Consul
-- history of the resource afresh.
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
    DELETE FROM fence.consul_tokens AS c WHERE c.resource = p_resource; -- (C1)
    PERFORM fence.notify(p_resource || ' ' || p_token || ' reset');
    IF current_setting('synchronous_commit') = 'off' THEN -- (P7)
        PERFORM set_config('synchronous_commit', 'local', true);
    END IF;
    RETURN CASE WHEN created THEN NULL ELSE previous END; -- NULL: no token was stored
END
$fn$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fence.reset(text, bigint) FROM PUBLIC;

-- +goose Down

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
DROP FUNCTION fence.consul_regress(text, bigint, text, text);
DROP FUNCTION fence.consul_admit(text, bigint, text, text);
DROP TABLE fence.consul_tokens;
