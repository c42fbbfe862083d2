-- Upgrade step to schema version 5: the PostgreSQL lease's table. Frozen once released.

-- One row per resource that was ever leased. holder and expires_at are NULL when free; the
-- generation stays across releases and expiries (L2).
CREATE TABLE fence.leases (
    resource    text COLLATE "C" NOT NULL,
    holder      text,
    generation  bigint           NOT NULL DEFAULT 0,
    expires_at  timestamptz,
    acquired_at timestamptz,
    renewed_at  timestamptz,
    CONSTRAINT leases_pkey PRIMARY KEY (resource),
    CONSTRAINT leases_resource_valid CHECK (resource ~ '^[a-z][a-z0-9_.-]{0,62}$'),
    CONSTRAINT leases_generation_nonnegative CHECK (generation >= 0),
    CONSTRAINT leases_held_or_free CHECK ((holder IS NULL) = (expires_at IS NULL))
);
COMMENT ON TABLE fence.leases IS
    'fenceproxy: one lease per resource (fenceproxy lock --store postgres); the generation is the fencing token; written only through fence.lease_acquire, fence.lease_renew and fence.lease_release';
REVOKE ALL ON TABLE fence.leases FROM PUBLIC; -- (L5)
GRANT SELECT ON TABLE fence.leases TO PUBLIC;
