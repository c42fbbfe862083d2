-- fence.holder_words(holder): how a holder recorded in fence.consul_tokens is named, with its
-- service (W1): the etcd and ZooKeeper guards record "etcd lease <id>" and "zookeeper session
-- <id>", Consul's guard a bare session ID.
CREATE OR REPLACE FUNCTION fence.holder_words(holder text)
RETURNS text
LANGUAGE sql
IMMUTABLE
STRICT
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT CASE WHEN $1 LIKE 'etcd lease %' OR $1 LIKE 'zookeeper session %' THEN $1
                ELSE 'consul session ' OPERATOR(pg_catalog.||) $1 END
$fn$;
COMMENT ON FUNCTION fence.holder_words(text) IS
    'fenceproxy: the name of a holder recorded in fence.consul_tokens, with its service (W1)';
REVOKE ALL ON FUNCTION fence.holder_words(text) FROM PUBLIC;
