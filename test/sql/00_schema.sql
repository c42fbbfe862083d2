-- The fence schema as the migrations install it: objects, types, constraints, function
-- properties and privileges.
\ir _psql.psql

BEGIN;
SELECT plan(58);
\ir _helpers.psql

-- A role with no grant of its own: it has exactly what PUBLIC has.
CREATE ROLE tap_nobody NOLOGIN;

SELECT has_schema('fence');
SELECT has_schema('fence_token');
SELECT has_table('fence', 'tokens', 'fence.tokens exists');
SELECT has_table('fence', 'goose_db_version', 'goose keeps its version table in the fence schema');
SELECT hasnt_table('public', 'goose_db_version', 'no goose version table in public');

SELECT col_type_is('fence', 'tokens', 'resource', 'text', 'resource is text');
SELECT col_type_is('fence', 'tokens', 'token', 'bigint', 'token is bigint');
SELECT col_type_is('fence', 'tokens', 'updated_at', 'timestamp with time zone', 'updated_at is timestamptz');
SELECT col_not_null('fence', 'tokens', 'token', 'token is NOT NULL');
SELECT col_not_null('fence', 'tokens', 'updated_at', 'updated_at is NOT NULL');
SELECT col_has_default('fence', 'tokens', 'updated_at', 'updated_at has a default');
SELECT col_is_pk('fence', 'tokens', 'resource', 'resource is the primary key');
SELECT col_has_check('fence', 'tokens', 'resource', 'resource has a CHECK');
SELECT col_has_check('fence', 'tokens', 'token', 'token has a CHECK');

SELECT throws_ok($$INSERT INTO fence.tokens (resource, token) VALUES ('Billing', 1)$$,
    '23514', NULL, 'the table refuses a resource name outside the pattern');
SELECT throws_ok($$INSERT INTO fence.tokens (resource, token) VALUES ('b' || repeat('x', 63), 1)$$,
    '23514', NULL, 'the table refuses a 64-character resource name');
SELECT throws_ok($$INSERT INTO fence.tokens (resource, token) VALUES ('billing', -1)$$,
    '23514', NULL, 'the table refuses a negative token');
SELECT lives_ok($$INSERT INTO fence.tokens (resource, token) VALUES ('tap-schema.a_1', 0)$$,
    'the table accepts a valid name and token 0');

SELECT has_function('fence', 'raise', ARRAY['text', 'bigint']);
SELECT has_function('fence', 'check', ARRAY['text', 'bigint']);
SELECT has_function('fence', 'check_readonly', ARRAY[]::name[]);
SELECT has_function('fence', 'reset', ARRAY['text', 'bigint']);
SELECT function_returns('fence', 'raise', ARRAY['text', 'bigint'], 'bigint');
SELECT function_returns('fence', 'check', ARRAY['text', 'bigint'], 'void');
SELECT function_returns('fence', 'check_readonly', ARRAY[]::name[], 'void');
SELECT function_returns('fence', 'reset', ARRAY['text', 'bigint'], 'bigint');
SELECT is_definer('fence', 'raise', ARRAY['text', 'bigint']);
SELECT is_definer('fence', 'reset', ARRAY['text', 'bigint']);
SELECT is_definer('fence', 'reject', ARRAY['text', 'bigint']);
SELECT is_definer('fence', 'mirror_token', ARRAY[]::name[]);
-- The hot path (migration 3): SQL functions that PostgreSQL inlines into the caller's statement,
-- so they run with the caller's rights and call only built-in functions until they fail.
SELECT isnt_definer('fence', 'check', ARRAY['text', 'bigint']);
SELECT isnt_definer('fence', 'check_readonly', ARRAY[]::name[]);
SELECT function_lang_is('fence', 'check', ARRAY['text', 'bigint'], 'sql');
SELECT function_lang_is('fence', 'check_readonly', ARRAY[]::name[], 'sql');
SELECT is(pg_temp.plan_of($$SELECT fence.check('tap-schema', 7)$$) ~ 'fence\."?check"?\(', false,
    'fence.check is inlined: the plan does not call fence.check');
