-- fence.raise: insert when missing, raise only when higher, report the stored token, notify
-- 'fence_raise' only on a real change; fence.reset sets exactly and notifies with " reset".
-- The sequence fence_token."<resource>" that fence.check reads mirrors every committed change
-- (migration 3), and only committed ones.
\ir _psql.psql

BEGIN;
SELECT plan(33);

\ir _helpers.psql

SELECT dblink_connect('raiser', pg_temp.connstr()) \g /dev/null
SELECT dblink_connect('listener', pg_temp.connstr()) \g /dev/null
SELECT dblink_exec('raiser', $$DELETE FROM fence.tokens WHERE resource LIKE 'tap-raise%'$$) \g /dev/null

-- Raises committed by another session, as the proxy's raise is (its own transaction).
CREATE FUNCTION pg_temp.raise(resource text, token bigint) RETURNS bigint LANGUAGE sql AS $$
    SELECT stored FROM dblink('raiser', format('SELECT fence.raise(%L, %s)', resource, token)) AS t(stored bigint)
$$;
CREATE FUNCTION pg_temp.stored(resource text) RETURNS bigint LANGUAGE sql AS $$
    SELECT token FROM dblink('raiser', format('SELECT token FROM fence.tokens WHERE resource = %L', resource)) AS t(token bigint)
$$;
-- The mirror as another session sees it: NULL when the sequence does not exist.
CREATE FUNCTION pg_temp.mirror(resource text) RETURNS bigint LANGUAGE sql AS $$
    SELECT v FROM dblink('raiser', format('SELECT pg_sequence_last_value(to_regclass(%L))',
                                          'fence_token.' || quote_ident(resource))) AS t(v bigint)
$$;

SELECT is(pg_temp.raise('tap-raise', 33), 33::bigint, 'a missing row is inserted and its token returned');
SELECT is(pg_temp.stored('tap-raise'), 33::bigint, '... and stored');
SELECT is(pg_temp.raise('tap-raise', 33), 33::bigint, 'an equal token returns the stored token');
SELECT is(pg_temp.raise('tap-raise', 20), 33::bigint, 'a lower token returns the higher stored token');
SELECT is(pg_temp.stored('tap-raise'), 33::bigint, '... and does not lower it');
SELECT is(pg_temp.raise('tap-raise', 34), 34::bigint, 'a higher token raises');
SELECT is(pg_temp.stored('tap-raise'), 34::bigint, '... and is stored');
SELECT is(pg_temp.mirror('tap-raise'), 34::bigint, '... and mirrored in fence_token."tap-raise"');

SELECT throws_ok($$SELECT fence.raise('tap-raise', 0)$$, 'ZF004',
    'malformed fencing token: 0 (a fencing token is an integer greater than 0)', 'token 0 is ZF004');
SELECT throws_ok($$SELECT fence.raise('tap-raise', -3)$$, 'ZF004', NULL, 'a negative token is ZF004');
SELECT throws_ok($$SELECT fence.raise('tap-raise', NULL)$$, 'ZF004', NULL, 'a NULL token is ZF004');
SELECT throws_ok($$SELECT fence.raise('Tap', 1)$$, 'ZF004',
    'malformed fencing resource name: ''Tap''', 'an upper-case resource is ZF004');
SELECT throws_ok($$SELECT fence.raise('tap''); DELETE FROM fence.tokens; --', 1)$$, 'ZF004', NULL,
    'a resource with a quote is ZF004');
SELECT throws_ok($$SELECT fence.raise(NULL, 1)$$, 'ZF004', NULL, 'a NULL resource is ZF004');

-- The row is updated in place only when raised: updated_at moves with a raise only.
SELECT dblink_exec('raiser', $$UPDATE fence.tokens SET updated_at = '2000-01-01' WHERE resource = 'tap-raise'$$) \g /dev/null
SELECT pg_temp.raise('tap-raise', 34) \g /dev/null
SELECT is((SELECT updated_at FROM dblink('raiser', $$SELECT updated_at FROM fence.tokens WHERE resource = 'tap-raise'$$) AS t(updated_at timestamptz)),
    '2000-01-01'::timestamptz, 'an equal token leaves updated_at alone');
SELECT pg_temp.raise('tap-raise', 35) \g /dev/null
SELECT cmp_ok((SELECT updated_at FROM dblink('raiser', $$SELECT updated_at FROM fence.tokens WHERE resource = 'tap-raise'$$) AS t(updated_at timestamptz)),
    '>', '2000-01-01'::timestamptz, 'a raise sets updated_at');

