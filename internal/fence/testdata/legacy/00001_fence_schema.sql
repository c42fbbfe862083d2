-- The fence schema: the highest admitted fencing token per resource, and the functions the
-- proxy injects around its clients' transactions.
--
-- The guarantee these objects discharge, for every resource R: once a token t' for R has been
-- admitted (raised here), no transaction that runs under a token t < t' commits a change.
--
-- Every function is SECURITY DEFINER, so that application roles need neither write access to
-- fence.tokens nor the right to lock its rows, and pins search_path to pg_catalog, pg_temp
-- (pg_temp last, so a temporary object can never shadow anything) with every name inside
-- schema-qualified: a caller's search_path cannot redirect what runs with the owner's rights.
--
-- The schema itself is created by fence.Migrate before goose runs, under the migration lock:
-- goose keeps its version table (fence.goose_db_version) in it, and creates that table before
-- the first migration. goose applies this file once; given the schema, it can also be re-run
-- by hand without harm (IF NOT EXISTS, CREATE OR REPLACE).

-- +goose Up

COMMENT ON SCHEMA fence IS
    'fenceproxy: fencing tokens (highest admitted token per resource) and the functions the proxy injects';

-- One row per resource. The column is COLLATE "C" so that the name pattern, the primary key and
-- every comparison behave the same whatever the database's default collation is.
CREATE TABLE IF NOT EXISTS fence.tokens (
    resource   text COLLATE "C" NOT NULL,
    token      bigint           NOT NULL,
    updated_at timestamptz      NOT NULL DEFAULT now(),
    CONSTRAINT tokens_pkey PRIMARY KEY (resource),
    CONSTRAINT tokens_resource_valid CHECK (resource ~ '^[a-z][a-z0-9_.-]{0,62}$'),
    CONSTRAINT tokens_token_nonnegative CHECK (token >= 0)
);

COMMENT ON TABLE fence.tokens IS
    'fenceproxy: the highest admitted fencing token per resource; written only through fence.raise and fence.reset';

-- fence.raise(resource, token) admits a token: it stores it when it is higher than the stored
-- one (or when no row exists yet) and returns the token stored afterwards. A result higher than
-- the argument means a newer token was admitted already: the caller must refuse its session.
--
-- Run it in its own short transaction (the proxy does, autocommit): it locks the resource's row
-- until that transaction ends, and every writer's commit-time check waits for that lock.
--
-- Proof obligations:
-- * Monotonic: the WHERE of DO UPDATE only ever replaces a lower token. Under READ COMMITTED an
--   ON CONFLICT DO UPDATE that meets a concurrent raise waits for it and re-evaluates its WHERE
--   against the newest row version, so two concurrent raises leave the higher token stored.
-- * Never blocked by a frozen old leader: fence.check takes its row lock only while its own
--   transaction commits (see fence.check), so an old transaction stuck mid-way holds no lock on
--   this row and the raise commits at once. Only a transaction that already passed its check
--   makes the raise wait, until it has committed: that commit is ordered before the admission.
-- * Isolation: the proxy should run it under READ COMMITTED. Under REPEATABLE READ or
--   SERIALIZABLE (a session's default_transaction_isolation) a raise that meets a concurrent
--   raise of the same resource fails with 40001 instead of waiting and re-checking; retry it.
-- * Prompt: only a real change notifies 'fence_raise' with the payload '<resource> <token>'.
--   NOTIFY is transactional, so listeners hear of the raise when it commits, never before.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.raise(resource text, token bigint)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    -- Aliases, and column references always qualified: the parameter names are also column
    -- names, and "check" is a reserved word that cannot qualify a parameter.
    p_resource ALIAS FOR $1;
    p_token    ALIAS FOR $2;
    stored     bigint;
BEGIN
    IF p_token IS NULL OR p_token <= 0 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = pg_catalog.format('malformed fencing token: %s (a fencing token is an integer greater than 0)',
                                        coalesce(p_token::text, 'NULL')),
            HINT = 'Use the LockIndex of the Consul lock that this process holds.';
    END IF;
    IF p_resource IS NULL OR p_resource !~ '^[a-z][a-z0-9_.-]{0,62}$' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = pg_catalog.format('malformed fencing resource name: %s', pg_catalog.quote_nullable(p_resource)),
            HINT = 'A resource name is 1 to 63 characters of a-z, 0-9, "_", "." and "-", starting with a letter.';
    END IF;

    INSERT INTO fence.tokens AS t (resource, token)
    VALUES (p_resource, p_token)
    ON CONFLICT ON CONSTRAINT tokens_pkey DO UPDATE
        SET token = excluded.token, updated_at = pg_catalog.now()
        WHERE t.token < excluded.token
    RETURNING t.token INTO stored;

    IF FOUND THEN
        PERFORM pg_catalog.pg_notify('fence_raise', p_resource || ' ' || p_token);
        RETURN stored;
    END IF;

    -- Equal or higher token stored. The ON CONFLICT left the row locked by this transaction, so
    -- this read returns the value that stopped the raise, not a newer one.
    SELECT t.token INTO stored FROM fence.tokens AS t WHERE t.resource = p_resource;
    RETURN stored;
END
$fn$;
-- +goose StatementEnd

COMMENT ON FUNCTION fence.raise(text, bigint) IS
    'fenceproxy: admit a fencing token (store it if higher); returns the stored token, higher than the argument when a newer one was admitted';

-- fence.check(resource, token) is the commit-time check: the proxy runs it inside the client's
-- transaction immediately before that transaction commits (before COMMIT / PREPARE TRANSACTION,
-- at the end of an implicit transaction). An error aborts the transaction: none of its changes
-- commit. Like a deferred constraint failing at commit.
--
-- Proof obligations:
-- * The xid test comes first. A transaction without an xid wrote nothing (no row, no lock, no
--   DDL), so it has nothing to fence and must stay cheap; the test must precede the row lock
--   because SELECT ... FOR SHARE assigns an xid itself. Reads are thus never blocked nor
--   refused by fencing (the guarantee fences changes only).
-- * FOR SHARE at commit time, not at the first write. The shared row lock conflicts with the
--   raise's row lock, so either the raise commits first (and this check sees its token and
--   fails) or the check locks first (and the raise waits until this transaction has committed:
--   the commit is ordered before the admission of the newer token). Taking the lock only here
--   keeps it held for the commit alone: a leader frozen in the middle of a transaction holds no
--   lock on the row, so the new leader's raise does not wait for it, and when the old one wakes
--   this check fails and its writes are rolled back. Locking at the first write would make
--   every new leader wait for every frozen old transaction (and create a MultiXact per
--   concurrent writer on one hot row).
-- * Isolation levels. Under READ COMMITTED, FOR SHARE reads the newest committed version of
--   the row (after waiting for an in-flight raise), whatever the statement snapshot. Under
--   REPEATABLE READ and SERIALIZABLE it cannot return a version newer than the transaction's
--   snapshot: a raise committed after the snapshot makes it fail with serialization_failure
--   (40001). That is still a rejection, but it must be reported as the fencing error ZF001,
--   which is not retriable, rather than as a serialization failure, which a client would
--   retry under the same stale token. The EXCEPTION block that catches it costs a
--   subtransaction, so it is entered only when the isolation level is not READ COMMITTED,
--   where 40001 cannot come from FOR SHARE.
-- * A missing row means no token was ever admitted for the resource: the proxy raises before it
--   admits a session, so a check without a row is refused rather than let through.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.check(resource text, token bigint)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    p_resource ALIAS FOR $1;
    p_token    ALIAS FOR $2;
    stored     bigint;
