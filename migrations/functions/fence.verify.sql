-- fence.verify(kind, resource, token, proof): validates the arguments and the proof of the
-- calling backend, or raises ZF004 (malformed), ZF007 (no key stored) or ZF010 (wrong proof).
CREATE OR REPLACE FUNCTION fence.verify(kind text, resource text, token bigint, proof text)
RETURNS void
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    p_kind     ALIAS FOR $1;
    p_resource ALIAS FOR $2;
    p_token    ALIAS FOR $3;
    p_proof    ALIAS FOR $4;
    expected   text;
BEGIN
    IF p_token IS NULL OR p_token <= 0 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('malformed fencing token: %s (a fencing token is an integer greater than 0)',
                             coalesce(p_token::text, 'NULL'));
    END IF;
    IF p_resource IS NULL OR p_resource !~ '^[a-z][a-z0-9_.-]{0,62}$' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('malformed fencing resource name: %s', quote_nullable(p_resource)),
            HINT = 'A resource name is 1 to 63 characters of a-z, 0-9, "_", "." and "-", starting with a letter.';
    END IF;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        -- (P1) needs a fresh snapshot per statement after each lock.
        RAISE EXCEPTION USING
            ERRCODE = 'ZF007',
            MESSAGE = format('fencing unavailable: fence.%s must run under READ COMMITTED, not %s',
                             p_kind, current_setting('transaction_isolation'));
    END IF;
    expected := fence.proof(p_kind, p_resource, p_token, pg_backend_pid());
    IF expected IS NULL THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF007',
            MESSAGE = 'fencing unavailable: no proxy key is stored in this database',
            HINT = 'Run fenceproxy migrate --key-file with the key file the proxies use (--key-file).';
    END IF;
    IF p_proof IS NULL OR p_proof <> expected THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF010',
            MESSAGE = format('fencing proof invalid: fence.%s(%L, %s) was not called by fenceproxy with this database''s proxy key',
                             p_kind, p_resource, p_token),
            HINT = 'Only fenceproxy binds sessions and raises tokens. If this is a proxy, its --key-file does not match the key stored by fenceproxy migrate --key-file.';
    END IF;
END
$fn$;
REVOKE ALL ON FUNCTION fence.verify(text, text, bigint, text) FROM PUBLIC;
