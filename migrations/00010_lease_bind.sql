-- Version 10 of the fence schema: a resource declared as led through the PostgreSQL lease
-- (`fenceproxy serve --lease-resource NAME`) admits no token before its lease exists.
--
--   fence.lease_bind  (new) the bind of a lease resource's session: refuses (ZF006) while
--                     fence.leases has no row for the resource, then binds exactly as
--                     fence.bind does, and returns the lease's holder with the stored token.
--
-- Why: fence.bind checks a token against the lease row only once the row exists (L6). Before
-- the first `fenceproxy lock --store postgres` acquisition there is none, and fence.bind
-- admitted any token: an application role that presented 9223372036854775807 through the
-- proxy stored it, and from then on every acquisition failed (L9: no higher generation). The
-- proxy cannot tell a lease resource from a bare-token one by the database's rows; the
-- operator declares it, and the proxy binds that resource's sessions with this function.
--
-- The obligations of versions 4 to 9 are kept (fence.bind is called, not copied); one is added:
--
--  (L10) A session of a declared lease resource is bound only to a token the lease issued.
--        fence.lease_bind refuses before anything is bound or raised when the resource has no
--        lease row; with a row, fence.bind's own check (L6) refuses every token above the
--        lease's generation (ZF002) and the current one of an expired or released lease
--        (ZF006). The row cannot vanish between the two reads: no function deletes a lease
--        row and no role but the schema's owner may (L5), so the check here never admits a
--        token fence.bind's check would not. Only a successful acquisition commits a row
--        (fence.lease_acquire's INSERT rolls back with a failed raise), so a row means a
--        generation was issued. fence.lease_bind adds no power: it is executable by PUBLIC
--        like fence.bind, which it calls with the caller's proof (P5: fence.verify checks it
--        for this backend), and it only refuses more.

-- +goose Up

-- +goose StatementBegin
CREATE FUNCTION fence.lease_bind(resource text, token bigint, proof text)
RETURNS TABLE (holder text, stored bigint)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    p_resource ALIAS FOR $1;
    p_token    ALIAS FOR $2;
    p_proof    ALIAS FOR $3;
BEGIN
    -- (L10) No lease row: no generation was ever issued, so no token is the lease's.
    IF NOT EXISTS (SELECT 1 FROM fence.leases AS l WHERE l.resource = p_resource) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF006',
            MESSAGE = format('fencing lease missing: resource "%s" is led through the PostgreSQL lease, but no lease was ever acquired for it in this database; token %s is not admitted',
                             p_resource, p_token),
            HINT = format('Start the leader with fenceproxy lock --store postgres --resource %s --database <this database, reached directly>: its first acquisition creates the lease, and its generation is the token. If this resource is not led through the PostgreSQL lease, declare it with --resource instead of --lease-resource.', p_resource);
    END IF;
    -- (L6, P1-P7) The bind itself, with its own lease check.
    stored := fence.bind(p_resource, p_token, p_proof);
    SELECT l.holder INTO holder FROM fence.leases AS l
    WHERE l.resource = p_resource AND l.generation = p_token;
    RETURN NEXT;
END
$fn$;
-- +goose StatementEnd
COMMENT ON FUNCTION fence.lease_bind(text, bigint, text) IS
    'fenceproxy: fence.bind for a resource led through the PostgreSQL lease: refuses (ZF006) until the lease exists; returns the lease holder and the stored token';
REVOKE ALL ON FUNCTION fence.lease_bind(text, bigint, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fence.lease_bind(text, bigint, text) TO PUBLIC;

-- +goose Down

DROP FUNCTION fence.lease_bind(text, bigint, text);