BEGIN
    IF pg_catalog.pg_current_xact_id_if_assigned() IS NULL THEN
        RETURN;
    END IF;

    IF p_token IS NULL OR p_token <= 0 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = pg_catalog.format('malformed fencing token: %s (a fencing token is an integer greater than 0)',
                                        coalesce(p_token::text, 'NULL'));
    END IF;
    IF p_resource IS NULL OR p_resource !~ '^[a-z][a-z0-9_.-]{0,62}$' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = pg_catalog.format('malformed fencing resource name: %s', pg_catalog.quote_nullable(p_resource));
    END IF;

    IF pg_catalog.current_setting('transaction_isolation') = 'read committed' THEN
        SELECT t.token INTO stored
        FROM fence.tokens AS t
        WHERE t.resource = p_resource
        FOR SHARE;
    ELSE
        BEGIN
            SELECT t.token INTO stored
            FROM fence.tokens AS t
            WHERE t.resource = p_resource
            FOR SHARE;
        EXCEPTION WHEN serialization_failure THEN
            RAISE EXCEPTION USING
                ERRCODE = 'ZF001',
                MESSAGE = pg_catalog.format('stale fencing token: resource "%s" token %s was superseded by a token admitted while this transaction ran',
                                            p_resource, p_token),
                DETAIL = 'The transaction was rolled back; none of its changes were committed.',
                HINT = pg_catalog.format('This process is no longer the leader for "%s": stop writing, acquire the lock again to get a new fencing token, and reconnect with it.',
                                         p_resource);
        END;
    END IF;

    IF NOT FOUND THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF001',
            MESSAGE = pg_catalog.format('stale fencing token: resource "%s" token %s was not admitted (no token is stored for this resource)',
                                        p_resource, p_token),
            DETAIL = 'The transaction was rolled back; none of its changes were committed.',
            HINT = 'The token must be raised (fence.raise) before a session writes with it; reconnect through fenceproxy, which does so.';
    END IF;

    IF stored > p_token THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF001',
            MESSAGE = pg_catalog.format('stale fencing token: resource "%s" token %s is lower than the highest admitted token %s',
                                        p_resource, p_token, stored),
            DETAIL = 'The transaction was rolled back; none of its changes were committed.',
            HINT = pg_catalog.format('This process is no longer the leader for "%s": stop writing, acquire the lock again to get a new fencing token, and reconnect with it.',
                                     p_resource);
    END IF;
