-- fence.raise_locked(resource, token): the raise. Locks resource's row FOR UPDATE (P1),
-- creating it when missing, and when token is higher than the stored one ends the stale
-- backends (P2, P4), stores it and notifies 'fence_raise' with '<resource> <token>'
-- (fence.notify), records it in fence.history (H1) and commits with synchronous_commit on
-- (D1). Returns the token stored afterwards. Not granted to PUBLIC.
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
    -- (P7, D1) Admitted only once durable where a failover can take it: this transaction
    -- commits with synchronous_commit on whatever the role or the client set.
    PERFORM fence.commit_durably();
    RETURN p_token;
END
$fn$;
REVOKE ALL ON FUNCTION fence.raise_locked(text, bigint) FROM PUBLIC;