SELECT matches(pg_temp.plan_of($$SELECT fence.check('tap-schema', 7)$$), 'pg_sequence_last_value\(to_regclass\(''fence_token\."tap-schema"''::text\)\)',
    '... but built-in functions, the sequence''s name folded into a constant');
SELECT is(pg_temp.plan_of($$SELECT fence.check_readonly()$$) ~ 'fence\.check_readonly\(', false,
    'fence.check_readonly is inlined');

-- raise and reset pin search_path; check and check_readonly, on the hot path, resolve nothing
-- through it instead (migration 2; 40_grants.sql shows hostile search paths change nothing).
SELECT is(p.proconfig, ARRAY['search_path=pg_catalog, pg_temp'],
          format('%s pins search_path', p.oid::regprocedure))
FROM pg_proc AS p
WHERE p.pronamespace = 'fence'::regnamespace AND p.proname IN ('raise', 'reset', 'reject', 'mirror_token')
ORDER BY p.proname;
SELECT is(p.proconfig, NULL, format('%s has no SET clause (hot path)', p.oid::regprocedure))
FROM pg_proc AS p
WHERE p.pronamespace = 'fence'::regnamespace AND p.proname IN ('check', 'check_readonly')
ORDER BY p.proname;
SELECT is((SELECT count(*) FROM pg_proc WHERE pronamespace = 'fence'::regnamespace), 7::bigint,
          'the fence schema holds exactly seven functions');

SELECT schema_privs_are('fence', 'tap_nobody', ARRAY['USAGE'], 'PUBLIC may use the fence schema, not create in it');
SELECT table_privs_are('fence', 'tokens', 'tap_nobody', ARRAY['SELECT'], 'PUBLIC may only read fence.tokens');
SELECT table_privs_are('fence', 'goose_db_version', 'tap_nobody', ARRAY[]::text[], 'PUBLIC has no access to the version table');
SELECT function_privs_are('fence', 'raise', ARRAY['text', 'bigint'], 'tap_nobody', ARRAY['EXECUTE']);
SELECT function_privs_are('fence', 'check', ARRAY['text', 'bigint'], 'tap_nobody', ARRAY['EXECUTE']);
SELECT function_privs_are('fence', 'check_readonly', ARRAY[]::text[], 'tap_nobody', ARRAY['EXECUTE']);
SELECT function_privs_are('fence', 'reset', ARRAY['text', 'bigint'], 'tap_nobody', ARRAY[]::text[],
    'PUBLIC may not execute fence.reset');
SELECT function_privs_are('fence', 'mirror_token', ARRAY[]::text[], 'tap_nobody', ARRAY[]::text[],
    'PUBLIC may not execute the trigger function');
SELECT schema_privs_are('fence_token', 'tap_nobody', ARRAY['USAGE'], 'PUBLIC may use fence_token, not create in it');
SELECT sequence_privs_are('fence_token', 'tap-schema.a_1', 'tap_nobody', ARRAY['SELECT'],
    'PUBLIC may only read a token''s sequence (no setval, no nextval)');

SELECT isnt(obj_description('fence.raise(text,bigint)'::regprocedure, 'pg_proc'), NULL, 'fence.raise is documented');
SELECT isnt(obj_description('fence.check(text,bigint)'::regprocedure, 'pg_proc'), NULL, 'fence.check is documented');
SELECT isnt(obj_description('fence.tokens'::regclass, 'pg_class'), NULL, 'fence.tokens is documented');

-- TRUNCATE drops every mirror (a statement trigger; undone with this test's transaction).
TRUNCATE fence.tokens;
SELECT is((SELECT count(*) FROM pg_class WHERE relnamespace = 'fence_token'::regnamespace), 0::bigint,
    'TRUNCATE of fence.tokens drops every sequence in fence_token');

SELECT * FROM finish();
ROLLBACK;
