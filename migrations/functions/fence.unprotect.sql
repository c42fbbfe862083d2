-- fence.unprotect(table): takes fence.protect's triggers off table and its partitions (and
-- fence.protect calls it before it puts them on). The fence_token column stays (drop it
-- yourself). Refused in a fenced session (R5), and so is fence.protect: a fenced application
-- neither lifts nor redraws its own fence. SECURITY INVOKER: only the table's owner may drop
-- its triggers.
CREATE OR REPLACE FUNCTION fence.unprotect(tbl regclass)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    part regclass;
BEGIN
    IF EXISTS (SELECT 1 FROM fence.session_bindings()) THEN -- (R5)
        RAISE EXCEPTION USING
            ERRCODE = 'ZF008',
            MESSAGE = 'not allowed in a fenced session: fence.protect and fence.unprotect',
            HINT = 'Declare or lift the protection of a table as its owner in a session without a fencing token (a schema migration).';
    END IF;
    IF EXISTS (SELECT 1 FROM pg_trigger AS t WHERE t.tgrelid = $1 AND t.tgname = 'zz_fence_protect') THEN
        EXECUTE format('DROP TRIGGER zz_fence_protect ON %s', $1);
    END IF;
    FOR part IN SELECT $1 UNION SELECT t.relid FROM pg_partition_tree($1) AS t LOOP
        IF EXISTS (SELECT 1 FROM pg_trigger AS t WHERE t.tgrelid = part AND t.tgname = 'zz_fence_protect_truncate') THEN
            EXECUTE format('DROP TRIGGER zz_fence_protect_truncate ON %s', part);
        END IF;
    END LOOP;
END
$fn$;
COMMENT ON FUNCTION fence.unprotect(regclass) IS
    'fenceproxy: take fence.protect''s triggers off a table (its fence_token column stays)';
REVOKE ALL ON FUNCTION fence.unprotect(regclass) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fence.unprotect(regclass) TO PUBLIC;
