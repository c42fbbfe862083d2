-- fence.raise(resource, token, proof): needs the proxy's proof; inserts when missing, raises
-- only when higher, reports the stored token, notifies 'fence_raise' only on a real change.
-- fence.reset (the owner's tool): sets exactly, notifies with " reset", ends the backends bound
-- to a lower token when it raises and nobody when it lowers.
\ir _psql.psql

BEGIN;
SELECT plan(54);

\ir _helpers.psql

SELECT pg_temp.store_key() \g /dev/null
SELECT pg_temp.connect('raiser') \g /dev/null
SELECT pg_temp.connect('listener') \g /dev/null
SELECT dblink_exec('raiser', $$
    DELETE FROM fence.tokens WHERE resource LIKE 'tap-raise%';
    DELETE FROM fence.bindings WHERE resource LIKE 'tap-raise%';
$$) \g /dev/null

-- Raises committed by another session, as the proxy's raise is (its own transaction).
SELECT is(pg_temp.raise('raiser', 'tap-raise', 33), 33::bigint, 'a missing row is inserted and its token returned');
SELECT is(pg_temp.stored('tap-raise'), 33::bigint, '... and stored');
SELECT is(pg_temp.raise('raiser', 'tap-raise', 33), 33::bigint, 'an equal token returns the stored token');
SELECT is(pg_temp.raise('raiser', 'tap-raise', 20), 33::bigint, 'a lower token returns the higher stored token');
SELECT is(pg_temp.stored('tap-raise'), 33::bigint, '... and does not lower it');
SELECT is(pg_temp.raise('raiser', 'tap-raise', 34), 34::bigint, 'a higher token raises');
SELECT is(pg_temp.stored('tap-raise'), 34::bigint, '... and is stored');

-- Malformed arguments are refused before the proof is looked at.
SELECT throws_ok($$SELECT pg_temp.raise('raiser', 'tap-raise', 0)$$, 'ZF004',
    'malformed fencing token: 0 (a fencing token is an integer greater than 0)', 'token 0 is ZF004');
SELECT throws_ok($$SELECT pg_temp.raise('raiser', 'tap-raise', -3)$$, 'ZF004', NULL, 'a negative token is ZF004');
SELECT throws_ok($$SELECT pg_temp.raise('raiser', 'tap-raise', NULL)$$, 'ZF004',
    'malformed fencing token: NULL (a fencing token is an integer greater than 0)', 'a NULL token is ZF004');
SELECT throws_ok($$SELECT pg_temp.raise('raiser', 'Tap', 1)$$, 'ZF004',
    'malformed fencing resource name: ''Tap''', 'an upper-case resource is ZF004');
SELECT throws_ok($$SELECT pg_temp.raise('raiser', 'tap''); DELETE FROM fence.tokens; --', 1)$$, 'ZF004', NULL,
    'a resource with a quote is ZF004');
SELECT throws_ok($$SELECT pg_temp.raise('raiser', 't' || repeat('x', 63), 1)$$, 'ZF004', NULL,
    'a 64-character resource is ZF004');
SELECT throws_ok($$SELECT pg_temp.raise('raiser', NULL, 1)$$, 'ZF004', NULL, 'a NULL resource is ZF004');

-- The proof (P5): only the proxy's raise, for this backend, this resource and this token, counts.
SELECT throws_ok(format('SELECT pg_temp.remote(%L, %L)', 'raiser', pg_temp.call_sql('raise', 'tap-raise', 99, NULL)),
    'ZF010', 'fencing proof invalid: fence.raise(''tap-raise'', 99) was not called by fenceproxy with this database''s proxy key',
    'a raise without a proof is ZF010');
SELECT throws_ok(format('SELECT pg_temp.remote(%L, %L)', 'raiser', pg_temp.call_sql('raise', 'tap-raise', 99, 'f00d')),
    'ZF010', NULL, 'a raise with a made-up proof is ZF010');
SELECT throws_ok(format('SELECT pg_temp.remote(%L, %L)', 'raiser',
        pg_temp.call_sql('raise', 'tap-raise', 99, pg_temp.proof('bind', 'tap-raise', 99, 'raiser'))),
    'ZF010', NULL, 'a bind''s proof does not raise');
SELECT throws_ok(format('SELECT pg_temp.remote(%L, %L)', 'raiser',
        pg_temp.call_sql('raise', 'tap-raise', 99, fence.proof('raise', 'tap-raise', 99, pg_backend_pid()))),
    'ZF010', NULL, 'a proof made for another backend does not raise');
SELECT throws_ok(format('SELECT pg_temp.remote(%L, %L)', 'raiser',
        pg_temp.call_sql('raise', 'tap-raise', 99, pg_temp.proof('raise', 'tap-raise', 98, 'raiser'))),
    'ZF010', NULL, 'a proof made for another token does not raise');
SELECT throws_ok(format('SELECT pg_temp.remote(%L, %L)', 'raiser',
        pg_temp.call_sql('raise', 'tap-raise', 99, pg_temp.proof('raise', 'tap-raise-n', 99, 'raiser'))),
    'ZF010', NULL, 'a proof made for another resource does not raise');
SELECT is(pg_temp.stored('tap-raise'), 34::bigint, 'none of them raised the token');
SELECT dblink_exec('raiser', 'BEGIN ISOLATION LEVEL REPEATABLE READ') \g /dev/null
SELECT throws_ok(format('SELECT pg_temp.remote(%L, %L)', 'raiser', pg_temp.raise_sql('raiser', 'tap-raise', 99)),
    'ZF007', 'fencing unavailable: fence.raise must run under READ COMMITTED, not repeatable read',
    'a raise under REPEATABLE READ is ZF007');
SELECT dblink_exec('raiser', 'ROLLBACK') \g /dev/null

-- The row is updated in place only when raised: updated_at moves with a raise only.
SELECT dblink_exec('raiser', $$UPDATE fence.tokens SET updated_at = '2000-01-01' WHERE resource = 'tap-raise'$$) \g /dev/null
SELECT pg_temp.raise('raiser', 'tap-raise', 34) \g /dev/null
SELECT is((SELECT updated_at FROM fence.tokens WHERE resource = 'tap-raise'),
    '2000-01-01'::timestamptz, 'an equal token leaves updated_at alone');
SELECT pg_temp.raise('raiser', 'tap-raise', 35) \g /dev/null
SELECT cmp_ok((SELECT updated_at FROM fence.tokens WHERE resource = 'tap-raise'),
    '>', '2000-01-01'::timestamptz, 'a raise sets updated_at');

-- Notifications: only real changes, in commit order, payload "<resource> <token>".
SELECT dblink_exec('listener', 'LISTEN fence_raise') \g /dev/null
-- Missing (notifies), equal (silent), lower (silent), higher (notifies).
SELECT pg_temp.raise('raiser', 'tap-raise-n', 7) \g /dev/null
SELECT pg_temp.raise('raiser', 'tap-raise-n', 7) \g /dev/null
SELECT pg_temp.raise('raiser', 'tap-raise-n', 6) \g /dev/null
SELECT pg_temp.raise('raiser', 'tap-raise-n', 9) \g /dev/null
SELECT is(pg_temp.notifications('listener', 2, 5),
    ARRAY['fence_raise: tap-raise-n 7', 'fence_raise: tap-raise-n 9'],
    'fence_raise is notified for the insert and the raise, not for equal or lower tokens');
SELECT is(pg_temp.notifications('listener', 1, 0.2), '{}'::text[], '... and nothing else');

-- A bind that raises notifies like a raise; one that does not raise is silent.
SELECT pg_temp.connect('s') \g /dev/null
SELECT is(pg_temp.bind('s', 'tap-raise-n', 11), 11::bigint, 'a bind with a higher token raises');
SELECT is(pg_temp.notifications('listener', 1, 5), ARRAY['fence_raise: tap-raise-n 11'], '... and notifies');
SELECT pg_temp.connect('s') \g /dev/null
SELECT is(pg_temp.bind('s', 'tap-raise-n', 11), 11::bigint, 'a bind with the stored token');
SELECT is(pg_temp.notifications('listener', 1, 0.2), '{}'::text[], '... notifies nobody');

-- A raise that rolls back notifies nobody.
SELECT dblink_exec('raiser', 'BEGIN') \g /dev/null
SELECT pg_temp.raise('raiser', 'tap-raise-n', 12) \g /dev/null
SELECT dblink_exec('raiser', 'ROLLBACK') \g /dev/null
SELECT is(pg_temp.notifications('listener', 1, 0.2), '{}'::text[], 'a raise rolled back notifies nobody');
SELECT is(pg_temp.stored('tap-raise-n'), 11::bigint, '... and is not stored');

-- fence.notify skips the notification while the queue is fuller than its limit (0.5 in a raise):
-- a full queue would fail the raise's commit. (Filling the real 8 GB queue takes minutes, so
-- the limit is what is varied here.)
SELECT * FROM dblink('raiser', $$SELECT fence.notify('tap-raise-q 1', 0)$$) AS t(x text) \g /dev/null
SELECT is(pg_temp.notifications('listener', 1, 0.2), '{}'::text[], 'fence.notify over its limit notifies nobody');
SELECT * FROM dblink('raiser', $$SELECT fence.notify('tap-raise-q 2', 1)$$) AS t(x text) \g /dev/null
SELECT is(pg_temp.notifications('listener', 1, 5), ARRAY['fence_raise: tap-raise-q 2'], '... and under it notifies');

