-- Version 3 of the hot path: the commit-time check without PL/pgSQL, without a snapshot read and
-- without an advisory lock. Measured with callgrind on the PostgreSQL backend of one pgbench
-- session (tpcb-like without branch updates, simple protocol, through fenceproxy; instructions
-- per transaction, repeatable within 0.3%; `bash bench/check-cost.sh`, docs/BENCHMARKS.md): no
-- check 363 k; version 2's check +111 k (23 k in the resource-name regex, 33 k in the SPI
-- SELECT of the token row, the rest in the PL/pgSQL call, the advisory lock and
-- current_setting); an empty PL/pgSQL function +36.5 k; this version +39 k, of which 26.5 k is
-- what any statement added at a commit costs.
--
-- Where the token lives now. Every row of fence.tokens has a mirror: the sequence
-- fence_token."<resource>" (named exactly as the resource, in a schema of its own so that no name
-- can clash), whose last value is the row's token. A trigger on fence.tokens keeps the mirror
-- (created with the row, moved with every change of the token, dropped with the row), in the
-- same transaction as the change, so nothing else changes for raise, reset or a reader of
-- fence.tokens.
--
-- Why a sequence. pg_catalog.pg_sequence_last_value() is a built-in function that reads the
-- sequence's one page directly, not through a snapshot, and it takes a RowExclusiveLock on the
-- sequence that its transaction holds until it ends (a "fast-path" lock: no shared lock table).
-- A change of the token is `ALTER SEQUENCE ... RESTART` plus setval() in the raising
-- transaction: RESTART gives the sequence a new file, which other sessions use only once the
-- transaction commits and which is thrown away if it aborts (so the mirror is transactional,
-- unlike a bare setval), and it takes a ShareRowExclusiveLock, which conflicts with every
-- check's RowExclusiveLock. Proof obligations (the guarantee of version 1, kept):
-- * Ordering. Either the check locks the sequence first: the raise's RESTART waits until the
--   checked transaction has ended, so its commit precedes the admission of the newer token. Or
--   the raise locks first: the check waits until the raise has ended, and then reads the
--   sequence as the raise left it (taking a lock makes a session process the invalidations
--   that point it to the sequence's new file). Measured on PostgreSQL 15: a RESTART waits for
--   a transaction that read the sequence; a reader waits for an uncommitted RESTART and then
--   returns the new value; a rolled back RESTART plus setval leaves the old value.
-- * Every isolation level. The read is not through the transaction's snapshot, so REPEATABLE
--   READ and SERIALIZABLE see a raise committed after their snapshot and refuse with ZF001
--   (version 2 needed FOR SHARE there, which failed with 40001).
-- * Only at commit time. The lock is taken by the check, immediately before the commit; a
--   leader frozen in the middle of a transaction holds nothing, and the raise does not wait.
-- * Nothing to subvert. fence.check is a SQL function that PostgreSQL inlines into the
--   proxy's prepared statement, so it runs with the caller's rights: the caller can read the
--   sequences (SELECT, granted to PUBLIC; the tokens are not secret) but not change them
--   (setval and nextval need UPDATE or USAGE, granted to nobody), and cannot create objects in
--   fence_token. Every name in the body is schema-qualified, operators included, since an
--   inlined body is resolved with the caller's search_path.
-- * Fail closed. No sequence (no token stored), a sequence never set, or a stored token above
--   the session's: the check calls fence.reject, which raises the error. Any error in between
--   (a sequence dropped under the check, say) fails the transaction too.
--
-- fence.raise and fence.reset are unchanged: their advisory lock no longer orders checks (no
-- check takes it), it only serialises raises and resets of one resource.

-- +goose Up

CREATE SCHEMA IF NOT EXISTS fence_token;
COMMENT ON SCHEMA fence_token IS
    'fenceproxy: one sequence per resource, named as the resource, mirroring fence.tokens.token (read by fence.check)';
REVOKE ALL ON SCHEMA fence_token FROM PUBLIC;
GRANT USAGE ON SCHEMA fence_token TO PUBLIC;

-- fence.mirror_token keeps fence_token."<resource>" equal to the row's token (trigger
-- function; runs with the owner's rights, whoever changes fence.tokens).
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.mirror_token()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    seq text;
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        FOR seq IN
            SELECT pg_catalog.format('fence_token.%I', c.relname)
            FROM pg_catalog.pg_class AS c
            WHERE c.relnamespace = 'fence_token'::pg_catalog.regnamespace AND c.relkind = 'S'
        LOOP
            EXECUTE pg_catalog.format('DROP SEQUENCE %s', seq);
        END LOOP;
        RETURN NULL;
    END IF;
    IF TG_OP = 'DELETE' OR (TG_OP = 'UPDATE' AND OLD.resource <> NEW.resource) THEN
        EXECUTE pg_catalog.format('DROP SEQUENCE IF EXISTS fence_token.%I', OLD.resource);
        IF TG_OP = 'DELETE' THEN
            RETURN NULL;
        END IF;
    ELSIF TG_OP = 'UPDATE' AND OLD.token = NEW.token
          AND pg_catalog.pg_sequence_last_value(pg_catalog.to_regclass(pg_catalog.format('fence_token.%I', NEW.resource)))
              IS NOT DISTINCT FROM NEW.token THEN
        RETURN NULL; -- updated_at only, and the mirror is right: no new file
    END IF;

    seq := pg_catalog.format('fence_token.%I', NEW.resource);
    IF pg_catalog.to_regclass(seq) IS NULL THEN
        EXECUTE pg_catalog.format('CREATE SEQUENCE %s AS bigint MINVALUE 0 START WITH %s', seq, NEW.token);
        EXECUTE pg_catalog.format('GRANT SELECT ON SEQUENCE %s TO PUBLIC', seq);
        EXECUTE pg_catalog.format('COMMENT ON SEQUENCE %s IS %L', seq,
            'fenceproxy: last value = fence.tokens.token of resource ' || NEW.resource || ' (kept by a trigger)');
    ELSE
        EXECUTE pg_catalog.format('ALTER SEQUENCE %s RESTART WITH %s', seq, NEW.token);
    END IF;
    PERFORM pg_catalog.setval(seq::pg_catalog.regclass, NEW.token, true);
    RETURN NULL;
END
$fn$;
-- +goose StatementEnd

REVOKE ALL ON FUNCTION fence.mirror_token() FROM PUBLIC;

DROP TRIGGER IF EXISTS tokens_mirror ON fence.tokens;
CREATE TRIGGER tokens_mirror
    AFTER INSERT OR UPDATE OR DELETE ON fence.tokens
    FOR EACH ROW EXECUTE FUNCTION fence.mirror_token();
DROP TRIGGER IF EXISTS tokens_mirror_truncate ON fence.tokens;
CREATE TRIGGER tokens_mirror_truncate
    AFTER TRUNCATE ON fence.tokens
    FOR EACH STATEMENT EXECUTE FUNCTION fence.mirror_token();

-- Mirror the rows that exist already: an update that keeps each token fires the trigger, which
-- creates the sequence when it is missing.
UPDATE fence.tokens SET token = token;

-- fence.reject is the check's error path: it finds out what is wrong and raises the error.
-- Only ever called by fence.check (directly, or inlined) when the check fails; it never returns.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.reject(resource text, token bigint)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    p_resource ALIAS FOR $1;
    p_token    ALIAS FOR $2;
    seq        regclass;
    stored     bigint;
BEGIN
    IF p_token IS NULL OR p_token <= 0 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('malformed fencing token: %s (a fencing token is an integer greater than 0)',
                             quote_nullable(p_token));
    END IF;
    IF p_resource IS NULL OR p_resource !~ '^[a-z][a-z0-9_.-]{0,62}$' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('malformed fencing resource name: %s', quote_nullable(p_resource));
    END IF;

    seq := to_regclass(format('fence_token.%I', p_resource));
    IF seq IS NOT NULL THEN
        stored := pg_sequence_last_value(seq);
    END IF;
    IF stored IS NULL THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF001',
            MESSAGE = format('stale fencing token: resource "%s" token %s was not admitted (no token is stored for this resource)',
                             p_resource, p_token),
            DETAIL = 'The transaction was rolled back; none of its changes were committed.',
            HINT = 'The token must be raised (fence.raise) before a session writes with it; reconnect through fenceproxy, which does so.';
    END IF;
    IF stored > p_token THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF001',
            MESSAGE = format('stale fencing token: resource "%s" token %s is lower than the highest admitted token %s',
                             p_resource, p_token, stored),
            DETAIL = 'The transaction was rolled back; none of its changes were committed.',
            HINT = format('This process is no longer the leader for "%s": stop writing, acquire the lock again to get a new fencing token, and reconnect with it.',
                          p_resource);
    END IF;
    -- The check failed, yet the token now passes: the stored token was lowered (fence.reset)
    -- between the check and this call. Refuse anyway: the check's answer stands.
    RAISE EXCEPTION USING
        ERRCODE = 'ZF001',
        MESSAGE = format('stale fencing token: resource "%s" token %s was refused while the stored token changed (now %s)',
                         p_resource, p_token, stored),
        DETAIL = 'The transaction was rolled back; none of its changes were committed.',
        HINT = 'Retry the transaction.';
END
$fn$;
-- +goose StatementEnd

COMMENT ON FUNCTION fence.reject(text, bigint) IS
    'fenceproxy: the error path of fence.check (raises ZF001 or ZF004); never returns';

-- fence.check(resource, token), injected at the commit point of every fenced transaction: a no-op
-- when the transaction wrote nothing (no xid; reading the sequence would not assign one, but
-- would take its lock); otherwise it passes when the mirror of the stored token is at most the
-- session's token, and calls fence.reject in every other case (no sequence, never set, higher,
-- a malformed token or a name too long to be a resource, which PostgreSQL would truncate to
-- another resource's name). A constant resource and token, as the proxy's prepared statement
-- has, fold the sequence's name into a constant at planning.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.check(resource text, token bigint)
RETURNS void
LANGUAGE sql
VOLATILE
SECURITY INVOKER
AS $fn$
SELECT CASE
    WHEN pg_catalog.pg_current_xact_id_if_assigned() IS NULL THEN NULL
    WHEN token OPERATOR(pg_catalog.>) 0::bigint
         AND pg_catalog.octet_length(resource) OPERATOR(pg_catalog.<) 64
         AND (pg_catalog.pg_sequence_last_value(pg_catalog.to_regclass(
                  'fence_token.'::pg_catalog.text OPERATOR(pg_catalog.||) pg_catalog.quote_ident(resource)))
              OPERATOR(pg_catalog.<=) token) IS TRUE THEN NULL
    ELSE fence.reject(resource, token)
END
$fn$;
-- +goose StatementEnd

COMMENT ON FUNCTION fence.check(text, bigint) IS
    'fenceproxy: commit-time check; no-op without writes, ZF001 when the session''s token is not the highest admitted one';

-- fence.check_readonly(), injected at the commit point of read-only sessions: a no-op when the
-- transaction wrote nothing, fence.reject_write otherwise. Inlined like fence.check.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.reject_write()
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    RAISE EXCEPTION USING
        ERRCODE = '25006', -- read_only_sql_transaction
        MESSAGE = 'fenceproxy: this session is read-only (no fencing token); its transaction tried to write',
        DETAIL = 'The transaction was rolled back; none of its changes were committed.',
        HINT = 'Connect with a fencing token (the fence.token connection option) to write through fenceproxy.';
END
$fn$;
-- +goose StatementEnd

COMMENT ON FUNCTION fence.reject_write() IS
    'fenceproxy: the error path of fence.check_readonly (raises 25006); never returns';

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.check_readonly()
RETURNS void
LANGUAGE sql
VOLATILE
SECURITY INVOKER
AS $fn$
SELECT CASE
    WHEN pg_catalog.pg_current_xact_id_if_assigned() IS NULL THEN NULL
    ELSE fence.reject_write()
END
$fn$;
-- +goose StatementEnd

REVOKE ALL ON FUNCTION fence.reject(text, bigint), fence.reject_write() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fence.reject(text, bigint), fence.reject_write() TO PUBLIC;

-- +goose Down

-- Back to version 2's check (PL/pgSQL, advisory lock and snapshot read under READ COMMITTED,
-- FOR SHARE otherwise), which reads fence.tokens; the mirror goes.
DROP TRIGGER IF EXISTS tokens_mirror ON fence.tokens;
DROP TRIGGER IF EXISTS tokens_mirror_truncate ON fence.tokens;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.check(resource text, token bigint)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
AS $fn$
DECLARE
    p_resource ALIAS FOR $1;
    p_token    ALIAS FOR $2;
    stored     bigint;
