-- fence.settled(resource, token, proof): the stored token once no raise of resource is in
-- flight (0 if none is stored). The proxy asks it on its control connection when the server
-- ended a session bound to token: a raise that ended it holds the row FOR UPDATE (P1) until it
-- commits, so this FOR SHARE read returns the raised token as soon as the raise commits, and
-- at once when nothing is being raised (the backend ended for another reason). Proof-gated
-- (P5) because the lock it takes, held in an open transaction, would stall every raise.
CREATE OR REPLACE FUNCTION fence.settled(resource text, token bigint, proof text)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    stored bigint;
BEGIN
    PERFORM fence.verify('settled', $1, $2, $3);
    SELECT t.token INTO stored FROM fence.tokens AS t WHERE t.resource = $1 FOR SHARE;
    RETURN coalesce(stored, 0);
END
$fn$;
COMMENT ON FUNCTION fence.settled(text, bigint, text) IS
    'fenceproxy: the stored token once no raise is in flight (waits for one); needs the proxy''s proof';
REVOKE ALL ON FUNCTION fence.settled(text, bigint, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fence.settled(text, bigint, text) TO PUBLIC;
