-- fence.record_raise(resource, previous, token, reset): appends token's row to fence.history,
-- never failing (H1). Not granted to PUBLIC (H2). The holder is the lease's, or the lock
-- service's in that service's words (W1), when known.
CREATE OR REPLACE FUNCTION fence.record_raise(resource text, previous bigint, token bigint, reset boolean)
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
               coalesce((SELECT l.holder FROM fence.leases AS l WHERE l.resource = $1 AND l.generation = $3),
                        (SELECT fence.holder_words(c.holder) FROM fence.consul_tokens AS c
                         WHERE c.resource = $1 AND c.token = $3 AND c.holder <> '')),
               $4, pg_catalog.clock_timestamp(), session_user,
               NULLIF(pg_catalog.current_setting('application_name'), ''),
               pg_catalog.inet_client_addr(), pg_catalog.pg_backend_pid();
    EXCEPTION WHEN OTHERS THEN
        RAISE WARNING 'fenceproxy: raise of resource "%" to token % not recorded in fence.history: % (SQLSTATE %)',
            $1, $3, SQLERRM, SQLSTATE;
    END;
END
$fn$;
REVOKE ALL ON FUNCTION fence.record_raise(text, bigint, bigint, boolean) FROM PUBLIC;
