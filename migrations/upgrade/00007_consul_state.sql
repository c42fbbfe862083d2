-- Upgrade step to schema version 7: the lock services' record. Frozen once released.

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
