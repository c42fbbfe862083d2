-- fence.bind(resource, token, proof) one backend at a time, as the proxy calls it at session
-- start (its own autocommit transaction) from sessions of an application role that is not a
-- superuser: what binds, what is refused with which SQLSTATE, and that a refusal binds nothing.
\ir _psql.psql

BEGIN;
SELECT plan(68);
\ir _helpers.psql

SELECT pg_temp.store_key() \g /dev/null
SELECT pg_temp.login_role('tap_leader') \g /dev/null
SELECT pg_temp.connect('adm') \g /dev/null
SELECT dblink_exec('adm', $$
    DELETE FROM fence.tokens WHERE resource LIKE 'tap-bind%';
    DELETE FROM fence.bindings WHERE resource LIKE 'tap-bind%';
$$) \g /dev/null

-- A correct proof binds: the row names this backend by pid and backend_start.
SELECT pg_temp.connect('s', 'tap_leader') \g /dev/null
SELECT pg_temp.remote_pid('s') AS s_pid \gset
SELECT is(pg_temp.remote('s', 'SELECT current_user::text || '' '' || (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)'),
    'tap_leader false', 'the session runs as an application role that is not a superuser');
SELECT is(pg_temp.bind('s', 'tap-bind', 33), 33::bigint, 'a bind with the proxy''s proof returns the stored token');
SELECT is(pg_temp.stored('tap-bind'), 33::bigint, '... stores the token of a new resource');
SELECT is((SELECT count(*) FROM fence.bindings WHERE pid = :s_pid), 1::bigint, '... and binds the backend: one row');
SELECT is((SELECT resource || ' ' || token FROM fence.bindings WHERE pid = :s_pid), 'tap-bind 33', '... to the resource and token');
SELECT is((SELECT backend_start FROM fence.bindings WHERE pid = :s_pid),
    (SELECT backend_start FROM dblink('s', 'SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()') AS t(backend_start timestamptz)),
    '... with the backend''s backend_start');
SELECT is(pg_temp.remote('s', 'SELECT 1::text'), '1', 'the bound session goes on');

-- First bind wins (ZF008): neither another token nor another resource, and nothing changes.
SELECT throws_ok($$SELECT pg_temp.bind('s', 'tap-bind', 33)$$, 'ZF008',
    'not allowed in a fenced session: this session is bound to resource "tap-bind" token 33 already; a session is bound once',
    'a second bind of the same backend is ZF008');
SELECT throws_ok($$SELECT pg_temp.bind('s', 'tap-bind', 40)$$, 'ZF008', NULL, '... also with a higher token');
SELECT is(pg_temp.stored('tap-bind'), 33::bigint, '... which is not raised');
SELECT throws_ok($$SELECT pg_temp.bind('s', 'tap-bind-other', 1)$$, 'ZF008', NULL, '... also with another resource');
SELECT is(pg_temp.stored('tap-bind-other'), NULL::bigint, '... which is not created');
SELECT is((SELECT array_agg(resource || ' ' || token) FROM fence.bindings WHERE pid = :s_pid), ARRAY['tap-bind 33'],
    'the first binding is the only one');

-- The proof (P5). Each refusal binds nothing: the same backend binds correctly afterwards.
SELECT pg_temp.connect('s', 'tap_leader') \g /dev/null
SELECT pg_temp.remote_pid('s') AS s_pid \gset
SELECT throws_ok(format('SELECT pg_temp.remote(%L, %L)', 's', pg_temp.call_sql('bind', 'tap-bind', 40, NULL)),
    'ZF010', 'fencing proof invalid: fence.bind(''tap-bind'', 40) was not called by fenceproxy with this database''s proxy key',
    'a bind without a proof is ZF010');
SELECT throws_ok(format('SELECT pg_temp.remote(%L, %L)', 's', pg_temp.call_sql('bind', 'tap-bind', 40, 'f00d')),
    'ZF010', NULL, 'a bind with a made-up proof is ZF010');
SELECT throws_ok(format('SELECT pg_temp.remote(%L, %L)', 's',
        pg_temp.call_sql('bind', 'tap-bind', 40, fence.proof('bind', 'tap-bind', 40, pg_backend_pid()))),
    'ZF010', NULL, 'a proof made for another backend is ZF010');
SELECT throws_ok(format('SELECT pg_temp.remote(%L, %L)', 's',
        pg_temp.call_sql('bind', 'tap-bind', 40, pg_temp.proof('bind', 'tap-bind', 39, 's'))),
    'ZF010', NULL, 'a proof made for another token is ZF010');
SELECT throws_ok(format('SELECT pg_temp.remote(%L, %L)', 's',
        pg_temp.call_sql('bind', 'tap-bind', 40, pg_temp.proof('bind', 'tap-bind-other', 40, 's'))),
    'ZF010', NULL, 'a proof made for another resource is ZF010');
