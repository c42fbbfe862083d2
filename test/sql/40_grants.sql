-- What an application role (not a superuser, no grant of its own) may do with the fence
-- schema: call fence.bind and fence.raise (which refuse it without the proxy's proof) and read
-- the tokens and bindings; never read the key, compute a proof, write the tokens or bindings,
-- lock them, call the internal functions or fence.reset, or create objects in the schema (P5, P6).
\ir _psql.psql

BEGIN;
SELECT plan(36);
\ir _helpers.psql

-- Hostile operators for the search_path test below: a stale token compares as not lower, and
-- no proof compares as different.
CREATE SCHEMA tap_evil;
CREATE FUNCTION tap_evil.never(bigint, bigint) RETURNS boolean LANGUAGE sql AS 'SELECT false';
CREATE FUNCTION tap_evil.never(text, text) RETURNS boolean LANGUAGE sql AS 'SELECT false';
CREATE OPERATOR tap_evil.> (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = tap_evil.never);
CREATE OPERATOR tap_evil.< (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = tap_evil.never);
CREATE OPERATOR tap_evil.<> (LEFTARG = text, RIGHTARG = text, FUNCTION = tap_evil.never);
GRANT USAGE ON SCHEMA tap_evil TO PUBLIC;

SELECT pg_temp.store_key() \g /dev/null
SELECT pg_temp.connect('adm') \g /dev/null
SELECT dblink_exec('adm', $$
    DELETE FROM fence.tokens WHERE resource LIKE 'tap-grants%';
    DELETE FROM fence.bindings WHERE resource LIKE 'tap-grants%';
$$) \g /dev/null
SELECT pg_temp.raise('adm', 'tap-grants', 5) \g /dev/null
-- A proof for this backend of a stale bind, computed by the owner before the role changes.
SELECT fence.proof('bind', 'tap-grants', 4, pg_backend_pid()) AS stale_proof \gset

CREATE ROLE tap_app NOLOGIN;
SET LOCAL ROLE tap_app;

SELECT is(current_user, 'tap_app'::name, 'running as the application role');
SELECT throws_ok($$SELECT fence.bind('tap-grants', 6, 'f00d')$$, 'ZF010', NULL,
    'it may call fence.bind, which refuses it without the proxy''s proof');
SELECT throws_ok($$SELECT fence.raise('tap-grants', 1000000, 'f00d')$$, 'ZF010', NULL,
    'it may call fence.raise, which refuses it without the proxy''s proof');
SELECT throws_ok($$SELECT fence.settled('tap-grants', 5, 'f00d')$$, 'ZF010', NULL,
    'it may call fence.settled, which refuses it without the proxy''s proof');
SELECT throws_ok($$SELECT fence.raise('tap-grants', 1000000)$$, '42883', NULL,
    'fence.raise without a proof does not exist');
SELECT is((SELECT token FROM fence.tokens WHERE resource = 'tap-grants'), 5::bigint, 'it may read the tokens');
SELECT lives_ok($$SELECT count(*) FROM fence.bindings$$, 'it may read the bindings');

-- It cannot make a proof.
SELECT throws_ok($$SELECT key FROM fence.keys$$, '42501', 'permission denied for table keys', 'it may not read the key');
SELECT throws_ok($$SELECT fence.proof('bind', 'tap-grants', 6, pg_backend_pid())$$, '42501',
    'permission denied for function proof', 'it may not call fence.proof');
SELECT throws_ok($$UPDATE fence.keys SET key = sha256('mine'::bytea)$$, '42501', NULL, 'it may not replace the key');
SELECT throws_ok($$INSERT INTO fence.keys (id, key) VALUES (1, sha256('mine'::bytea))$$, '42501', NULL, 'it may not store a key');

-- Nor call the functions behind bind and raise, nor fence.reset.
SELECT throws_ok($$SELECT fence.verify('bind', 'tap-grants', 6, 'f00d')$$, '42501',
    'permission denied for function verify', 'it may not call fence.verify');
SELECT throws_ok($$SELECT fence.bind_full('tap-grants', 6, 'f00d')$$, '42501',
    'permission denied for function bind_full', 'it may not call fence.bind_full');
SELECT throws_ok($$SELECT fence.end_stale('tap-grants', 6, '1s')$$, '42501',
    'permission denied for function end_stale', 'it may not call fence.end_stale');
SELECT throws_ok($$SELECT fence.raise_locked('tap-grants', 6)$$, '42501',
    'permission denied for function raise_locked', 'it may not call fence.raise_locked');
SELECT throws_ok($$SELECT fence.reset('tap-grants', 1)$$, '42501',
    'permission denied for function reset', 'it may not call fence.reset');
SELECT throws_ok($$SELECT fence.notify('tap-grants 999999')$$, '42501',
    'permission denied for function notify', 'it may not call fence.notify');

-- Nor write or lock the tokens or the bindings.
SELECT throws_ok($$UPDATE fence.tokens SET token = 1 WHERE resource = 'tap-grants'$$, '42501',
    'permission denied for table tokens', 'it may not update the tokens');
SELECT throws_ok($$DELETE FROM fence.tokens WHERE resource = 'tap-grants'$$, '42501', NULL, 'it may not delete tokens');
SELECT throws_ok($$INSERT INTO fence.tokens (resource, token) VALUES ('tap-grants-x', 1)$$, '42501', NULL,
    'it may not insert tokens');
SELECT throws_ok($$TRUNCATE fence.tokens$$, '42501', NULL, 'it may not truncate the tokens');
SELECT throws_ok($$SELECT token FROM fence.tokens WHERE resource = 'tap-grants' FOR SHARE$$, '42501', NULL,
    'it may not lock token rows itself');
SELECT throws_ok($$DELETE FROM fence.bindings$$, '42501', 'permission denied for table bindings',
    'it may not delete bindings (unbind a session)');
SELECT throws_ok($$UPDATE fence.bindings SET token = 1000000$$, '42501', NULL, 'it may not update bindings');
SELECT throws_ok($$INSERT INTO fence.bindings (pid, backend_start, resource, token) VALUES (1, now(), 'tap-grants', 1)$$,
    '42501', NULL, 'it may not insert bindings');
SELECT throws_ok($$TRUNCATE fence.bindings$$, '42501', NULL, 'it may not truncate the bindings');
SELECT throws_ok($$SELECT * FROM fence.bindings FOR UPDATE$$, '42501', NULL, 'it may not lock bindings');
SELECT throws_ok($$LOCK TABLE fence.tokens IN EXCLUSIVE MODE$$, '42501', NULL, 'it may not lock the tokens table');

-- Nor add objects to the schema or read goose's table.
SELECT throws_ok($$CREATE FUNCTION fence.raise(text, integer, text) RETURNS bigint LANGUAGE sql AS 'SELECT 1::bigint'$$, '42501',
    'permission denied for schema fence', 'it may not add an overload to the fence schema');
SELECT throws_ok($$CREATE TABLE fence.tap_mine (x int)$$, '42501', NULL, 'it may not create a table in the fence schema');
SELECT throws_ok($$SELECT * FROM fence.goose_db_version$$, '42501', NULL, 'it may not read the version table');

-- A caller's search_path cannot change what the SECURITY DEFINER functions resolve.
SET LOCAL search_path = tap_evil, pg_catalog, public;
SELECT throws_ok(format('SELECT fence.bind(%L, 4, %L)', 'tap-grants', :'stale_proof'), 'ZF001',
    'stale fencing token: resource "tap-grants" token 4 is lower than the highest admitted token 5',
    'bind refuses a stale token with its proof even with hostile operators before pg_catalog in search_path');
SELECT throws_ok($$SELECT fence.raise('tap-grants', 1000000, 'f00d')$$, 'ZF010', NULL,
    '... and a raise without the proof');
SET LOCAL search_path = pg_temp, public;
SELECT throws_ok(format('SELECT fence.bind(%L, 4, %L)', 'tap-grants', :'stale_proof'), 'ZF001', NULL,
    '... whatever the caller''s search_path');
SELECT is((SELECT token FROM fence.tokens WHERE resource = 'tap-grants'), 5::bigint, 'the token never moved');
SELECT is((SELECT count(*) FROM fence.bindings WHERE pid = pg_backend_pid()), 0::bigint, 'and this session was never bound');

RESET ROLE;
SELECT dblink_exec('adm', $$
    DELETE FROM fence.tokens WHERE resource LIKE 'tap-grants%';
    DELETE FROM fence.bindings WHERE resource LIKE 'tap-grants%';
$$) \g /dev/null
SELECT dblink_disconnect('adm') \g /dev/null
SELECT * FROM finish();
ROLLBACK;
