-- fence.reset(resource, token) is the operator's way out after a Consul LockIndex regression
-- (lock key deleted and re-created, plain PUT on a held key, snapshot restore): it stores
-- exactly the given token, lower or not, and returns the token stored before (NULL if none).
-- It notifies 'fence_raise' with the payload '<resource> <token> reset', so that proxies that
-- track the highest token they know of replace it instead of keeping the higher one.
-- Token 0 is allowed here (fence.raise refuses it): it keeps the row but admits any token.
-- Not granted to PUBLIC: lowering the stored token re-admits stale leaders. Raising through
-- it ends the lower-bound backends like a raise (P2); it records the reset in fence.history
-- (H1) and forgets the resource's lock-service record, regression included (C1: the one way
-- out); it commits with synchronous_commit on (D1).
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
    PERFORM fence.commit_durably(); -- (P7, D1) raised or lowered, durable where a failover can take it
    RETURN CASE WHEN created THEN NULL ELSE previous END; -- NULL: no token was stored
END
$fn$;
COMMENT ON FUNCTION fence.reset(text, bigint) IS
    'fenceproxy: operator only; set the stored token to exactly this value (may lower it); returns the previous token';
REVOKE ALL ON FUNCTION fence.reset(text, bigint) FROM PUBLIC;