END
$fn$;
-- +goose StatementEnd

COMMENT ON FUNCTION fence.check(text, bigint) IS
    'fenceproxy: commit-time fencing check; no-op for a transaction that wrote nothing, error ZF001 when a higher token was admitted';

-- fence.check_readonly() is injected at the commit point of unfenced (read-only) sessions:
-- a transaction that wrote anything (it has an xid: a row, a lock, DDL, a temporary table) is
-- refused, so that such a session cannot change data behind the fencing.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.check_readonly()
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF pg_catalog.pg_current_xact_id_if_assigned() IS NOT NULL THEN
        RAISE EXCEPTION USING
            ERRCODE = '25006', -- read_only_sql_transaction
            MESSAGE = 'fenceproxy: this session is read-only (no fencing token); its transaction tried to write',
            DETAIL = 'The transaction was rolled back; none of its changes were committed.',
            HINT = 'Connect with a fencing token (the fence.token connection option) to write through fenceproxy.';
    END IF;
END
$fn$;
-- +goose StatementEnd

COMMENT ON FUNCTION fence.check_readonly() IS
    'fenceproxy: commit-time check of unfenced sessions; error 25006 when the transaction wrote';

-- fence.reset(resource, token) is the operator's way out after a Consul LockIndex regression
-- (lock key deleted and re-created, plain PUT on a held key, snapshot restore): it stores
-- exactly the given token, lower or not, and returns the token stored before (NULL if none).
-- It notifies 'fence_raise' with the payload '<resource> <token> reset', so that proxies that
-- track the highest token they know of replace it instead of keeping the higher one.
-- Token 0 is allowed here (fence.raise refuses it): it keeps the row but admits any token.
-- Not granted to PUBLIC: lowering the stored token re-admits stale leaders.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.reset(resource text, token bigint)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    p_resource ALIAS FOR $1;
    p_token    ALIAS FOR $2;
    previous   bigint;
BEGIN
    IF p_token IS NULL OR p_token < 0 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = pg_catalog.format('malformed fencing token: %s (fence.reset takes an integer of 0 or more)',
                                        coalesce(p_token::text, 'NULL'));
    END IF;
    IF p_resource IS NULL OR p_resource !~ '^[a-z][a-z0-9_.-]{0,62}$' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = pg_catalog.format('malformed fencing resource name: %s', pg_catalog.quote_nullable(p_resource));
    END IF;

    SELECT t.token INTO previous FROM fence.tokens AS t WHERE t.resource = p_resource FOR UPDATE;

    INSERT INTO fence.tokens AS t (resource, token)
    VALUES (p_resource, p_token)
    ON CONFLICT ON CONSTRAINT tokens_pkey DO UPDATE
        SET token = excluded.token, updated_at = pg_catalog.now();

    PERFORM pg_catalog.pg_notify('fence_raise', p_resource || ' ' || p_token || ' reset');
    RETURN previous;
END
$fn$;
-- +goose StatementEnd

COMMENT ON FUNCTION fence.reset(text, bigint) IS
    'fenceproxy: operator only; set the stored token to exactly this value (may lower it); returns the previous token';

-- Privileges. Functions are executable by PUBLIC when created, hence the explicit REVOKE first.
-- Application roles read tokens (for diagnostics) and call raise/check/check_readonly, whose
-- owner's rights do the writing and locking; nobody but the owner writes fence.tokens directly
-- or calls fence.reset (GRANT EXECUTE ON FUNCTION fence.reset to an operator role if needed).
REVOKE ALL ON SCHEMA fence FROM PUBLIC;
GRANT USAGE ON SCHEMA fence TO PUBLIC;
REVOKE ALL ON TABLE fence.tokens FROM PUBLIC;
GRANT SELECT ON TABLE fence.tokens TO PUBLIC;
REVOKE ALL ON FUNCTION fence.raise(text, bigint), fence.check(text, bigint),
    fence.check_readonly(), fence.reset(text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fence.raise(text, bigint), fence.check(text, bigint),
    fence.check_readonly() TO PUBLIC;

-- +goose Down

-- The schema stays: goose keeps its version table (fence.goose_db_version) in it.
DROP FUNCTION IF EXISTS fence.reset(text, bigint);
DROP FUNCTION IF EXISTS fence.check_readonly();
DROP FUNCTION IF EXISTS fence.check(text, bigint);
DROP FUNCTION IF EXISTS fence.raise(text, bigint);
DROP TABLE IF EXISTS fence.tokens;