-- Notifications: only real changes, in commit order, payload "<resource> <token>".
SELECT dblink_exec('listener', 'LISTEN fence_raise') \g /dev/null
-- Missing (notifies), equal (silent), lower (silent), higher (notifies).
SELECT pg_temp.raise('tap-raise-n', 7) \g /dev/null
SELECT pg_temp.raise('tap-raise-n', 7) \g /dev/null
SELECT pg_temp.raise('tap-raise-n', 6) \g /dev/null
SELECT pg_temp.raise('tap-raise-n', 9) \g /dev/null
SELECT is(pg_temp.notifications('listener', 2, 5),
    ARRAY['fence_raise: tap-raise-n 7', 'fence_raise: tap-raise-n 9'],
    'fence_raise is notified for the insert and the raise, not for equal or lower tokens');
SELECT is(pg_temp.notifications('listener', 1, 0.2), '{}'::text[], '... and nothing else');

-- A raise that rolls back notifies nobody.
SELECT dblink_exec('raiser', 'BEGIN') \g /dev/null
SELECT pg_temp.raise('tap-raise-n', 10) \g /dev/null
SELECT dblink_exec('raiser', 'ROLLBACK') \g /dev/null
SELECT is(pg_temp.notifications('listener', 1, 0.2), '{}'::text[], 'a raise rolled back notifies nobody');
SELECT is(pg_temp.stored('tap-raise-n'), 9::bigint, '... and is not stored');
SELECT is(pg_temp.mirror('tap-raise-n'), 9::bigint, '... nor mirrored (the sequence''s new file is dropped)');

-- fence.reset: exactly the value, lower or not, and a notification saying so.
SELECT is((SELECT previous FROM dblink('raiser', $$SELECT fence.reset('tap-raise-n', 2)$$) AS t(previous bigint)),
    9::bigint, 'fence.reset returns the previous token');
SELECT is(pg_temp.stored('tap-raise-n'), 2::bigint, 'fence.reset lowers the stored token');
SELECT is(pg_temp.mirror('tap-raise-n'), 2::bigint, '... and its mirror');
SELECT is(pg_temp.notifications('listener', 1, 5), ARRAY['fence_raise: tap-raise-n 2 reset'],
    'fence.reset notifies "<resource> <token> reset"');
SELECT is((SELECT previous FROM dblink('raiser', $$SELECT fence.reset('tap-raise-new', 0)$$) AS t(previous bigint)),
    NULL::bigint, 'fence.reset of a missing resource returns NULL');
SELECT is(pg_temp.mirror('tap-raise-new'), 0::bigint, '... and creates the row and its mirror');
SELECT throws_ok($$SELECT fence.reset('tap-raise-n', -1)$$, 'ZF004', NULL, 'fence.reset refuses a negative token');

SELECT dblink_exec('raiser', $$DELETE FROM fence.tokens WHERE resource LIKE 'tap-raise%'$$) \g /dev/null
SELECT is(pg_temp.mirror('tap-raise-n'), NULL::bigint, 'deleting a row drops its mirror');
SELECT is(pg_temp.mirror('tap-raise'), NULL::bigint, '... every one');
-- A change by hand (the owner's UPDATE, not fence.raise) is mirrored too.
SELECT pg_temp.raise('tap-raise-hand', 5) \g /dev/null
SELECT dblink_exec('raiser', $$UPDATE fence.tokens SET token = 12 WHERE resource = 'tap-raise-hand'$$) \g /dev/null
SELECT is(pg_temp.mirror('tap-raise-hand'), 12::bigint, 'an UPDATE of fence.tokens by its owner is mirrored');
-- A mirror that drifted (changed behind the trigger's back) is repaired by fence.reset to the
-- stored token, although the row's token does not change.
SELECT x FROM dblink('raiser', $$SELECT setval('fence_token."tap-raise-hand"', 3)$$) AS t(x bigint) \g /dev/null
SELECT is(pg_temp.mirror('tap-raise-hand'), 3::bigint, 'a drifted mirror (setval by the owner)');
SELECT x FROM dblink('raiser', $$SELECT fence.reset('tap-raise-hand', 12)$$) AS t(x bigint) \g /dev/null
SELECT is(pg_temp.mirror('tap-raise-hand'), 12::bigint, '... is repaired by fence.reset to the stored token');
SELECT dblink_exec('raiser', $$DELETE FROM fence.tokens WHERE resource LIKE 'tap-raise%'$$) \g /dev/null
SELECT dblink_disconnect('raiser') \g /dev/null
SELECT dblink_disconnect('listener') \g /dev/null
SELECT * FROM finish();
ROLLBACK;
