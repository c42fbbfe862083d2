-- Version 4 of the fence schema: fencing by binding sessions (mechanism v2).
--
-- Versions 1-3 injected a check before every commit point of a fenced session; their safety
-- rested on the proxy predicting, message by message, where PostgreSQL would commit, and a dozen
-- ordinary message sequences proved the prediction wrong. This version takes the proxy's
-- understanding of SQL and of the protocol out of the guarantee:
--
--   bind(R, t)   at session start, before the client can send anything, the proxy binds the
--                session's backend to (R, t) in fence.bindings, keyed by (pid, backend_start)
--                so that a reused pid is never confused with the backend that had it before.
--                The first bind of a backend wins; a token lower than the stored one is refused.
--   raise(R, t') stores t', ends every live backend bound to R with a lower token
--                (pg_terminate_backend), waits until each one has exited, and only then
--                commits. If one does not exit within the bound, the raise fails and nothing
--                is raised.
--
-- The guarantee, for every resource R: once a token t' for R has been admitted (its raise
-- committed), no transaction that runs under a token t < t' commits afterwards. The proof
-- obligations, each discharged by the code marked with its number below:
--
--  (P1) Binds and raises of one resource serialize. Both lock R's row of fence.tokens: a bind
--       FOR SHARE (binds do not wait for each other), a raise FOR UPDATE (it waits for every
--       bind in flight and every bind waits for it). Under READ COMMITTED a bind that waited
--       reads the token the raise stored; fence.bind refuses any other isolation level, and
--       so does every raise (fence.end_stale: fence.reset's too, which has no fence.verify).
--  (P2) No backend bound to a lower token survives the raise. The raise holds R's row FOR UPDATE
--       from before it lists the bound backends until it commits, so by (P1) no bind of a
--       lower token can commit in between: the list it reads (a fresh snapshot, after the lock)
--       is complete. It signals each, then polls pg_stat_activity (pg_stat_clear_snapshot:
--       the activity view is a per-transaction snapshot otherwise) until none of them is
--       listed. A backend leaves pg_stat_activity in its exit callbacks, after it has aborted
--       its transaction: it can commit nothing after that, and it cannot be bound again.
--  (P3) No later session is admitted with a lower token: bind refuses t < stored after (P1).
--  (P4) Prepared transactions outlive their backend: a transaction a stale session prepared
--       could be committed by anyone after the raise. The raise refuses (ZF011, naming them)
--       while this database holds any prepared transaction, checked after (P2), when no stale
--       backend can prepare one any more (and before it, so that a raise that would fail ends
--       nobody). max_prepared_transactions is 0 by default.
--  (P5) Only the proxy admits a higher token. fence.bind and fence.raise (and fence.settled,
--       whose row lock could stall raises) need a proof: a MAC of what they do ("bind", "raise"
--       or "settled", the database, the resource, the token and the calling backend's pid) under the proxy key in fence.keys, which only this schema's owner can
--       read. The proxy passes the proof as a parameter (extended protocol), so pg_stat_activity
--       does not show it; a proof that leaked anyway could only be replayed from a backend with
--       the same pid. A backend is bound once (first bind wins), so a fenced session
--       cannot re-bind itself to another token or resource either. fence.reset stays the
--       operator's tool (not granted to PUBLIC), and ends lower-bound backends when it raises.
--  (P6) Nothing a client runs can undo a binding: fence.bindings and fence.tokens are written
--       only by these SECURITY DEFINER functions (no privilege on them is granted), whose
--       search_path is pinned and whose every name is schema-qualified.
--  (P7) Admitted means durable: a raise commits with its WAL flushed even when the session
--       turned synchronous_commit off, or a crash could undo an admission already acted on.
--
-- What the owner role needs: pg_signal_backend (to end other roles' backends) and
-- pg_read_all_stats (backend_start of other roles' backends reads NULL without it); a
-- superuser application role's backends can be signalled only by a superuser owner. A raise
-- that cannot signal a bound backend fails (nothing is raised) with the permission error.
--
-- Version-1 objects this design does not need are dropped: the commit-time checks
-- (fence.check, fence.check_readonly and their error paths), the token mirror (the trigger and
-- the fence_token sequences) and the unproven fence.raise(text, bigint).
--
-- Upgrade from version 3 with sessions live: the migration waits for transactions that hold a
-- lock on a fence_token sequence (version-3 checks that ran); proxies of version 3 fail closed
-- afterwards (their check and raise no longer exist, so their commits and new sessions fail).
-- Stop them, migrate, start proxies of this version.

-- +goose Up

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

-- fence.mac(key, kind, resource, token, pid): the MAC the proxy computes with its key (P5):
-- hex(sha256(key || sha256(key || message))), message = kind, database, resource, token and pid
-- joined by newlines, as bytes in the database's encoding (the bytes of the database name that
-- the proxy saw in the startup message). The nested hash is the NMAC construction (no length
-- extension: the outer hash covers a fixed-length inner digest); built-in sha256, no pgcrypto.
-- A plain SQL expression, so that fence.bind's query inlines it; operators schema-qualified,
-- since an inlined body is resolved with the caller's search_path.
-- +goose StatementBegin
CREATE FUNCTION fence.mac(key bytea, kind text, resource text, token bigint, pid integer)
RETURNS text
LANGUAGE sql
STABLE
PARALLEL SAFE
AS $fn$
SELECT pg_catalog.encode(pg_catalog.sha256(key OPERATOR(pg_catalog.||) pg_catalog.sha256(key OPERATOR(pg_catalog.||)
    pg_catalog.convert_to(kind OPERATOR(pg_catalog.||) E'\n' OPERATOR(pg_catalog.||) pg_catalog.current_database()::pg_catalog.text
        OPERATOR(pg_catalog.||) E'\n' OPERATOR(pg_catalog.||) resource OPERATOR(pg_catalog.||) E'\n'
        OPERATOR(pg_catalog.||) token::pg_catalog.text OPERATOR(pg_catalog.||) E'\n' OPERATOR(pg_catalog.||) pid::pg_catalog.text,
        pg_catalog.getdatabaseencoding()))), 'hex')
$fn$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fence.mac(bytea, text, text, bigint, integer) FROM PUBLIC;

-- fence.proof(kind, resource, token, pid): fence.mac under the stored key; NULL when no key is
-- stored. Not granted to PUBLIC.
-- +goose StatementBegin
CREATE FUNCTION fence.proof(kind text, resource text, token bigint, pid integer)
RETURNS text
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
SELECT fence.mac(k.key, kind, resource, token, pid) FROM fence.keys AS k WHERE k.id = 1
$fn$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fence.proof(text, text, bigint, integer) FROM PUBLIC;

-- fence.verify(kind, resource, token, proof): validates the arguments and the proof of the
-- calling backend, or raises ZF004 (malformed), ZF007 (no key stored) or ZF010 (wrong proof).
-- +goose StatementBegin
CREATE FUNCTION fence.verify(kind text, resource text, token bigint, proof text)
RETURNS void
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    p_kind     ALIAS FOR $1;
    p_resource ALIAS FOR $2;
    p_token    ALIAS FOR $3;
    p_proof    ALIAS FOR $4;
    expected   text;
BEGIN
    IF p_token IS NULL OR p_token <= 0 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('malformed fencing token: %s (a fencing token is an integer greater than 0)',
                             coalesce(p_token::text, 'NULL'));
    END IF;
    IF p_resource IS NULL OR p_resource !~ '^[a-z][a-z0-9_.-]{0,62}$' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('malformed fencing resource name: %s', quote_nullable(p_resource)),
            HINT = 'A resource name is 1 to 63 characters of a-z, 0-9, "_", "." and "-", starting with a letter.';
    END IF;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        -- (P1) needs a fresh snapshot per statement after each lock.
        RAISE EXCEPTION USING
            ERRCODE = 'ZF007',
            MESSAGE = format('fencing unavailable: fence.%s must run under READ COMMITTED, not %s',
                             p_kind, current_setting('transaction_isolation'));
    END IF;
    expected := fence.proof(p_kind, p_resource, p_token, pg_backend_pid());
    IF expected IS NULL THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF007',
            MESSAGE = 'fencing unavailable: no proxy key is stored in this database',
            HINT = 'Run fenceproxy migrate --key-file with the key file the proxies use (--key-file).';
    END IF;
    IF p_proof IS NULL OR p_proof <> expected THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF010',
            MESSAGE = format('fencing proof invalid: fence.%s(%L, %s) was not called by fenceproxy with this database''s proxy key',
                             p_kind, p_resource, p_token),
            HINT = 'Only fenceproxy binds sessions and raises tokens. If this is a proxy, its --key-file does not match the key stored by fenceproxy migrate --key-file.';
    END IF;
END
$fn$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fence.verify(text, text, bigint, text) FROM PUBLIC;

-- fence.refuse_prepared(resource, token): raises ZF011, naming them, while this database holds
-- prepared transactions (P4). Not granted to PUBLIC.
-- +goose StatementBegin
CREATE FUNCTION fence.refuse_prepared(resource text, token bigint)
RETURNS void
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    prepared text;
BEGIN
    SELECT string_agg(format('%L (owner %s, prepared %s)', p.gid, p.owner, p.prepared), ', ' ORDER BY p.prepared)
    INTO prepared
    FROM pg_prepared_xacts AS p
    WHERE p.database = current_database();
    IF prepared IS NOT NULL THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF011',
            MESSAGE = format('fencing raise failed: resource "%s" was not raised to token %s because prepared transactions exist in this database: %s',
                             $1, $2, prepared),
            DETAIL = 'A prepared transaction outlives the session that prepared it, so a stale leader''s could commit after the raise.',
            HINT = 'Resolve them with COMMIT PREPARED or ROLLBACK PREPARED (pg_prepared_xacts), then retry; fenced databases should not use two-phase commit.';
    END IF;
END
$fn$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fence.refuse_prepared(text, bigint) FROM PUBLIC;

-- fence.forget_exited(resource): removes the bindings of resource's backends that have exited.
-- One anti-join against the activity list (a live pid whose backend_start reads NULL counts as
-- live). Not granted to PUBLIC.
-- +goose StatementBegin
CREATE FUNCTION fence.forget_exited(resource text)
RETURNS void
LANGUAGE sql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
SELECT pg_stat_clear_snapshot();
DELETE FROM fence.bindings AS b
WHERE b.resource = $1
  AND NOT EXISTS (SELECT 1 FROM pg_stat_get_activity(NULL) AS a
                  WHERE a.pid = b.pid AND (a.backend_start = b.backend_start OR a.backend_start IS NULL));
$fn$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fence.forget_exited(text) FROM PUBLIC;

-- fence.end_stale(resource, token, timeout): (P2) and (P4) for a raise of resource to token.
-- The caller holds resource's row of fence.tokens FOR UPDATE. Ends every live backend bound
-- to a lower token, waits until each one has exited (at most timeout), removes the bindings
-- of the resource's exited backends, and refuses while prepared transactions exist. Returns
-- how many backends it ended. Not granted to PUBLIC.
-- +goose StatementBegin
CREATE FUNCTION fence.end_stale(resource text, token bigint, timeout interval)
RETURNS integer
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    p_resource ALIAS FOR $1;
    p_token    ALIAS FOR $2;
    p_timeout  ALIAS FOR $3;
    victims    integer[];
    alive      integer[];
    deadline   timestamptz := clock_timestamp() + p_timeout;
BEGIN
    -- (P1, P2) Only READ COMMITTED reads fence.bindings with a snapshot taken after the lock:
    -- under REPEATABLE READ the list would miss the bindings committed since the transaction's
    -- snapshot (fence.reset does not pass through fence.verify).
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF007',
            MESSAGE = format('fencing unavailable: a raise of resource "%s" must run under READ COMMITTED, not %s',
                             p_resource, current_setting('transaction_isolation'));
    END IF;
    -- (P2) The list: a fresh snapshot taken after the caller's FOR UPDATE lock. A live backend
    -- with a bound pid whose backend_start reads NULL (the owner lost pg_read_all_stats since
    -- the bind, which needed it) counts as bound: fail closed, never skip a stale backend.
    PERFORM pg_stat_clear_snapshot();
    SELECT array_agg(b.pid ORDER BY b.pid) INTO victims
    FROM fence.bindings AS b
    JOIN pg_stat_get_activity(NULL) AS a ON a.pid = b.pid
        AND (a.backend_start = b.backend_start OR a.backend_start IS NULL)
    WHERE b.resource = p_resource AND b.token < p_token;

    IF victims IS NOT NULL THEN
        -- (P4) first: refuse before ending anyone when the raise would fail anyway.
        PERFORM fence.refuse_prepared(p_resource, p_token);
        -- Signal all first, then poll: ending 100 backends takes the time of the slowest, not
        -- the sum. pg_terminate_backend raises an error when the owner may not signal one:
        -- the raise then fails, nothing raised.
        PERFORM pg_terminate_backend(v) FROM unnest(victims) AS v;
        LOOP
            PERFORM pg_stat_clear_snapshot();
            SELECT array_agg(b.pid ORDER BY b.pid) INTO alive
            FROM fence.bindings AS b
            JOIN pg_stat_get_activity(NULL) AS a ON a.pid = b.pid
                AND (a.backend_start = b.backend_start OR a.backend_start IS NULL)
            WHERE b.resource = p_resource AND b.token < p_token;
            EXIT WHEN alive IS NULL;
            IF clock_timestamp() > deadline THEN
                RAISE EXCEPTION USING
                    ERRCODE = 'ZF011',
                    MESSAGE = format('fencing raise failed: resource "%s" was not raised to token %s because backends bound to a lower token did not exit within %s: pids %s',
                                     p_resource, p_token, p_timeout, array_to_string(alive, ', ')),
                    DETAIL = 'Nothing was raised; the stale sessions were signalled to terminate.',
                    HINT = 'Find out why those backends do not exit (pg_stat_activity), end them, and retry.';
            END IF;
            PERFORM pg_sleep(0.001);
        END LOOP;
    END IF;

    -- Every backend bound to R that is not alive any more, lower token or not, leaves.
    PERFORM pg_stat_clear_snapshot();
    PERFORM fence.forget_exited(p_resource);

    -- (P4) After (P2): no stale backend is left to prepare a transaction.
    PERFORM fence.refuse_prepared(p_resource, p_token);
    RETURN coalesce(cardinality(victims), 0);
END
$fn$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fence.end_stale(text, bigint, interval) FROM PUBLIC;

-- fence.notify(payload, max_usage): tells the listening proxies of a raise on 'fence_raise'
-- (NOTIFY is transactional: they hear of it when the raise commits), unless the notification
-- queue is more than max_usage full. A full queue fails the commit of every transaction that
-- notifies ("too many notifications in the NOTIFY queue", at commit), and any role can fill it
-- (a session that LISTENs and stays idle in a transaction while others notify): notifying
-- regardless would let any client make every raise fail, locking the new leader out. The
-- guarantee does not rest on the notification (P2 ends the stale backends), only the
-- promptness of the proxies' errors, and they ask the database anyway (fence.settled). Not
-- granted to PUBLIC.
-- +goose StatementBegin
CREATE FUNCTION fence.notify(payload text, max_usage double precision DEFAULT 0.5)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF pg_notification_queue_usage() < max_usage THEN
        PERFORM pg_notify('fence_raise', payload);
    ELSE
        RAISE LOG 'fenceproxy: raise "%" not notified: the NOTIFY queue is %%% full',
            payload, round((100 * pg_notification_queue_usage())::numeric, 1);
    END IF;
END
$fn$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fence.notify(text, double precision) FROM PUBLIC;

-- fence.raise_locked(resource, token): the raise. Locks resource's row FOR UPDATE (P1),
-- creating it when missing, and when token is higher than the stored one ends the stale
-- backends (P2, P4), stores it and notifies 'fence_raise' with '<resource> <token>'
-- (fence.notify). Returns the token stored
-- afterwards. Not granted to PUBLIC.
-- +goose StatementBegin
CREATE FUNCTION fence.raise_locked(resource text, token bigint)
RETURNS bigint
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
    INSERT INTO fence.tokens AS t (resource, token) VALUES (p_resource, 0)
    ON CONFLICT ON CONSTRAINT tokens_pkey DO NOTHING;
    SELECT t.token INTO STRICT stored FROM fence.tokens AS t WHERE t.resource = p_resource FOR UPDATE;
    IF stored >= p_token THEN
        RETURN stored;
    END IF;
    PERFORM fence.end_stale(p_resource, p_token, interval '5 seconds');
    UPDATE fence.tokens AS t SET token = p_token, updated_at = now() WHERE t.resource = p_resource;
    PERFORM fence.notify(p_resource || ' ' || p_token);
    -- (P7) The session or its role may have turned synchronous_commit off.
    IF current_setting('synchronous_commit') = 'off' THEN
        PERFORM set_config('synchronous_commit', 'local', true);
    END IF;
    RETURN p_token;
END
$fn$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fence.raise_locked(text, bigint) FROM PUBLIC;

-- fence.bind(resource, token, proof): binds the calling backend to (resource, token), raising
-- the stored token first when token is higher (ending the backends bound to lower ones).
-- Returns the stored token. Refuses (and so binds nothing) with ZF001 when a higher token is
-- stored (P3), ZF008 when this backend is bound already, ZF010 without the proxy's proof (P5).
-- The proxy calls it on the session's own connection, in its own READ COMMITTED transaction,
-- before the client sees ReadyForQuery.
-- +goose StatementBegin
CREATE FUNCTION fence.bind(resource text, token bigint, proof text)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    p_resource ALIAS FOR $1;
    p_token    ALIAS FOR $2;
    p_proof    ALIAS FOR $3;
    me         integer := pg_backend_pid();
    expected   text;
    started    timestamptz;
    stored     bigint;
    bound      text;
BEGIN
    -- One statement for what the common case needs: the expected proof, this backend's
    -- start, the stored token (unlocked: it only chooses the lock below) and this backend's
    -- binding, if any. Every session start runs this, so it is kept to few statements.
    SELECT fence.mac(k.key, 'bind', p_resource, p_token, me), a.backend_start,
           (SELECT t.token FROM fence.tokens AS t WHERE t.resource = p_resource),
           (SELECT pg_catalog.format('resource "%s" token %s', b.resource, b.token)
            FROM fence.bindings AS b WHERE b.pid = me AND b.backend_start = a.backend_start)
    INTO expected, started, stored, bound
    FROM pg_stat_get_activity(me) AS a LEFT JOIN fence.keys AS k ON k.id = 1;
    IF expected IS NULL OR p_proof IS DISTINCT FROM expected OR started IS NULL
       OR p_token IS NULL OR p_token <= 0 OR p_resource IS NULL OR p_resource !~ '^[a-z][a-z0-9_.-]{0,62}$'
       OR current_setting('transaction_isolation') <> 'read committed' THEN
        -- (P5) Raises the error that applies (malformed, isolation, no key, wrong proof).
        PERFORM fence.verify('bind', p_resource, p_token, p_proof);
        RAISE EXCEPTION USING
            ERRCODE = 'ZF007',
            MESSAGE = 'fencing unavailable: the bind cannot read this backend''s backend_start',
            HINT = 'The fence schema''s owner needs pg_read_all_stats (README: Privileges).';
    END IF;
    IF bound IS NOT NULL THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF008',
            MESSAGE = format('not allowed in a fenced session: this session is bound to %s already; a session is bound once', bound),
            HINT = 'Reconnect with the new token.';
    END IF;

    IF stored IS NULL OR stored < p_token THEN
        stored := fence.raise_locked(p_resource, p_token); -- (P1) FOR UPDATE
    ELSE
        -- (P1) FOR SHARE: waits for a raise in flight, then reads its token.
        SELECT t.token INTO STRICT stored FROM fence.tokens AS t WHERE t.resource = p_resource FOR SHARE;
        IF stored < p_token THEN
            -- Lowered by fence.reset since the first read: raise after all.
            stored := fence.raise_locked(p_resource, p_token);
        ELSE
            -- Nothing durable changes (the binding is unlogged, the row lock matters only
            -- until commit): no need to wait for the WAL flush. A raise, which stores a
            -- token, keeps synchronous_commit as the session has it.
            PERFORM set_config('synchronous_commit', 'off', true);
        END IF;
    END IF;
    IF stored > p_token THEN -- (P3)
        RAISE EXCEPTION USING
            ERRCODE = 'ZF001',
            MESSAGE = format('stale fencing token: resource "%s" token %s is lower than the highest admitted token %s',
                             p_resource, p_token, stored),
            HINT = format('This process is no longer the leader for "%s": stop writing, acquire the lock again to get a new fencing token, and reconnect with it.',
                          p_resource);
    END IF;

    -- Rows of an earlier backend with this pid go: it has exited (pids are unique among live
    -- backends).
    WITH gone AS (DELETE FROM fence.bindings AS b WHERE b.pid = me)
    INSERT INTO fence.bindings (pid, backend_start, resource, token) VALUES (me, started, p_resource, p_token);
    -- Rows of exited backends whose pid is not reused stay until a raise; one bind in 64 (by
    -- pid) removes those of its resource, so that a leader that keeps its token for weeks of
    -- reconnections does not grow the table with the pid space.
    IF me % 64 = 0 THEN
        PERFORM fence.forget_exited(p_resource);
    END IF;
    RETURN stored;
END
$fn$;
-- +goose StatementEnd

COMMENT ON FUNCTION fence.bind(text, bigint, text) IS
    'fenceproxy: bind this backend to (resource, token), raising the token first when it is higher; needs the proxy''s proof';

-- fence.raise(resource, token, proof): the raise on its own (the proxy's proactive raise when
-- Consul shows a new holder, on the proxy's control connection). Returns the stored token.
-- +goose StatementBegin
CREATE FUNCTION fence.raise(resource text, token bigint, proof text)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    PERFORM fence.verify('raise', $1, $2, $3);
    RETURN fence.raise_locked($1, $2);
END
$fn$;
-- +goose StatementEnd

COMMENT ON FUNCTION fence.raise(text, bigint, text) IS
    'fenceproxy: admit a fencing token, ending the backends bound to lower ones; needs the proxy''s proof; returns the stored token';

-- fence.settled(resource, token, proof): the stored token once no raise of resource is in
-- flight (0 if none is stored). The proxy asks it on its control connection when the server
-- ended a session bound to token: a raise that ended it holds the row FOR UPDATE (P1) until it
-- commits, so this FOR SHARE read returns the raised token as soon as the raise commits, and
-- at once when nothing is being raised (the backend ended for another reason). Proof-gated
-- (P5) because the lock it takes, held in an open transaction, would stall every raise.
-- +goose StatementBegin
CREATE FUNCTION fence.settled(resource text, token bigint, proof text)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    stored bigint;
BEGIN
    PERFORM fence.verify('settled', $1, $2, $3);
    SELECT t.token INTO stored FROM fence.tokens AS t WHERE t.resource = $1 FOR SHARE;
    RETURN coalesce(stored, 0);
END
$fn$;
-- +goose StatementEnd

COMMENT ON FUNCTION fence.settled(text, bigint, text) IS
    'fenceproxy: the stored token once no raise is in flight (waits for one); needs the proxy''s proof';

-- fence.reset(resource, token): the operator's tool (not granted to PUBLIC). Stores exactly
-- token, lower or not, and returns the token stored before (NULL if none). Raising through it
-- ends the lower-bound backends like a raise (P2); lowering it ends nobody and re-admits old
-- tokens: do it only once no holder of the higher one can still be running. Notifies
-- 'fence_raise' with '<resource> <token> reset'.
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
    created    boolean;
BEGIN
    IF p_token IS NULL OR p_token < 0 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('malformed fencing token: %s (fence.reset takes an integer of 0 or more)',
                             coalesce(p_token::text, 'NULL'));
    END IF;
    IF p_resource IS NULL OR p_resource !~ '^[a-z][a-z0-9_.-]{0,62}$' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('malformed fencing resource name: %s', quote_nullable(p_resource));
    END IF;
    INSERT INTO fence.tokens AS t (resource, token) VALUES (p_resource, 0)
    ON CONFLICT ON CONSTRAINT tokens_pkey DO NOTHING;
    created := FOUND;
    SELECT t.token INTO STRICT previous FROM fence.tokens AS t WHERE t.resource = p_resource FOR UPDATE;
    IF p_token > previous THEN
        PERFORM fence.end_stale(p_resource, p_token, interval '5 seconds');
    END IF;
    UPDATE fence.tokens AS t SET token = p_token, updated_at = now() WHERE t.resource = p_resource;
    PERFORM fence.notify(p_resource || ' ' || p_token || ' reset');
    IF current_setting('synchronous_commit') = 'off' THEN -- (P7)
        PERFORM set_config('synchronous_commit', 'local', true);
    END IF;
    RETURN CASE WHEN created THEN NULL ELSE previous END; -- NULL: no token was stored
END
$fn$;
-- +goose StatementEnd

-- Privileges (P5, P6): clients may call bind, raise and settled (which need the proof) and read the
-- tokens and bindings; nothing else.
REVOKE ALL ON FUNCTION fence.bind(text, bigint, text), fence.raise(text, bigint, text),
    fence.settled(text, bigint, text), fence.reset(text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fence.bind(text, bigint, text), fence.raise(text, bigint, text),
    fence.settled(text, bigint, text) TO PUBLIC;

-- +goose Down

-- Not reversible: version 3's commit-time check is the mechanism this version replaces
-- because it could be broken. Restore a backup taken before the upgrade instead.
-- +goose StatementBegin
DO $$ BEGIN RAISE EXCEPTION 'fence schema version 4 cannot be migrated down'; END $$;
-- +goose StatementEnd