-- fence.reset (by the owner): exactly the value, lower or not, and a notification saying so.
SELECT is((SELECT previous FROM dblink('raiser', $$SELECT fence.reset('tap-raise-n', 2)$$) AS t(previous bigint)),
    11::bigint, 'fence.reset returns the previous token');
SELECT is(pg_temp.stored('tap-raise-n'), 2::bigint, 'fence.reset lowers the stored token');
SELECT is(pg_temp.notifications('listener', 1, 5), ARRAY['fence_raise: tap-raise-n 2 reset'],
    'fence.reset notifies "<resource> <token> reset"');
SELECT is((SELECT previous FROM dblink('raiser', $$SELECT fence.reset('tap-raise-new', 0)$$) AS t(previous bigint)),
    NULL::bigint, 'fence.reset of a missing resource returns NULL');
SELECT is(pg_temp.stored('tap-raise-new'), 0::bigint, '... and creates the row with exactly that token');
SELECT is(pg_temp.notifications('listener', 1, 5), ARRAY['fence_raise: tap-raise-new 0 reset'], '... and notifies');
SELECT throws_ok($$SELECT fence.reset('tap-raise-n', -1)$$, 'ZF004', NULL, 'fence.reset refuses a negative token');
SELECT throws_ok($$SELECT fence.reset('Tap', 1)$$, 'ZF004', NULL, 'fence.reset refuses a malformed resource');

