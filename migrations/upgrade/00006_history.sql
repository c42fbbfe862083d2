-- Upgrade step to schema version 6: the history of raises. Frozen once released.

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
