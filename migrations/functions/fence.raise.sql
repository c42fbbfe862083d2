-- fence.raise(resource, token, proof): the raise on its own (the proxy's proactive raise when
-- Consul shows a new holder, on the proxy's control connection). Returns the stored token.
CREATE OR REPLACE FUNCTION fence.raise(resource text, token bigint, proof text)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    PERFORM fence.verify('raise', $1, $2, $3);
    RETURN fence.raise_locked($1, $2);
END
$fn$;
COMMENT ON FUNCTION fence.raise(text, bigint, text) IS
    'fenceproxy: admit a fencing token, ending the backends bound to lower ones; needs the proxy''s proof; returns the stored token';
REVOKE ALL ON FUNCTION fence.raise(text, bigint, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fence.raise(text, bigint, text) TO PUBLIC;
