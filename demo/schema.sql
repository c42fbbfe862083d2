-- The billing demo's tables, its application role and its customers.
--
-- Run as a superuser in the demo's database (psql -v ON_ERROR_STOP=1 -f demo/schema.sql;
-- the postgres image runs it from /docker-entrypoint-initdb.d). Set the psql variable
-- `customers` to choose how many customers are seeded (default 30):
--     psql -v customers=12 -f demo/schema.sql
--
-- On purpose, charges has NO unique constraint on customer_id and the billing program
-- takes no row locks: the demo shows what fencing prevents, so nothing else may prevent it.

\if :{?customers}
\else
\set customers 30
\endif

SET client_min_messages = warning;

-- The application's role: it logs in through fenceproxy and owns nothing but its rows.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'billing') THEN
        CREATE ROLE billing LOGIN PASSWORD 'billing';
    END IF;
END
$$;

DROP TABLE IF EXISTS charges;
DROP TABLE IF EXISTS customers;

CREATE TABLE customers (
    id           bigint  PRIMARY KEY,
    name         text    NOT NULL,
    amount_cents bigint  NOT NULL CHECK (amount_cents > 0),
    charged      boolean NOT NULL DEFAULT false
);

CREATE TABLE charges (
    id           bigserial   PRIMARY KEY,
    customer_id  bigint      NOT NULL REFERENCES customers (id),  -- not unique: see above
    amount_cents bigint      NOT NULL,
    replica      text        NOT NULL,  -- which replica charged
    token        bigint,                -- the fencing token it ran with (NULL: none)
    charged_at   timestamptz NOT NULL DEFAULT clock_timestamp()
);

INSERT INTO customers (id, name, amount_cents)
SELECT i, 'customer ' || i, 500 + (i * 379) % 4500
FROM generate_series(1, :customers) AS i;

GRANT SELECT, UPDATE ON customers TO billing;
GRANT SELECT, INSERT ON charges TO billing;
GRANT USAGE ON SEQUENCE charges_id_seq TO billing;
