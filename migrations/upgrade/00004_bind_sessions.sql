-- Upgrade step to schema version 4 (from 1, 2 or 3): the binding mechanism's tables; version 1's
-- commit-time checks, token mirror and unproven raise are dropped (the new functions come from
-- functions/, applied after the steps). Frozen: a step is never edited once released.
--
-- From version 3 with sessions live: DROP SCHEMA fence_token waits for the transactions that
-- hold a lock on one of its sequences (version-3 checks that ran); version-3 proxies fail
-- closed afterwards (their check and raise no longer exist). docs/schema.md: upgrading.

DROP TRIGGER IF EXISTS tokens_mirror ON fence.tokens;
DROP TRIGGER IF EXISTS tokens_mirror_truncate ON fence.tokens;
DROP FUNCTION IF EXISTS fence.mirror_token();
DROP SCHEMA IF EXISTS fence_token CASCADE;
DROP FUNCTION IF EXISTS fence.check(text, bigint);
DROP FUNCTION IF EXISTS fence.check_readonly();
DROP FUNCTION IF EXISTS fence.reject(text, bigint);
DROP FUNCTION IF EXISTS fence.reject_write();
DROP FUNCTION IF EXISTS fence.raise(text, bigint);

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
