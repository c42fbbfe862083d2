-- fence.lease_renew(resource, holder, generation, ttl): sets expires_at to ttl from now (L3) when
-- holder holds generation and the lease has not expired (L4). Returns true when renewed, false
-- when the lease is lost (expired, released, taken over).
CREATE OR REPLACE FUNCTION fence.lease_renew(resource text, holder text, generation bigint, ttl interval)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    PERFORM fence.check_lease_args($1, $2, coalesce($4, interval '0'));
    UPDATE fence.leases AS l
    SET expires_at = pg_catalog.clock_timestamp() + $4, renewed_at = pg_catalog.clock_timestamp()
    WHERE l.resource = $1 AND l.holder = $2 AND l.generation = $3
      AND l.expires_at > pg_catalog.clock_timestamp();
    RETURN FOUND;
END
$fn$;
REVOKE ALL ON FUNCTION fence.lease_renew(text, text, bigint, interval) FROM PUBLIC;
