-- fence.consul_depose(resource, token): (C5) ends every live backend bound to resource with
-- token or a lower one, holding resource's row of fence.tokens FOR UPDATE until the caller
-- commits. Returns how many it ended. Not granted to PUBLIC.
CREATE OR REPLACE FUNCTION fence.consul_depose(resource text, token bigint)
RETURNS integer
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    INSERT INTO fence.tokens AS t (resource, token) VALUES ($1, 0)
    ON CONFLICT ON CONSTRAINT tokens_pkey DO NOTHING;
    PERFORM 1 FROM fence.tokens AS t WHERE t.resource = $1 FOR UPDATE; -- (P1)
    RETURN fence.end_stale($1, $2 + 1, interval '5 seconds'); -- (P2): bound to token or lower
END
$fn$;
REVOKE ALL ON FUNCTION fence.consul_depose(text, bigint) FROM PUBLIC;
