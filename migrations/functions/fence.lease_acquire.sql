-- fence.lease_acquire(resource, holder, ttl): takes the lease for holder when it is free or
-- expired (L1, L1'), with a new generation (L2) that it admits before it commits (durably, D1),
-- and an expiry ttl from now by the server's clock (L3). Returns one row: acquired, the
-- generation (the new one when acquired, the current one otherwise), the holder afterwards and
-- its expires_at. Run it in a transaction of its own (autocommit): the raise ends stale backends
-- and waits for them while it holds the resource's rows. Refuses (ZF004) a resource a lock
-- service leads (L8) and one whose token or generation is the largest bigint (L9). Issues its
-- generation within the range of the primary's timeline (L11): a promoted standby never issues
-- a generation that the lost primary may have issued, nor one below it.
CREATE OR REPLACE FUNCTION fence.lease_acquire(resource text, holder text, ttl interval)
RETURNS TABLE (acquired boolean, generation bigint, current_holder text, expires_at timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    p_resource ALIAS FOR $1;
    p_holder   ALIAS FOR $2;
    p_ttl      ALIAS FOR $3;
    stored     bigint;
    timeline   bigint;
    tl_base    bigint;
BEGIN
    PERFORM fence.check_lease_args(p_resource, p_holder, coalesce(p_ttl, interval '0'));
    -- (L8) No lease on a resource whose tokens a lock service issues.
    IF EXISTS (SELECT 1 FROM fence.consul_tokens AS c WHERE c.resource = p_resource) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('fencing lease refused: resource "%s" is led through a lock service (Consul, etcd or ZooKeeper: fence.consul_tokens records its holders)', p_resource),
            HINT = 'Take the lock from that service. To lead the resource through the PostgreSQL lease instead, stop its lock holders and run fenceproxy fence reset first.';
    END IF;
    INSERT INTO fence.leases AS l (resource) VALUES (p_resource)
    ON CONFLICT ON CONSTRAINT leases_pkey DO NOTHING;

    -- (L9) No generation above the largest bigint.
    IF GREATEST((SELECT l.generation FROM fence.leases AS l WHERE l.resource = p_resource),
                (SELECT t.token FROM fence.tokens AS t WHERE t.resource = p_resource)) = 9223372036854775807 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('fencing lease refused: resource "%s" has token or generation 9223372036854775807, the largest a token can be, so no higher generation exists',
                             p_resource),
            HINT = 'Stop every holder of the resource, then lower its token with fenceproxy fence reset --force.';
    END IF;

    -- (L11) The timeline this primary writes on: that of its WAL insert position (the file name's
    -- first 8 hex digits). Not pg_control_checkpoint()'s timeline_id, which moves only at the
    -- first checkpoint after a promotion: an acquisition right after it would read the old one.
    timeline := ('x' || pg_catalog.substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), 1, 8))::bit(32)::bigint;
    IF timeline < 1 OR timeline > 2147483647 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('fencing lease refused: resource "%s": this server writes on timeline %s, outside 1 to 2147483647, the timelines whose generations a bigint holds',
                             p_resource, timeline);
    END IF;
    tl_base := (timeline - 1) * 4294967296;

    -- (L1', L2, L3, L11) The one conditional UPDATE that hands out a generation: above the
    -- current one, the stored token and every generation of an earlier timeline.
    UPDATE fence.leases AS l
    SET holder = p_holder,
        generation = GREATEST(l.generation,
            coalesce((SELECT t.token FROM fence.tokens AS t WHERE t.resource = p_resource), 0), tl_base) + 1,
        expires_at = pg_catalog.clock_timestamp() + p_ttl,
        acquired_at = pg_catalog.clock_timestamp(),
        renewed_at = pg_catalog.clock_timestamp()
    WHERE l.resource = p_resource
      AND (l.holder IS NULL OR l.expires_at <= pg_catalog.clock_timestamp())
    RETURNING true, l.generation, l.holder, l.expires_at
    INTO acquired, generation, current_holder, expires_at;

    -- (L11) ... and below every generation of a later timeline: a new primary promoted from this
    -- one issues its generations above this range, so none of them is one this primary issued.
    -- Raising rolls the UPDATE back: nothing is handed out.
    IF FOUND AND generation >= tl_base + 4294967296 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('fencing lease refused: resource "%s" would get generation %s, beyond %s, the last generation of timeline %s (a generation above it could be issued again by a standby promoted from this primary)',
                             p_resource, generation, tl_base + 4294967295, timeline),
            HINT = 'A token above this timeline''s range was stored (a bare token before the lease, or fenceproxy fence reset). Stop every holder of the resource, lower its token with fenceproxy fence reset --force and, if the lease''s generation is above the range too, have the fence schema''s owner delete its row of fence.leases (docs/failover.md).';
    END IF;

    IF NOT FOUND THEN
        SELECT false, l.generation, l.holder, l.expires_at INTO acquired, generation, current_holder, expires_at
        FROM fence.leases AS l WHERE l.resource = p_resource;
        RETURN NEXT;
        RETURN;
    END IF;

    -- (L2) Admit the generation now: ends the older holders' backends and waits until they have
    -- exited (or fails with ZF011, and so does the acquisition).
    -- (D1) Through fence.raise_locked the acquisition commits with synchronous_commit on: a
    -- generation is handed out only once durable where a failover can take it.
    stored := fence.raise_locked(p_resource, generation);
    IF stored IS DISTINCT FROM generation THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF007',
            MESSAGE = format('fencing unavailable: lease of resource "%s" not acquired: generation %s is not above the admitted token %s',
                             p_resource, generation, stored),
            HINT = 'Is the resource also led through another lock (Consul)? Lead each resource through one store.';
    END IF;
    RETURN NEXT;
END
$fn$;
REVOKE ALL ON FUNCTION fence.lease_acquire(text, text, interval) FROM PUBLIC;
