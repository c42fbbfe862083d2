-- fence.session_bindings(): the (resource, token) pairs the calling backend is bound to (none
-- for a session that is not fenced). A binding row counts only with this backend's pid and
-- backend_start, so the leftover row of an exited backend whose pid this one reuses never
-- stands for it (R1). SECURITY DEFINER: the owner reads backend_start whatever role the
-- session has set (SET ROLE). Readable by anyone: a session may ask what it is bound to.
CREATE OR REPLACE FUNCTION fence.session_bindings(OUT resource text, OUT token bigint)
RETURNS SETOF record
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    -- plpgsql rather than sql: its plan is cached for the session.
    RETURN QUERY
    SELECT b.resource, b.token
    FROM fence.bindings AS b
    JOIN pg_stat_get_activity(pg_backend_pid()) AS a ON a.backend_start = b.backend_start
    WHERE b.pid = pg_backend_pid();
END
$fn$;
COMMENT ON FUNCTION fence.session_bindings() IS
    'fenceproxy: the resources and tokens this backend is bound to (none: not fenced)';
REVOKE ALL ON FUNCTION fence.session_bindings() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fence.session_bindings() TO PUBLIC;