SELECT throws_ok(format('SELECT pg_temp.remote(%L, %L)', 's',
        pg_temp.call_sql('bind', 'tap-bind', 40, pg_temp.proof('raise', 'tap-bind', 40, 's'))),
    'ZF010', NULL, 'a raise''s proof does not bind');
SELECT is(pg_temp.binding_of(:s_pid), NULL, 'none of them bound the backend');
SELECT is(pg_temp.stored('tap-bind'), 33::bigint, '... nor raised the token');

-- A proof under another key (a proxy whose --key-file differs from the stored key) is ZF010; no
-- key stored at all is ZF007.
SELECT pg_temp.bind_sql('s', 'tap-bind', 33) AS good_bind \gset
SELECT pg_temp.store_key(sha256('another key'::bytea)) \g /dev/null
SELECT throws_ok(format('SELECT pg_temp.remote(%L, %L)', 's', :'good_bind'), 'ZF010', NULL,
    'a proof under another key is ZF010');
SELECT dblink_exec('adm', 'DELETE FROM fence.keys') \g /dev/null
SELECT throws_ok(format('SELECT pg_temp.remote(%L, %L)', 's', :'good_bind'), 'ZF007',
    'fencing unavailable: no proxy key is stored in this database', 'no key stored is ZF007');
SELECT pg_temp.store_key() \g /dev/null
SELECT is(pg_temp.binding_of(:s_pid), NULL, 'neither bound the backend');
SELECT is(pg_temp.remote('s', :'good_bind'), '33', 'with the key stored again, the same call binds');
SELECT is(pg_temp.binding_of(:s_pid), 'tap-bind 33', '... the backend');

-- A lower token than the stored one is ZF001 (P3) and binds nothing.
SELECT pg_temp.connect('s', 'tap_leader') \g /dev/null
SELECT pg_temp.remote_pid('s') AS s_pid \gset
SELECT throws_ok($$SELECT pg_temp.bind('s', 'tap-bind', 32)$$, 'ZF001',
    'stale fencing token: resource "tap-bind" token 32 is lower than the highest admitted token 33',
    'a lower token is ZF001, naming the resource, its token and the admitted one');
SELECT is(pg_temp.error_of($$SELECT pg_temp.bind('s', 'tap-bind', 32)$$),
    ARRAY['ZF001',
          'stale fencing token: resource "tap-bind" token 32 is lower than the highest admitted token 33',
          '',
          'This process is no longer the leader for "tap-bind": stop writing, acquire the lock again to get a new fencing token, and reconnect with it.'],
    '... and says what to do');
SELECT is(pg_temp.binding_of(:s_pid), NULL, '... and binds nothing');
SELECT is(pg_temp.stored('tap-bind'), 33::bigint, '... nor lowers the token');
SELECT is(pg_temp.bind('s', 'tap-bind', 33), 33::bigint, 'the refused backend can bind the current token');

-- A higher token raises first, then binds.
SELECT pg_temp.connect('s', 'tap_leader') \g /dev/null
SELECT pg_temp.remote_pid('s') AS s_pid \gset
SELECT pg_temp.raise('adm', 'tap-bind-up', 5) \g /dev/null
SELECT is(pg_temp.bind('s', 'tap-bind-up', 6), 6::bigint, 'a bind with a higher token returns it');
SELECT is(pg_temp.stored('tap-bind-up'), 6::bigint, '... raises the stored token');
SELECT is(pg_temp.binding_of(:s_pid), 'tap-bind-up 6', '... and binds the backend');

-- Malformed arguments are ZF004 whatever the proof, and bind nothing.
SELECT pg_temp.connect('s', 'tap_leader') \g /dev/null
SELECT pg_temp.remote_pid('s') AS s_pid \gset
SELECT throws_ok($$SELECT pg_temp.bind('s', 'tap-bind', 0)$$, 'ZF004',
    'malformed fencing token: 0 (a fencing token is an integer greater than 0)', 'token 0 is ZF004');
SELECT throws_ok($$SELECT pg_temp.bind('s', 'tap-bind', -1)$$, 'ZF004', NULL, 'a negative token is ZF004');
SELECT throws_ok($$SELECT pg_temp.bind('s', 'tap-bind', NULL)$$, 'ZF004',
    'malformed fencing token: NULL (a fencing token is an integer greater than 0)', 'a NULL token is ZF004');
SELECT throws_ok($$SELECT pg_temp.bind('s', 'Tap-bind', 1)$$, 'ZF004',
    'malformed fencing resource name: ''Tap-bind''', 'an upper-case resource is ZF004');
