-- fence.lease_bind(resource, token, proof): the bind of a session of a resource declared as
-- led through the PostgreSQL lease (`fenceproxy serve --lease-resource NAME`, schema version
-- 10): refuses (ZF006) while fence.leases has no row for the resource, then binds exactly as
-- fence.bind does, and returns the lease's holder with the stored token.
--
-- Why: fence.bind checks a token against the lease row only once the row exists. Before
-- the first `fenceproxy lock --store postgres` acquisition there is none, and fence.bind
-- admitted any token: an application role that presented 9223372036854775807 through the
-- proxy stored it, and from then on every acquisition failed (ZF004: no higher generation). The
-- proxy cannot tell a lease resource from a bare-token one by the database's rows; the
-- operator declares it, and the proxy binds that resource's sessions with this function.
--
-- (L10) A session of a declared lease resource is bound only to a token the lease issued
-- (docs/proof.md).
CREATE OR REPLACE FUNCTION fence.lease_bind(resource text, token bigint, proof text)
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
    -- The bind itself, with its own lease check and its proof.
    stored := fence.bind(p_resource, p_token, p_proof);
    SELECT l.holder INTO holder FROM fence.leases AS l
    WHERE l.resource = p_resource AND l.generation = p_token;
    RETURN NEXT;
END
$fn$;
COMMENT ON FUNCTION fence.lease_bind(text, bigint, text) IS
    'fenceproxy: fence.bind for a resource led through the PostgreSQL lease: refuses (ZF006) until the lease exists; returns the lease holder and the stored token';
REVOKE ALL ON FUNCTION fence.lease_bind(text, bigint, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fence.lease_bind(text, bigint, text) TO PUBLIC;