-- fence.reset raising ends the backends bound to a lower token (P2); lowering ends nobody.
SELECT pg_temp.connect('low') \g /dev/null
SELECT pg_temp.connect('high') \g /dev/null
SELECT pg_temp.remote_pid('low') AS low_pid, pg_temp.remote_pid('high') AS high_pid \gset
SELECT pg_temp.raise('raiser', 'tap-raise-r', 5) \g /dev/null
SELECT is(pg_temp.bind('low', 'tap-raise-r', 5), 5::bigint, 'a session is bound to token 5');
SELECT is((SELECT previous FROM dblink('raiser', $$SELECT fence.reset('tap-raise-r', 5)$$) AS t(previous bigint)),
    5::bigint, 'fence.reset to the stored token');
SELECT ok(pg_temp.alive(:low_pid), '... ends nobody');
SELECT is((SELECT previous FROM dblink('raiser', $$SELECT fence.reset('tap-raise-r', 9)$$) AS t(previous bigint)),
    5::bigint, 'fence.reset raises to 9');
SELECT ok(NOT pg_temp.alive(:low_pid), '... and ends the backend bound to 5');
SELECT is(pg_temp.binding_of(:low_pid), NULL, '... whose binding is removed');
SELECT is(pg_temp.bind('high', 'tap-raise-r', 9), 9::bigint, 'another session is bound to token 9');
SELECT is((SELECT previous FROM dblink('raiser', $$SELECT fence.reset('tap-raise-r', 2)$$) AS t(previous bigint)),
    9::bigint, 'fence.reset lowers to 2');
SELECT ok(pg_temp.alive(:high_pid), '... and ends nobody');
SELECT is(pg_temp.binding_of(:high_pid), 'tap-raise-r 9', '... the binding stays');
-- A raise must read the bindings with a snapshot taken after its lock: fence.reset refuses to
-- raise under REPEATABLE READ (whose snapshot could predate a binding) and raises nothing.
SELECT dblink_exec('raiser', 'BEGIN ISOLATION LEVEL REPEATABLE READ') \g /dev/null
SELECT throws_ok($$SELECT pg_temp.remote('raiser', 'SELECT fence.reset(''tap-raise-r'', 10)')$$, 'ZF007',
    'fencing unavailable: a raise of resource "tap-raise-r" must run under READ COMMITTED, not repeatable read',
    'fence.reset raising under REPEATABLE READ is ZF007');
SELECT dblink_exec('raiser', 'ROLLBACK') \g /dev/null
SELECT is(pg_temp.stored('tap-raise-r'), 2::bigint, '... and nothing is raised');

SELECT dblink_exec('raiser', $$
    DELETE FROM fence.tokens WHERE resource LIKE 'tap-raise%';
    DELETE FROM fence.bindings WHERE resource LIKE 'tap-raise%';
$$) \g /dev/null
SELECT dblink_disconnect(c) FROM unnest(dblink_get_connections()) AS c \g /dev/null
SELECT * FROM finish();
ROLLBACK;