SELECT throws_ok($$SELECT pg_temp.bind('s', '1tap', 1)$$, 'ZF004', NULL, 'a resource starting with a digit is ZF004');
SELECT throws_ok($$SELECT pg_temp.bind('s', 't' || repeat('x', 63), 1)$$, 'ZF004', NULL, 'a 64-character resource is ZF004');
SELECT throws_ok($$SELECT pg_temp.bind('s', 'tap''; --', 1)$$, 'ZF004', NULL, 'a resource with a quote is ZF004');
SELECT throws_ok($$SELECT pg_temp.bind('s', NULL, 1)$$, 'ZF004', NULL, 'a NULL resource is ZF004');
SELECT throws_ok($$SELECT pg_temp.bind('s', '', 1)$$, 'ZF004', NULL, 'an empty resource is ZF004');
SELECT is(pg_temp.binding_of(:s_pid), NULL, 'none of them bound the backend');

-- Only READ COMMITTED (P1: a bind that waited must read the raise's token): ZF007 otherwise.
SELECT dblink_exec('s', 'BEGIN ISOLATION LEVEL REPEATABLE READ') \g /dev/null
SELECT throws_ok($$SELECT pg_temp.bind('s', 'tap-bind', 33)$$, 'ZF007',
    'fencing unavailable: fence.bind must run under READ COMMITTED, not repeatable read',
    'a bind under REPEATABLE READ is ZF007');
SELECT dblink_exec('s', 'ROLLBACK') \g /dev/null
SELECT dblink_exec('s', 'BEGIN ISOLATION LEVEL SERIALIZABLE') \g /dev/null
SELECT throws_ok($$SELECT pg_temp.bind('s', 'tap-bind', 33)$$, 'ZF007', NULL, 'a bind under SERIALIZABLE is ZF007');
SELECT dblink_exec('s', 'ROLLBACK') \g /dev/null
SELECT dblink_exec('s', $$SET default_transaction_isolation = 'repeatable read'$$) \g /dev/null
SELECT throws_ok($$SELECT pg_temp.bind('s', 'tap-bind', 33)$$, 'ZF007', NULL,
    'a bind in autocommit with default_transaction_isolation = repeatable read is ZF007');
SELECT dblink_exec('s', 'RESET default_transaction_isolation') \g /dev/null
SELECT is(pg_temp.binding_of(:s_pid), NULL, 'none of them bound the backend');

-- A bind is transactional: rolled back, it binds nothing, and the backend can bind again.
SELECT dblink_exec('s', 'BEGIN') \g /dev/null
SELECT is(pg_temp.bind('s', 'tap-bind', 33), 33::bigint, 'a bind inside a transaction');
SELECT dblink_exec('s', 'ROLLBACK') \g /dev/null
SELECT is(pg_temp.binding_of(:s_pid), NULL, '... rolled back binds nothing');
SELECT is(pg_temp.bind('s', 'tap-bind', 33), 33::bigint, '... and the backend binds afterwards');

-- A leftover row of an exited backend with the same pid (another backend_start) is not this
-- backend's binding: it neither blocks the bind (no ZF008) nor survives it.
SELECT pg_temp.connect('s', 'tap_leader') \g /dev/null
SELECT pg_temp.remote_pid('s') AS s_pid \gset
SELECT dblink_exec('adm', format($$INSERT INTO fence.bindings (pid, backend_start, resource, token)
    VALUES (%s, '2000-01-01', 'tap-bind-gone', 7)$$, :s_pid)) \g /dev/null
SELECT is(pg_temp.bind('s', 'tap-bind', 33), 33::bigint, 'a reused pid binds although an exited backend''s row has it');
SELECT is((SELECT array_agg(resource || ' ' || token) FROM fence.bindings WHERE pid = :s_pid), ARRAY['tap-bind 33'],
    '... and the leftover row is removed');

-- A bind that raises nothing commits without waiting for the WAL flush (nothing durable
-- changes); a bind that raises commits with synchronous_commit on (P7, D1; 25_durable.sql).
-- (The test cluster runs with synchronous_commit off: the sessions turn it on.)
SELECT pg_temp.connect('s', 'tap_leader') \g /dev/null
SELECT dblink_exec('s', 'SET synchronous_commit = on; BEGIN') \g /dev/null
SELECT is(pg_temp.bind('s', 'tap-bind', 33), 33::bigint, 'a bind inside a transaction, equal token');
SELECT is(pg_temp.remote('s', 'SHOW synchronous_commit'), 'off', '... turns synchronous_commit off for its transaction');
SELECT dblink_exec('s', 'COMMIT') \g /dev/null
SELECT is(pg_temp.remote('s', 'SHOW synchronous_commit'), 'on', '... and only for it');
SELECT pg_temp.connect('s', 'tap_leader') \g /dev/null
SELECT dblink_exec('s', 'SET synchronous_commit = on; BEGIN') \g /dev/null
SELECT is(pg_temp.bind('s', 'tap-bind', 34), 34::bigint, 'a bind that raises');
SELECT is(pg_temp.remote('s', 'SHOW synchronous_commit'), 'on', '... keeps synchronous_commit on: the new token is durable when the bind returns');
SELECT dblink_exec('s', 'COMMIT') \g /dev/null
SELECT pg_temp.connect('s', 'tap_leader') \g /dev/null
SELECT dblink_exec('s', 'SET synchronous_commit = off; BEGIN') \g /dev/null
SELECT is(pg_temp.bind('s', 'tap-bind', 35), 35::bigint, 'a bind that raises in a session with synchronous_commit off');
SELECT is(pg_temp.remote('s', 'SHOW synchronous_commit'), 'on', '... commits with its WAL flushed all the same, on synchronous standbys too (P7, D1)');
SELECT dblink_exec('s', 'COMMIT') \g /dev/null

-- fence.bind's common case (the token stored already, no binding of this pid, one bind in 64
-- aside: its sweep) is one SQL statement that does not call fence.bind_full, the PL/pgSQL of
-- every other case (a raise here); both bind the same.
SELECT dblink_exec('adm', $$ALTER ROLE tap_leader SET track_functions = 'all'$$) \g /dev/null
SELECT pg_temp.connect('s', 'tap_leader') \g /dev/null
SELECT pg_temp.remote_pid('s') AS s_pid \gset
SELECT dblink_exec('s', 'BEGIN') \g /dev/null
SELECT is(pg_temp.bind('s', 'tap-bind', 35), 35::bigint, 'a bind of the stored token');
SELECT is(pg_temp.remote('s', $$SELECT coalesce(sum(calls), 0)::text FROM pg_stat_xact_user_functions WHERE schemaname = 'fence' AND funcname = 'bind_full'$$),
    CASE WHEN :s_pid % 64 = 0 THEN '1' ELSE '0' END, '... takes the common path: fence.bind_full is not called (but by one bind in 64)');
