-- What an application role (not a superuser, no grant of its own) may do with the fence
-- schema: call raise, check and check_readonly and read the tokens; never write the tokens,
-- lock them, call reset or create objects in the schema.
\ir _psql.psql

BEGIN;
SELECT plan(17);

-- Hostile operators for the search_path test below: a stale token compares as not higher.
CREATE SCHEMA tap_evil;
CREATE FUNCTION tap_evil.never(bigint, bigint) RETURNS boolean LANGUAGE sql AS 'SELECT false';
CREATE OPERATOR tap_evil.> (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = tap_evil.never);
CREATE OPERATOR tap_evil.<= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = tap_evil.never);
GRANT USAGE ON SCHEMA tap_evil TO PUBLIC;

CREATE ROLE tap_app NOLOGIN;
DELETE FROM fence.tokens WHERE resource LIKE 'tap-grants%';
SET LOCAL ROLE tap_app;

SELECT is(current_user, 'tap_app'::name, 'running as the application role');
SELECT is(fence.raise('tap-grants', 5), 5::bigint, 'it may raise a token');
SELECT is(fence.raise('tap-grants', 4), 5::bigint, '... and learn that a higher one is stored');
SELECT lives_ok($$SELECT fence.check('tap-grants', 5)$$, 'it may check its token');
SELECT throws_ok($$SELECT fence.check('tap-grants', 4)$$, 'ZF001', NULL, '... and be refused');
SELECT throws_ok($$SELECT fence.check_readonly()$$, '25006', NULL, 'it may call check_readonly');
SELECT is((SELECT token FROM fence.tokens WHERE resource = 'tap-grants'), 5::bigint, 'it may read the tokens');

SELECT throws_ok($$UPDATE fence.tokens SET token = 1 WHERE resource = 'tap-grants'$$, '42501',
    'permission denied for table tokens', 'it may not update the tokens');
SELECT throws_ok($$DELETE FROM fence.tokens WHERE resource = 'tap-grants'$$, '42501', NULL,
    'it may not delete tokens');
SELECT throws_ok($$INSERT INTO fence.tokens (resource, token) VALUES ('tap-grants-x', 1)$$, '42501', NULL,
    'it may not insert tokens');
SELECT throws_ok($$TRUNCATE fence.tokens$$, '42501', NULL, 'it may not truncate the tokens');
SELECT throws_ok($$SELECT token FROM fence.tokens WHERE resource = 'tap-grants' FOR SHARE$$, '42501', NULL,
    'it may not lock token rows itself');
SELECT throws_ok($$SELECT fence.reset('tap-grants', 1)$$, '42501',
    'permission denied for function reset', 'it may not call fence.reset');
SELECT throws_ok($$CREATE FUNCTION fence.check(text, integer) RETURNS void LANGUAGE sql AS ''$$, '42501',
    'permission denied for schema fence', 'it may not add an overload to the fence schema');
SELECT throws_ok($$SELECT * FROM fence.goose_db_version$$, '42501', NULL, 'it may not read the version table');

-- A caller's search_path cannot change what the SECURITY DEFINER functions resolve.
SET LOCAL search_path = tap_evil, pg_catalog, public;
SELECT throws_ok($$SELECT fence.check('tap-grants', 4)$$, 'ZF001', NULL,
    'check refuses a stale token even with hostile operators before pg_catalog in search_path');
SET LOCAL search_path = pg_temp, public;
SELECT is(fence.raise('tap-grants', 6), 6::bigint, 'raise works whatever the caller''s search_path');

RESET ROLE;
SELECT * FROM finish();
ROLLBACK;