BEGIN
    IF pg_catalog.pg_current_xact_id_if_assigned() IS NULL THEN
        RETURN;
    END IF;
    IF p_token IS NULL OR p_token OPERATOR(pg_catalog.<=) 0::bigint
       OR p_resource IS NULL OR p_resource OPERATOR(pg_catalog.!~) '^[a-z][a-z0-9_.-]{0,62}$'::pg_catalog.text THEN
        PERFORM fence.reject(p_resource, p_token);
    END IF;
    IF pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.=) 'read committed'::pg_catalog.text THEN
        PERFORM pg_catalog.pg_advisory_xact_lock_shared(1717919331, pg_catalog.hashtext(p_resource));
        SELECT t.token INTO stored FROM fence.tokens AS t WHERE t.resource OPERATOR(pg_catalog.=) p_resource;
    ELSE
        BEGIN
            SELECT t.token INTO stored FROM fence.tokens AS t WHERE t.resource OPERATOR(pg_catalog.=) p_resource FOR SHARE;
        EXCEPTION WHEN serialization_failure THEN
            RAISE EXCEPTION USING
                ERRCODE = 'ZF001',
                MESSAGE = pg_catalog.format('stale fencing token: resource "%s" token %s was superseded by a token admitted while this transaction ran',
                                            p_resource, p_token);
        END;
    END IF;
    IF stored IS NULL OR stored OPERATOR(pg_catalog.>) p_token THEN
        -- fence.reject reads the mirror, which the Down migration drops: the messages lose the
        -- stored token, the SQLSTATE stays.
        RAISE EXCEPTION USING
            ERRCODE = 'ZF001',
            MESSAGE = pg_catalog.format('stale fencing token: resource "%s" token %s is not the highest admitted token (%s)',
                                        p_resource, p_token, pg_catalog.quote_nullable(stored));
    END IF;
END
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fence.check_readonly()
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
AS $fn$
BEGIN
    IF pg_catalog.pg_current_xact_id_if_assigned() IS NOT NULL THEN
        PERFORM fence.reject_write();
    END IF;
END
$fn$;
-- +goose StatementEnd

DROP FUNCTION IF EXISTS fence.mirror_token();
DROP SCHEMA IF EXISTS fence_token CASCADE;
