-- The fence schema as fenceproxy migrate installs it (version 9: sessions bound to tokens, leases, history, Consul's record and its deposition): objects,
-- types, constraints, function properties and privileges; the version-1 commit-time check is
-- gone. What PUBLIC may do is shown by running as such a role in 40_grants.sql.
\ir _psql.psql

BEGIN;
SELECT plan(97);
\ir _helpers.psql

-- A role with no grant of its own: it has exactly what PUBLIC has.
CREATE ROLE tap_nobody NOLOGIN;

SELECT has_schema('fence');
SELECT hasnt_schema('fence_token', 'the token mirror schema fence_token is gone');
SELECT has_table('fence', 'tokens', 'fence.tokens exists');
SELECT has_table('fence', 'bindings', 'fence.bindings exists');
SELECT has_table('fence', 'keys', 'fence.keys exists');
SELECT has_table('fence', 'goose_db_version', 'goose keeps its version table in the fence schema');
SELECT hasnt_table('public', 'goose_db_version', 'no goose version table in public');
SELECT is((SELECT max(version_id) FROM fence.goose_db_version WHERE is_applied), 16::bigint,
    'the schema is at version 16');

-- fence.tokens (version 1, unchanged).
SELECT col_type_is('fence', 'tokens', 'resource', 'text', 'tokens.resource is text');
SELECT col_type_is('fence', 'tokens', 'token', 'bigint', 'tokens.token is bigint');
SELECT col_type_is('fence', 'tokens', 'updated_at', 'timestamp with time zone', 'tokens.updated_at is timestamptz');
SELECT col_not_null('fence', 'tokens', 'token', 'tokens.token is NOT NULL');
SELECT col_is_pk('fence', 'tokens', 'resource', 'tokens.resource is the primary key');
SELECT throws_ok($$INSERT INTO fence.tokens (resource, token) VALUES ('Billing', 1)$$,
    '23514', NULL, 'fence.tokens refuses a resource name outside the pattern');
SELECT throws_ok($$INSERT INTO fence.tokens (resource, token) VALUES ('b' || repeat('x', 63), 1)$$,
    '23514', NULL, 'fence.tokens refuses a 64-character resource name');
SELECT throws_ok($$INSERT INTO fence.tokens (resource, token) VALUES ('billing', -1)$$,
    '23514', NULL, 'fence.tokens refuses a negative token');
SELECT lives_ok($$INSERT INTO fence.tokens (resource, token) VALUES ('tap-schema.a_1', 0)$$,
    'fence.tokens accepts a valid name and token 0');
SELECT hasnt_trigger('fence', 'tokens', 'tokens_mirror', 'the mirror trigger is gone');
SELECT hasnt_trigger('fence', 'tokens', 'tokens_mirror_truncate', 'the TRUNCATE mirror trigger is gone');

-- fence.bindings: one row per bound backend, keyed by pid and backend_start.
SELECT columns_are('fence', 'bindings', ARRAY['pid', 'backend_start', 'resource', 'token', 'bound_at']);
SELECT col_type_is('fence', 'bindings', 'pid', 'integer', 'bindings.pid is integer');
SELECT col_type_is('fence', 'bindings', 'backend_start', 'timestamp with time zone', 'bindings.backend_start is timestamptz');
SELECT col_type_is('fence', 'bindings', 'resource', 'text', 'bindings.resource is text');
SELECT col_type_is('fence', 'bindings', 'token', 'bigint', 'bindings.token is bigint');
SELECT col_is_pk('fence', 'bindings', ARRAY['pid', 'backend_start'], 'bindings are keyed by (pid, backend_start)');
SELECT has_index('fence', 'bindings', 'bindings_resource_token', ARRAY['resource', 'token'],
    'bindings are indexed by (resource, token) for the raise');
SELECT throws_ok($$INSERT INTO fence.bindings (pid, backend_start, resource, token) VALUES (1, now(), 'tap-schema', 0)$$,
    '23514', NULL, 'fence.bindings refuses token 0');
SELECT lives_ok($$INSERT INTO fence.bindings (pid, backend_start, resource, token) VALUES (1, now(), 'tap-schema', 1)$$,
    'fence.bindings takes a row');
SELECT throws_ok($$INSERT INTO fence.bindings (pid, backend_start, resource, token) VALUES (1, now(), 'tap-schema-2', 2)$$,
    '23505', NULL, '... and one only per (pid, backend_start)');

-- fence.keys: at most one key, 16 bytes or more.
SELECT columns_are('fence', 'keys', ARRAY['id', 'key', 'updated_at']);
SELECT col_type_is('fence', 'keys', 'key', 'bytea', 'keys.key is bytea');
SELECT col_is_pk('fence', 'keys', 'id', 'keys.id is the primary key');
DELETE FROM fence.keys;
SELECT throws_ok($$INSERT INTO fence.keys (key) VALUES ('\x00112233445566778899aabbccddee'::bytea)$$,
    '23514', NULL, 'fence.keys refuses a key shorter than 16 bytes');
SELECT lives_ok($$INSERT INTO fence.keys (key) VALUES (sha256('fenceproxy pgTAP key'::bytea))$$,
    'fence.keys takes a 32-byte key');
SELECT throws_ok($$INSERT INTO fence.keys (id, key) VALUES (2, sha256('another key'::bytea))$$,
    '23514', NULL, 'fence.keys holds one row only (id 1)');

-- The functions: exactly these twenty (the lease's four are tested in 50_lease.sql, Consul's two in 70_consul.sql); all but fence.mac (a plain expression that fence.bind's
-- query inlines, which needs SECURITY INVOKER and no SET) SECURITY DEFINER with a pinned
-- search_path.
SELECT has_function('fence', 'bind', ARRAY['text', 'bigint', 'text']);
SELECT has_function('fence', 'bind_full', ARRAY['text', 'bigint', 'text']);
SELECT has_function('fence', 'raise', ARRAY['text', 'bigint', 'text']);
SELECT has_function('fence', 'reset', ARRAY['text', 'bigint']);
SELECT has_function('fence', 'proof', ARRAY['text', 'text', 'bigint', 'integer']);
SELECT has_function('fence', 'verify', ARRAY['text', 'text', 'bigint', 'text']);
SELECT has_function('fence', 'end_stale', ARRAY['text', 'bigint', 'interval']);
SELECT has_function('fence', 'raise_locked', ARRAY['text', 'bigint']);
SELECT has_function('fence', 'mac', ARRAY['bytea', 'text', 'text', 'bigint', 'integer']);
SELECT has_function('fence', 'refuse_prepared', ARRAY['text', 'bigint']);
SELECT has_function('fence', 'forget_exited', ARRAY['text']);
SELECT has_function('fence', 'settled', ARRAY['text', 'bigint', 'text']);
SELECT has_function('fence', 'lease_bind', ARRAY['text', 'bigint', 'text']);
SELECT has_function('fence', 'notify', ARRAY['text', 'double precision']);
SELECT has_function('fence', 'commit_durably', ARRAY[]::text[]);
SELECT function_returns('fence', 'bind', ARRAY['text', 'bigint', 'text'], 'bigint');
SELECT function_returns('fence', 'raise', ARRAY['text', 'bigint', 'text'], 'bigint');
SELECT function_returns('fence', 'reset', ARRAY['text', 'bigint'], 'bigint');
SELECT function_returns('fence', 'settled', ARRAY['text', 'bigint', 'text'], 'bigint');
SELECT function_returns('fence', 'proof', ARRAY['text', 'text', 'bigint', 'integer'], 'text');
SELECT is((SELECT count(*) FROM pg_proc WHERE pronamespace = 'fence'::regnamespace), 28::bigint,
    'the fence schema holds exactly twenty-eight functions');
SELECT is(array_agg(p.oid::regprocedure::text ORDER BY p.oid::regprocedure::text), NULL,
    'every fence function is SECURITY DEFINER but fence.mac and those of protected tables (95_protect.sql)')
FROM pg_proc AS p WHERE p.pronamespace = 'fence'::regnamespace AND NOT p.prosecdef
  AND p.oid <> 'fence.mac(bytea,text,text,bigint,integer)'::regprocedure
  AND p.proname NOT IN ('protect', 'protect_row', 'unprotect');
SELECT is(array_agg(p.oid::regprocedure::text ORDER BY p.oid::regprocedure::text), NULL,
    'every fence function pins search_path to pg_catalog, pg_temp')
FROM pg_proc AS p
WHERE p.pronamespace = 'fence'::regnamespace
  AND p.oid <> 'fence.mac(bytea,text,text,bigint,integer)'::regprocedure
  AND p.proconfig IS DISTINCT FROM ARRAY['search_path=pg_catalog, pg_temp'];

-- The version-1 check and its helpers are gone.
SELECT hasnt_function('fence', 'check', ARRAY['text', 'bigint'], 'fence.check(text, bigint) is gone');
SELECT hasnt_function('fence', 'check_readonly', ARRAY[]::name[], 'fence.check_readonly() is gone');
SELECT hasnt_function('fence', 'raise', ARRAY['text', 'bigint'], 'fence.raise(text, bigint), the raise without a proof, is gone');
SELECT hasnt_function('fence', 'reject', ARRAY['text', 'bigint'], 'fence.reject(text, bigint) is gone');
SELECT hasnt_function('fence', 'reject_write', ARRAY[]::name[], 'fence.reject_write() is gone');
SELECT hasnt_function('fence', 'mirror_token', ARRAY[]::name[], 'fence.mirror_token() is gone');

-- The proof: hex(sha256(key || sha256(key || kind \n database \n resource \n token \n pid))).
-- The expected value was computed outside PostgreSQL (Python's hashlib) for the key
-- sha256('fenceproxy pgTAP key') and the database fenceproxy_test (scripts/test-sql.sh): the
-- proxy computes the same bytes.
UPDATE fence.keys SET key = sha256('fenceproxy pgTAP key'::bytea);
SELECT is(current_database()::text, 'fenceproxy_test', 'the test database (the proof covers its name)');
SELECT is(fence.proof('bind', 'billing', 34, 4242),
    'fcf6a30f656e740fbb9bdba74a8694d47861dfab6583285b0b724f783e6800d9',
    'fence.proof(bind) is the NMAC of the message under the key');
SELECT is(fence.proof('raise', 'billing', 34, 4242),
    'da495d70b14f00ecf79f93af8a400707922642a809464181012042bdbfaec43c',
    'fence.proof(raise) differs from the bind''s');
SELECT isnt(fence.proof('bind', 'billing', 35, 4242), fence.proof('bind', 'billing', 34, 4242), 'the proof covers the token');
SELECT isnt(fence.proof('bind', 'billing', 34, 4243), fence.proof('bind', 'billing', 34, 4242), '... the pid');
SELECT isnt(fence.proof('bind', 'billinh', 34, 4242), fence.proof('bind', 'billing', 34, 4242), '... and the resource');
UPDATE fence.keys SET key = sha256('another key'::bytea);
SELECT isnt(fence.proof('bind', 'billing', 34, 4242),
    'fcf6a30f656e740fbb9bdba74a8694d47861dfab6583285b0b724f783e6800d9', '... under the key stored');
DELETE FROM fence.keys;
SELECT is(fence.proof('bind', 'billing', 34, 4242), NULL, 'fence.proof is NULL without a key');

-- Privileges of PUBLIC.
SELECT schema_privs_are('fence', 'tap_nobody', ARRAY['USAGE'], 'PUBLIC may use the fence schema, not create in it');
SELECT table_privs_are('fence', 'tokens', 'tap_nobody', ARRAY['SELECT'], 'PUBLIC may only read fence.tokens');
SELECT table_privs_are('fence', 'bindings', 'tap_nobody', ARRAY['SELECT'], 'PUBLIC may only read fence.bindings');
SELECT table_privs_are('fence', 'keys', 'tap_nobody', ARRAY[]::text[], 'PUBLIC has no access to fence.keys');
SELECT table_privs_are('fence', 'goose_db_version', 'tap_nobody', ARRAY[]::text[], 'PUBLIC has no access to the version table');
SELECT function_privs_are('fence', 'bind', ARRAY['text', 'bigint', 'text'], 'tap_nobody', ARRAY['EXECUTE'],
    'PUBLIC may execute fence.bind');
SELECT function_privs_are('fence', 'raise', ARRAY['text', 'bigint', 'text'], 'tap_nobody', ARRAY['EXECUTE'],
    'PUBLIC may execute fence.raise(text, bigint, text)');
SELECT function_privs_are('fence', 'reset', ARRAY['text', 'bigint'], 'tap_nobody', ARRAY[]::text[],
    'PUBLIC may not execute fence.reset');
SELECT function_privs_are('fence', 'proof', ARRAY['text', 'text', 'bigint', 'integer'], 'tap_nobody', ARRAY[]::text[],
    'PUBLIC may not execute fence.proof');
SELECT function_privs_are('fence', 'verify', ARRAY['text', 'text', 'bigint', 'text'], 'tap_nobody', ARRAY[]::text[],
    'PUBLIC may not execute fence.verify');
SELECT function_privs_are('fence', 'end_stale', ARRAY['text', 'bigint', 'interval'], 'tap_nobody', ARRAY[]::text[],
    'PUBLIC may not execute fence.end_stale');
SELECT function_privs_are('fence', 'raise_locked', ARRAY['text', 'bigint'], 'tap_nobody', ARRAY[]::text[],
    'PUBLIC may not execute fence.raise_locked');
SELECT function_privs_are('fence', 'mac', ARRAY['bytea', 'text', 'text', 'bigint', 'integer'], 'tap_nobody', ARRAY[]::text[],
    'PUBLIC may not execute fence.mac');
SELECT function_privs_are('fence', 'refuse_prepared', ARRAY['text', 'bigint'], 'tap_nobody', ARRAY[]::text[],
    'PUBLIC may not execute fence.refuse_prepared');
SELECT function_privs_are('fence', 'forget_exited', ARRAY['text'], 'tap_nobody', ARRAY[]::text[],
    'PUBLIC may not execute fence.forget_exited');
SELECT function_privs_are('fence', 'commit_durably', ARRAY[]::text[], 'tap_nobody', ARRAY[]::text[],
    'PUBLIC may not execute fence.commit_durably (D1)');
SELECT is((SELECT relpersistence::text FROM pg_class WHERE oid = 'fence.bindings'::regclass), 'u',
    'fence.bindings is UNLOGGED: a binding means nothing once its backend is gone, and no backend outlives a crash');
SELECT is((SELECT relpersistence::text FROM pg_class WHERE oid = 'fence.tokens'::regclass), 'p',
    'fence.tokens is logged: an admitted token survives a crash');
SELECT is(array_agg(p.proname::text ORDER BY p.proname),
    ARRAY['bind', 'consul_admit', 'consul_regress', 'lease_bind', 'protect', 'protect_row', 'raise', 'session_bindings', 'settled', 'unprotect'],
    'PUBLIC may execute exactly fence.bind, fence.consul_admit, fence.consul_regress, fence.lease_bind, fence.raise and fence.settled (each needs the proxy''s proof), fence.session_bindings (its own), and fence.protect, fence.protect_row and fence.unprotect (SECURITY INVOKER)')
FROM pg_proc AS p
WHERE p.pronamespace = 'fence'::regnamespace AND has_function_privilege('tap_nobody', p.oid, 'EXECUTE');

SELECT isnt(obj_description('fence.bind(text,bigint,text)'::regprocedure, 'pg_proc'), NULL, 'fence.bind is documented');
SELECT isnt(obj_description('fence.raise(text,bigint,text)'::regprocedure, 'pg_proc'), NULL, 'fence.raise is documented');
SELECT isnt(obj_description('fence.reset(text,bigint)'::regprocedure, 'pg_proc'), NULL, 'fence.reset is documented');
SELECT isnt(obj_description('fence.tokens'::regclass, 'pg_class'), NULL, 'fence.tokens is documented');
SELECT isnt(obj_description('fence.bindings'::regclass, 'pg_class'), NULL, 'fence.bindings is documented');
SELECT isnt(obj_description('fence.keys'::regclass, 'pg_class'), NULL, 'fence.keys is documented');

SELECT * FROM finish();
ROLLBACK;
