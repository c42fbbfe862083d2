-- fence.lease_release(resource, holder, generation): frees the lease when holder holds
-- generation (L4); the generation stays (L2). Returns true when released, false when it was not
-- held by holder with generation (lost already). An expired lease that nobody took over is
-- released as well.
CREATE OR REPLACE FUNCTION fence.lease_release(resource text, holder text, generation bigint)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    PERFORM fence.check_lease_args($1, $2, NULL);
    UPDATE fence.leases AS l
    SET holder = NULL, expires_at = NULL
    WHERE l.resource = $1 AND l.holder = $2 AND l.generation = $3;
    RETURN FOUND;
END
$fn$;
REVOKE ALL ON FUNCTION fence.lease_release(text, text, bigint) FROM PUBLIC;
