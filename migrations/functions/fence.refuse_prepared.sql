-- fence.refuse_prepared(resource, token): raises ZF011, naming them, while this database holds
-- prepared transactions (P4). Not granted to PUBLIC.
CREATE OR REPLACE FUNCTION fence.refuse_prepared(resource text, token bigint)
RETURNS void
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    prepared text;
BEGIN
    SELECT string_agg(format('%L (owner %s, prepared %s)', p.gid, p.owner, p.prepared), ', ' ORDER BY p.prepared)
    INTO prepared
    FROM pg_prepared_xacts AS p
    WHERE p.database = current_database();
    IF prepared IS NOT NULL THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF011',
            MESSAGE = format('fencing raise failed: resource "%s" was not raised to token %s because prepared transactions exist in this database: %s',
                             $1, $2, prepared),
            DETAIL = 'A prepared transaction outlives the session that prepared it, so a stale leader''s could commit after the raise.',
            HINT = 'Resolve them with COMMIT PREPARED or ROLLBACK PREPARED (pg_prepared_xacts), then retry; fenced databases should not use two-phase commit.';
    END IF;
END
$fn$;
REVOKE ALL ON FUNCTION fence.refuse_prepared(text, bigint) FROM PUBLIC;
