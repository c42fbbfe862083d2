-- The fence schema's tables, as a fresh install creates them: schema version 9 (migrations.Version).
--
-- `fenceproxy migrate` runs this file on a database without the fence schema's version table,
-- then every file of functions/ (CREATE OR REPLACE), in one transaction. A database installed
-- earlier runs the files of upgrade/ above its version instead of this one. Whatever the path,
-- the catalog is the same (TestMigrateEveryVersion); docs/schema.md says how to change a table.
--
-- Every table is written only by the schema's SECURITY DEFINER functions: no INSERT, UPDATE,
-- DELETE or TRUNCATE privilege is granted on any of them (P6, L5, H2, C4); the ones a client
-- may read for diagnostics grant SELECT.

COMMENT ON SCHEMA fence IS
    'fenceproxy: fencing tokens (highest admitted token per resource) and the functions the proxy injects';
REVOKE ALL ON SCHEMA fence FROM PUBLIC;
GRANT USAGE ON SCHEMA fence TO PUBLIC;

-- One row per resource: the highest admitted token (P1-P3). The column is COLLATE "C" so that
-- the name pattern, the primary key and every comparison behave the same whatever the
-- database's default collation is.
CREATE TABLE fence.tokens (
    resource   text COLLATE "C" NOT NULL,
    token      bigint           NOT NULL,
    updated_at timestamptz      NOT NULL DEFAULT now(),
    CONSTRAINT tokens_pkey PRIMARY KEY (resource),
    CONSTRAINT tokens_resource_valid CHECK (resource ~ '^[a-z][a-z0-9_.-]{0,62}$'),
    CONSTRAINT tokens_token_nonnegative CHECK (token >= 0)
);
COMMENT ON TABLE fence.tokens IS
    'fenceproxy: the highest admitted fencing token per resource; written only through fence.raise and fence.reset';
REVOKE ALL ON TABLE fence.tokens FROM PUBLIC;
GRANT SELECT ON TABLE fence.tokens TO PUBLIC;

-- The proxy key (P5): one row, set by `fenceproxy migrate --key-file` (fence.Migrate's
-- SetKey), read by nobody but the owner.
CREATE TABLE fence.keys (
    id         smallint    NOT NULL DEFAULT 1,
    key        bytea       NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT keys_pkey PRIMARY KEY (id),
    CONSTRAINT keys_one_row CHECK (id = 1),
    CONSTRAINT keys_long_enough CHECK (octet_length(key) >= 16)
);
COMMENT ON TABLE fence.keys IS
    'fenceproxy: the proxy key that proves a bind or raise came from fenceproxy; readable by the owner only';
REVOKE ALL ON TABLE fence.keys FROM PUBLIC;

-- One row per bound backend. Rows of backends that have exited stay until their pid is bound
-- again, the next raise of their resource, or a bind that sweeps them (fence.forget_exited,
-- one bind in 64) removes them; a row matches a live backend only
-- with its backend_start, so a leftover never stands for another backend. UNLOGGED: a binding
-- means something only while its backend lives, and no backend outlives a crash (which
-- empties unlogged tables) or a failover (a promoted standby has no backends of the old
-- primary); so binds write no WAL for it.
CREATE UNLOGGED TABLE fence.bindings (
    pid           integer          NOT NULL,
    backend_start timestamptz      NOT NULL,
    resource      text COLLATE "C" NOT NULL,
    token         bigint           NOT NULL,
    bound_at      timestamptz      NOT NULL DEFAULT now(),
    CONSTRAINT bindings_pkey PRIMARY KEY (pid, backend_start),
    CONSTRAINT bindings_token_positive CHECK (token > 0)
);
CREATE INDEX bindings_resource_token ON fence.bindings (resource, token);
COMMENT ON TABLE fence.bindings IS
    'fenceproxy: backends bound to a fencing token (written only through fence.bind, fence.raise and fence.reset)';
REVOKE ALL ON TABLE fence.bindings FROM PUBLIC;
GRANT SELECT ON TABLE fence.bindings TO PUBLIC;

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

-- One row per committed raise or reset (H1, H2): fenceproxy fence history reads it.
CREATE TABLE fence.history (
    id               bigint GENERATED ALWAYS AS IDENTITY,
    resource         text NOT NULL,
    token            bigint NOT NULL,
    previous         bigint,          -- the token stored before (0 or NULL: none)
    holder           text,            -- the holder of token when known (a PostgreSQL lease's)
    reset            boolean NOT NULL, -- fence.reset (an operator), which may also lower it
    raised_at        timestamptz NOT NULL,
    role             name NOT NULL,   -- session_user of the raising backend
    application_name text,            -- that backend's application_name (its client's word)
    client_addr      inet,            -- that backend's client (NULL: a Unix socket)
    pid              integer NOT NULL,
    CONSTRAINT history_pkey PRIMARY KEY (id)
);
CREATE INDEX history_resource ON fence.history (resource, id);
COMMENT ON TABLE fence.history IS
    'fenceproxy: every committed raise and reset of a fencing token (fenceproxy fence history); written only by fence.record_raise';
REVOKE ALL ON TABLE fence.history FROM PUBLIC; -- (H2)
GRANT SELECT ON TABLE fence.history TO PUBLIC;

-- One row per resource whose tokens a lock service (Consul, etcd, ZooKeeper) issues: the
-- highest token admitted on its word, its holder, and a regression (C1-C5, W1).
CREATE TABLE fence.consul_tokens (
    resource     text COLLATE "C" NOT NULL,
    token        bigint           NOT NULL DEFAULT 0,
    holder       text             NOT NULL DEFAULT '',
    regression   text,
    regressed_at timestamptz,
    updated_at   timestamptz      NOT NULL DEFAULT now(),
    CONSTRAINT consul_tokens_pkey PRIMARY KEY (resource),
    CONSTRAINT consul_tokens_resource_valid CHECK (resource ~ '^[a-z][a-z0-9_.-]{0,62}$'),
    CONSTRAINT consul_tokens_token_not_negative CHECK (token >= 0)
);
COMMENT ON TABLE fence.consul_tokens IS
    'fenceproxy: per Consul-validated resource, the highest token admitted, its holder session, and a regression (fail closed until fence.reset)';
REVOKE ALL ON TABLE fence.consul_tokens FROM PUBLIC;
GRANT SELECT ON TABLE fence.consul_tokens TO PUBLIC;
