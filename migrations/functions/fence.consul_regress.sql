-- fence.consul_regress(resource, token, reason, proof): records a regression the proxy saw
-- (token: the highest token it knew of, for the proof). The first reason stays. Returns the
-- regression recorded.
CREATE OR REPLACE FUNCTION fence.consul_regress(resource text, token bigint, reason text, proof text)
RETURNS text
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    p_resource ALIAS FOR $1;
    p_token    ALIAS FOR $2;
    p_reason   ALIAS FOR $3;
    recorded   text;
BEGIN
    PERFORM fence.verify('consul', p_resource, p_token, proof); -- (C4)
    IF p_reason IS NULL OR p_reason = '' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = 'malformed regression: fence.consul_regress needs a reason';
    END IF;
    PERFORM fence.commit_durably(); -- (D1) a regression lost in a failover would re-admit (C1)
    INSERT INTO fence.consul_tokens AS c (resource, regression, regressed_at) VALUES (p_resource, p_reason, now())
    ON CONFLICT ON CONSTRAINT consul_tokens_pkey DO UPDATE
        SET regression = coalesce(c.regression, excluded.regression),
            regressed_at = coalesce(c.regressed_at, excluded.regressed_at),
            updated_at = now()
    RETURNING c.regression INTO recorded; -- (C1)
    RETURN recorded;
END
$fn$;
COMMENT ON FUNCTION fence.consul_regress(text, bigint, text, text) IS
    'fenceproxy: records a Consul token regression (the resource fails closed until fence.reset); needs the proxy''s proof';
REVOKE ALL ON FUNCTION fence.consul_regress(text, bigint, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fence.consul_regress(text, bigint, text, text) TO PUBLIC;
