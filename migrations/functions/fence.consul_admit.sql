-- fence.consul_admit(resource, token, holder, proof): records that Consul showed token as the
-- current token of the lock, held by session holder. Returns the recorded token and holder
-- after the call, and the regression (NULL when none). The proxy admits token only when the
-- regression is NULL and the recorded token and holder are token and holder. Used for every
-- lock service (Consul, etcd, ZooKeeper), whose holders it names in their words (W1). A second
-- holder of the recorded token is a regression that deposes the first (C2, C5). Refuses (ZF004)
-- a resource the PostgreSQL lease leads (L12).
CREATE OR REPLACE FUNCTION fence.consul_admit(resource text, token bigint, holder text, proof text,
                                              OUT recorded bigint, OUT recorded_holder text, OUT regression text)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    p_resource ALIAS FOR $1;
    p_token    ALIAS FOR $2;
    p_holder   ALIAS FOR $3;
    cur        fence.consul_tokens%ROWTYPE;
    service    text;
BEGIN
    PERFORM fence.verify('consul', p_resource, p_token, proof); -- (C4)
    IF p_holder IS NULL OR p_holder = '' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = 'malformed fencing holder: fence.consul_admit needs the session that holds the lock';
    END IF;
    -- (L12) No lock service's token on a resource with a PostgreSQL lease: the bind's lease
    -- check would refuse it as not issued (ZF002), or its generations as stale, with a hint
    -- about the lease. Said once, here, with the way out.
    IF EXISTS (SELECT 1 FROM fence.leases AS l WHERE l.resource = p_resource) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('fencing lock service refused: resource "%s" is led through the PostgreSQL lease (fence.leases has its row: %s)',
                             p_resource,
                             (SELECT CASE WHEN l.holder IS NOT NULL AND l.expires_at > pg_catalog.clock_timestamp()
                                          THEN format('generation %s, held by %s until %s', l.generation, l.holder, l.expires_at)
                                          ELSE format('generation %s, not held now', l.generation) END
                              FROM fence.leases AS l WHERE l.resource = p_resource)),
            HINT = format('One resource has one lock service: give this lock another resource name. Or, if nothing uses its PostgreSQL lease any more, stop its lease holders and have the fence schema''s owner delete its row (DELETE FROM fence.leases WHERE resource = %L); never lower its token below the lease''s generation afterwards (fenceproxy fence reset refuses that only while the row exists: its generations would be issued again).', p_resource);
    END IF;
    -- (C5) The shared path of the recorded holder, as in version 8.
    SELECT c.* INTO cur FROM fence.consul_tokens AS c WHERE c.resource = p_resource;
    IF FOUND AND cur.regression IS NULL AND cur.token = p_token AND cur.holder = p_holder THEN
        SELECT c.* INTO cur FROM fence.consul_tokens AS c WHERE c.resource = p_resource FOR SHARE;
        IF FOUND AND (cur.regression IS NOT NULL OR cur.token > p_token
                      OR (cur.token = p_token AND cur.holder = p_holder)) THEN
            recorded := cur.token; -- nothing to write: admitted, or answered (C1, C3)
            recorded_holder := cur.holder;
            regression := cur.regression;
            RETURN;
        END IF;
    END IF;
    -- (D1) What follows may record a holder or a regression that later admissions rest on
    -- (C2, C5): durable where a failover can take it.
    PERFORM fence.commit_durably();
    INSERT INTO fence.consul_tokens AS c (resource) VALUES (p_resource)
    ON CONFLICT ON CONSTRAINT consul_tokens_pkey DO NOTHING;
    SELECT c.* INTO STRICT cur FROM fence.consul_tokens AS c WHERE c.resource = p_resource FOR UPDATE; -- (C2)
    IF cur.regression IS NULL AND p_token = cur.token AND p_holder <> cur.holder THEN -- (C2)
        service := CASE split_part(fence.holder_words(p_holder), ' ', 1)
                       WHEN 'etcd' THEN 'etcd' WHEN 'zookeeper' THEN 'ZooKeeper' ELSE 'Consul' END; -- (W1)
        cur.regression := format('token %s was admitted for %s and is now held by %s: '
                                 '%s issued the number twice (its sequence went back and came up again)',
                                 p_token, fence.holder_words(cur.holder), fence.holder_words(p_holder), service);
        UPDATE fence.consul_tokens AS c SET regression = cur.regression, regressed_at = now(), updated_at = now()
        WHERE c.resource = p_resource;
        PERFORM fence.consul_depose(p_resource, p_token); -- (C5)
    ELSIF cur.regression IS NULL AND p_token > cur.token THEN -- (C3)
        cur.token := p_token;
        cur.holder := p_holder;
        UPDATE fence.consul_tokens AS c SET token = p_token, holder = p_holder, updated_at = now()
        WHERE c.resource = p_resource;
    END IF;
    recorded := cur.token;
    recorded_holder := cur.holder;
    regression := cur.regression; -- (C1)
END
$fn$;
COMMENT ON FUNCTION fence.consul_admit(text, bigint, text, text) IS
    'fenceproxy: records a token Consul showed as current and its holder; returns the recorded token, holder and regression; needs the proxy''s proof';
REVOKE ALL ON FUNCTION fence.consul_admit(text, bigint, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fence.consul_admit(text, bigint, text, text) TO PUBLIC;