SELECT dblink_exec('s', 'COMMIT') \g /dev/null
SELECT is(pg_temp.binding_of(:s_pid), 'tap-bind 35', '... and binds the backend');
SELECT pg_temp.connect('s', 'tap_leader') \g /dev/null
SELECT pg_temp.remote_pid('s') AS s_pid \gset
SELECT dblink_exec('s', 'BEGIN') \g /dev/null
SELECT is(pg_temp.bind('s', 'tap-bind', 36), 36::bigint, 'a bind that raises');
SELECT is(pg_temp.remote('s', $$SELECT coalesce(sum(calls), 0)::text FROM pg_stat_xact_user_functions WHERE schemaname = 'fence' AND funcname = 'bind_full'$$),
    '1', '... goes to fence.bind_full');
SELECT dblink_exec('s', 'COMMIT') \g /dev/null
SELECT is(pg_temp.binding_of(:s_pid), 'tap-bind 36', '... and binds the backend');
SELECT dblink_exec('adm', $$ALTER ROLE tap_leader RESET track_functions$$) \g /dev/null

-- Exited backends' rows go (fence.forget_exited, run by raises and by one bind in 64), a live
-- backend's row stays.
SELECT pg_temp.connect('s', 'tap_leader') \g /dev/null
SELECT pg_temp.remote_pid('s') AS s_pid \gset
SELECT is(pg_temp.bind('s', 'tap-bind-gc', 1), 1::bigint, 'a live backend bound to tap-bind-gc');
SELECT dblink_exec('adm', $$INSERT INTO fence.bindings (pid, backend_start, resource, token)
    SELECT 4000000 + g, '2000-01-01', 'tap-bind-gc', 1 FROM generate_series(1, 50) AS g$$) \g /dev/null
SELECT * FROM dblink('adm', $$SELECT fence.forget_exited('tap-bind-gc')::text$$) AS t(x text) \g /dev/null
SELECT is((SELECT array_agg(pid) FROM fence.bindings WHERE resource = 'tap-bind-gc'), ARRAY[:s_pid],
    'fence.forget_exited removes the 50 rows of exited backends and keeps the live one');

SELECT dblink_exec('adm', $$
    DELETE FROM fence.tokens WHERE resource LIKE 'tap-bind%';
    DELETE FROM fence.bindings WHERE resource LIKE 'tap-bind%';
$$) \g /dev/null
SELECT dblink_disconnect(c) FROM unnest(dblink_get_connections()) AS c \g /dev/null
SELECT pg_temp.drop_login_role('tap_leader') \g /dev/null
SELECT * FROM finish();
ROLLBACK;
