-- Interleaved sessions (dblink), the fenced ones as an application role that is not a
-- superuser, the owner's as postgres. A new leader's bind (or the proxy's raise) ends every
-- backend bound to a lower token of its resource before it commits (P2): the old leader's open
-- transaction is rolled back with its backend, and it cannot come back with its old token (P3).
-- Binds and raises of one resource wait for each other (P1). Prepared transactions, which
-- outlive their backend, stop a raise (P4).
\ir _psql.psql

BEGIN;
SELECT plan(79);
\ir _helpers.psql

SELECT pg_temp.store_key() \g /dev/null
SELECT pg_temp.login_role('tap_leader') \g /dev/null
SELECT pg_temp.connect('adm') \g /dev/null
SELECT dblink_exec('adm', format('ROLLBACK PREPARED %L', gid)) FROM pg_prepared_xacts WHERE gid LIKE 'tap-%' \g /dev/null
SELECT dblink_exec('adm', $$
    DELETE FROM fence.tokens WHERE resource LIKE 'tap-il%';
    DELETE FROM fence.bindings WHERE resource LIKE 'tap-il%';
    CREATE TABLE IF NOT EXISTS tap_charges (id serial PRIMARY KEY, who text NOT NULL);
    GRANT ALL ON TABLE tap_charges, tap_charges_id_seq TO PUBLIC;
    DELETE FROM tap_charges WHERE who LIKE 'tap-il%';
$$) \g /dev/null
SELECT pg_temp.connect('raiser', 'tap_leader') \g /dev/null
SELECT pg_temp.remote_pid('raiser') AS raiser_pid \gset
-- A raise must never wait long for a lock here: fail instead of hanging if it does.
SELECT dblink_exec('raiser', $$SET lock_timeout = '10s'$$) \g /dev/null

-- The old leaders, bound to 33: one idle in a transaction with an uncommitted insert, one in
-- autocommit (its insert committed before the new leader came), one a superuser's session.
-- Another resource's session is bound to a low token.
SELECT pg_temp.raise('adm', 'tap-il', 33) \g /dev/null
SELECT pg_temp.connect('old', 'tap_leader') \g /dev/null
SELECT pg_temp.connect('old2', 'tap_leader') \g /dev/null
SELECT pg_temp.connect('oldsu', 'postgres') \g /dev/null
SELECT pg_temp.connect('other', 'tap_leader') \g /dev/null
SELECT pg_temp.connect('new', 'tap_leader') \g /dev/null
SELECT pg_temp.remote_pid('old') AS old_pid, pg_temp.remote_pid('old2') AS old2_pid,
       pg_temp.remote_pid('oldsu') AS oldsu_pid, pg_temp.remote_pid('other') AS other_pid,
       pg_temp.remote_pid('new') AS new_pid \gset
SELECT is(pg_temp.bind('old', 'tap-il', 33), 33::bigint, 'the old leader binds 33');
SELECT is(pg_temp.bind('old2', 'tap-il', 33), 33::bigint, 'a second old session binds 33');
SELECT is(pg_temp.bind('oldsu', 'tap-il', 33), 33::bigint, 'a superuser''s old session binds 33');
SELECT is(pg_temp.bind('other', 'tap-il-other', 1), 1::bigint, 'a session of another resource binds token 1');
SELECT is(dblink_exec('old2', $$INSERT INTO tap_charges (who) VALUES ('tap-il-old2')$$), 'INSERT 0 1',
    'the autocommit old session commits a row');
SELECT dblink_exec('old', 'BEGIN') \g /dev/null
SELECT is(dblink_exec('old', $$INSERT INTO tap_charges (who) VALUES ('tap-il-old')$$), 'INSERT 0 1',
    'the old leader inserts a row and stays idle in its transaction');

-- The new leader binds 34.
SELECT clock_timestamp() AS began \gset
SELECT is(pg_temp.bind('new', 'tap-il', 34), 34::bigint, 'the new leader binds 34');
SELECT cmp_ok(clock_timestamp() - :'began'::timestamptz, '<', interval '2 seconds',
    '... within 2 s, the open old transaction notwithstanding');
SELECT is(pg_temp.stored('tap-il'), 34::bigint, 'the raise to 34 committed');
SELECT ok(NOT pg_temp.alive(:old_pid), 'the old leader''s backend is gone');
SELECT ok(NOT pg_temp.alive(:old2_pid), 'the autocommit old session''s backend is gone');
SELECT ok(NOT pg_temp.alive(:oldsu_pid), 'the superuser''s old session''s backend is gone');
SELECT is((SELECT count(*) FROM fence.bindings WHERE pid IN (:old_pid, :old2_pid, :oldsu_pid)), 0::bigint,
    '... and their bindings are removed');
SELECT ok(pg_temp.connection_lost($$SELECT dblink_exec('old', 'COMMIT')$$),
    'the old leader''s COMMIT finds its connection lost');
SELECT ok(pg_temp.connection_lost($$SELECT pg_temp.remote('old2', $q$INSERT INTO tap_charges (who) VALUES ('tap-il-old2') RETURNING ''$q$)$$),
    'the autocommit old session''s next write finds its connection lost');
SELECT is((SELECT count(*) FROM tap_charges WHERE who = 'tap-il-old'), 0::bigint,
    'the old leader''s uncommitted row is not in the table');
SELECT is((SELECT count(*) FROM tap_charges WHERE who = 'tap-il-old2'), 1::bigint,
    'the row committed before the raise is');
SELECT ok(pg_temp.alive(:other_pid), 'the other resource''s session is untouched');
SELECT is(pg_temp.remote('other', 'SELECT 1::text'), '1', '... and goes on');
SELECT is(pg_temp.binding_of(:other_pid), 'tap-il-other 1', '... bound as before');
SELECT is(pg_temp.binding_of(:new_pid), 'tap-il 34', 'the new leader is bound to 34');

-- The old leader reconnects with its token: refused, nothing bound (P3).
SELECT pg_temp.connect('old', 'tap_leader') \g /dev/null
SELECT pg_temp.remote_pid('old') AS old_pid \gset
SELECT throws_ok($$SELECT pg_temp.bind('old', 'tap-il', 33)$$, 'ZF001',
    'stale fencing token: resource "tap-il" token 33 is lower than the highest admitted token 34',
    'the old leader reconnecting with 33 is refused with ZF001');
SELECT is(pg_temp.binding_of(:old_pid), NULL, '... and is not bound');
SELECT ok(pg_temp.alive(:new_pid), '... and the new leader is untouched');

-- The proxy's raise (a control connection): equal is a no-op, higher ends the current leader.
SELECT is(pg_temp.raise('raiser', 'tap-il', 34), 34::bigint, 'a raise to 34, the stored token');
SELECT ok(pg_temp.alive(:new_pid), '... leaves the session bound to 34 alone');
SELECT is(pg_temp.remote('new', 'SELECT 1::text'), '1', '... which goes on');
SELECT is(pg_temp.raise('raiser', 'tap-il', 35), 35::bigint, 'a raise to 35');
SELECT ok(NOT pg_temp.alive(:new_pid), '... ends the session bound to 34');
SELECT ok(pg_temp.connection_lost($$SELECT pg_temp.remote('new', 'SELECT 1::text')$$), '... whose connection is lost');
SELECT ok(pg_temp.alive(:other_pid), '... and not the other resource''s session');
SELECT is(pg_temp.remote('other', 'SELECT 1::text'), '1', '... which still goes on');

-- A raise ends every stale backend at once.
SELECT pg_temp.connect('many' || i, 'tap_leader') FROM generate_series(1, 10) AS i \g /dev/null
SELECT is(array_agg(pg_temp.bind('many' || i, 'tap-il-many', 1)), array_fill(1::bigint, ARRAY[10]),
    'ten sessions bind token 1') FROM generate_series(1, 10) AS i;
SELECT array_agg(pg_temp.remote_pid('many' || i)) AS many_pids FROM generate_series(1, 10) AS i \gset
SELECT is(pg_temp.raise('raiser', 'tap-il-many', 2), 2::bigint, 'a raise to 2');
SELECT is((SELECT count(*) FROM unnest(:'many_pids'::int[]) AS p WHERE pg_temp.alive(p)), 0::bigint,
    '... ends all ten');

-- A bind that meets a raise in flight (its transaction still open) waits for it (P1), then reads
-- the token it stored: refused if lower, bound if equal; after a rollback, bound.
SELECT pg_temp.raise('adm', 'tap-il-wait', 40) \g /dev/null
SELECT pg_temp.connect('w', 'tap_leader') \g /dev/null
SELECT pg_temp.remote_pid('w') AS w_pid \gset
SELECT dblink_exec('raiser', 'BEGIN') \g /dev/null
SELECT is(pg_temp.raise('raiser', 'tap-il-wait', 41), 41::bigint, 'a raise to 41 runs in an open transaction');
SELECT is(dblink_send_query('w', pg_temp.bind_sql('w', 'tap-il-wait', 40)), 1, 'a bind of 40 is sent');
SELECT ok(pg_temp.waits_for_lock(:w_pid, 10), '... and waits for the raise');
SELECT is(dblink_exec('raiser', 'COMMIT'), 'COMMIT', 'the raise commits');
SELECT throws_ok($$SELECT x FROM dblink_get_result('w') AS t(x text)$$, 'ZF001',
    'stale fencing token: resource "tap-il-wait" token 40 is lower than the highest admitted token 41',
    '... and the waiting bind of 40 is ZF001');
SELECT x FROM dblink_get_result('w') AS t(x text) \g /dev/null
SELECT is(pg_temp.binding_of(:w_pid), NULL, '... and binds nothing');

SELECT dblink_exec('raiser', 'BEGIN') \g /dev/null
SELECT is(pg_temp.raise('raiser', 'tap-il-wait', 42), 42::bigint, 'a raise to 42 runs in an open transaction');
SELECT is(dblink_send_query('w', pg_temp.bind_sql('w', 'tap-il-wait', 41)), 1, 'a bind of 41 is sent');
SELECT ok(pg_temp.waits_for_lock(:w_pid, 10), '... and waits for the raise');
SELECT is(dblink_exec('raiser', 'ROLLBACK'), 'ROLLBACK', 'the raise rolls back');
SELECT is((SELECT x FROM dblink_get_result('w') AS t(x text)), '41', '... and the waiting bind of 41 binds');
SELECT x FROM dblink_get_result('w') AS t(x text) \g /dev/null
SELECT is(pg_temp.binding_of(:w_pid), 'tap-il-wait 41', '... the backend');

SELECT pg_temp.connect('w2', 'tap_leader') \g /dev/null
SELECT pg_temp.remote_pid('w2') AS w2_pid \gset
SELECT dblink_exec('raiser', 'BEGIN') \g /dev/null
SELECT pg_temp.raise('raiser', 'tap-il-wait', 42) \g /dev/null
SELECT is(dblink_send_query('w2', pg_temp.bind_sql('w2', 'tap-il-wait', 42)), 1, 'a bind of 42 is sent while a raise to 42 is open');
SELECT ok(pg_temp.waits_for_lock(:w2_pid, 10), '... and waits for the raise');
SELECT dblink_exec('raiser', 'COMMIT') \g /dev/null
SELECT is((SELECT x FROM dblink_get_result('w2') AS t(x text)), '42', 'the raise commits and the bind of 42 binds');
SELECT x FROM dblink_get_result('w2') AS t(x text) \g /dev/null
SELECT ok(NOT pg_temp.alive(:w_pid), '... and the session bound to 41 is gone');

-- fence.settled, which the proxy asks when the server ended a session: the stored token at once
-- when no raise is in flight (0 for a resource without one), after the raise commits (the new
-- token) or rolls back (the old one) when one is; refused without the proxy's proof.
SELECT pg_temp.connect('asker', 'tap_leader') \g /dev/null
SELECT pg_temp.remote_pid('asker') AS asker_pid \gset
SELECT is(pg_temp.settled('asker', 'tap-il-wait', 41), 42::bigint, 'fence.settled returns the stored token at once');
SELECT is(pg_temp.settled('asker', 'tap-il-none', 1), 0::bigint, '... and 0 for a resource without a token');
SELECT dblink_exec('raiser', 'BEGIN') \g /dev/null
SELECT pg_temp.raise('raiser', 'tap-il-wait', 43) \g /dev/null
SELECT is(dblink_send_query('asker', pg_temp.settled_sql('asker', 'tap-il-wait', 42)), 1,
    'fence.settled is sent while a raise to 43 is open');
SELECT ok(pg_temp.waits_for_lock(:asker_pid, 10), '... and waits for the raise');
SELECT dblink_exec('raiser', 'COMMIT') \g /dev/null
SELECT is((SELECT x FROM dblink_get_result('asker') AS t(x text)), '43', '... and returns its token once it commits');
SELECT x FROM dblink_get_result('asker') AS t(x text) \g /dev/null
SELECT dblink_exec('raiser', 'BEGIN') \g /dev/null
SELECT pg_temp.raise('raiser', 'tap-il-wait', 44) \g /dev/null
SELECT is(dblink_send_query('asker', pg_temp.settled_sql('asker', 'tap-il-wait', 43)), 1,
    'fence.settled is sent while a raise to 44 is open');
SELECT ok(pg_temp.waits_for_lock(:asker_pid, 10), '... and waits for the raise');
SELECT dblink_exec('raiser', 'ROLLBACK') \g /dev/null
SELECT is((SELECT x FROM dblink_get_result('asker') AS t(x text)), '43', '... and returns the old token once it rolls back');
SELECT x FROM dblink_get_result('asker') AS t(x text) \g /dev/null
SELECT throws_ok(format('SELECT * FROM dblink(%L, %L) AS t(x bigint)', 'asker', pg_temp.call_sql('settled', 'tap-il-wait', 43, 'f00d')),
    'ZF010', NULL, 'fence.settled without the proxy''s proof is ZF010');
SELECT is(pg_temp.binding_of(:asker_pid), NULL, 'fence.settled binds nothing');

-- A raise that meets a bind in flight (the bind's transaction still open) waits for it (P1),
-- then sees the binding and ends its backend (P2).
SELECT pg_temp.raise('adm', 'tap-il-order', 50) \g /dev/null
SELECT pg_temp.connect('b', 'tap_leader') \g /dev/null
SELECT pg_temp.remote_pid('b') AS b_pid \gset
SELECT dblink_exec('b', 'BEGIN') \g /dev/null
SELECT is(pg_temp.bind('b', 'tap-il-order', 50), 50::bigint, 'a bind of 50 runs in an open transaction');
SELECT dblink_exec('b', $$INSERT INTO tap_charges (who) VALUES ('tap-il-order')$$) \g /dev/null
SELECT is(dblink_send_query('raiser', pg_temp.raise_sql('raiser', 'tap-il-order', 51)), 1, 'a raise to 51 is sent');
SELECT ok(pg_temp.waits_for_lock(:raiser_pid, 10), '... and waits for the bind');
SELECT is(dblink_exec('b', 'COMMIT'), 'COMMIT', 'the bind commits (with a row)');
SELECT is((SELECT x FROM dblink_get_result('raiser') AS t(x text)), '51', 'then the raise completes');
SELECT x FROM dblink_get_result('raiser') AS t(x text) \g /dev/null
SELECT ok(NOT pg_temp.alive(:b_pid), '... and has ended the backend bound meanwhile');
SELECT is((SELECT count(*) FROM tap_charges WHERE who = 'tap-il-order'), 1::bigint,
    'the row committed before the raise stays');

-- Prepared transactions (P4): a stale leader's prepared transaction could be committed by
-- anyone after the raise, so a raise refuses while one exists, names it, and raises nothing.
SELECT pg_temp.raise('adm', 'tap-il-2pc', 70) \g /dev/null
SELECT pg_temp.connect('p', 'tap_leader') \g /dev/null
SELECT pg_temp.remote_pid('p') AS p_pid \gset
SELECT pg_temp.bind('p', 'tap-il-2pc', 70) \g /dev/null
SELECT dblink_exec('p', 'BEGIN') \g /dev/null
SELECT dblink_exec('p', $$INSERT INTO tap_charges (who) VALUES ('tap-il-2pc')$$) \g /dev/null
SELECT is(dblink_exec('p', $$PREPARE TRANSACTION 'tap-il-2pc'$$), 'PREPARE TRANSACTION',
    'the leader bound to 70 prepares a transaction');
SELECT is((pg_temp.error_of(format('SELECT pg_temp.remote(%L, %L)', 'raiser', pg_temp.raise_sql('raiser', 'tap-il-2pc', 71))))[1],
    'ZF011', 'a raise to 71 is ZF011');
SELECT matches((pg_temp.error_of(format('SELECT pg_temp.remote(%L, %L)', 'raiser', pg_temp.raise_sql('raiser', 'tap-il-2pc', 71))))[2],
    '^fencing raise failed: resource "tap-il-2pc" was not raised to token 71 because prepared transactions exist in this database: ''tap-il-2pc'' \(owner tap_leader, prepared ',
    '... naming the prepared transaction');
SELECT is(pg_temp.stored('tap-il-2pc'), 70::bigint, '... and nothing is raised');
SELECT ok(pg_temp.alive(:p_pid), '... and nobody is ended: a raise that would fail refuses before it ends a backend');
SELECT pg_temp.connect('n', 'tap_leader') \g /dev/null
SELECT pg_temp.remote_pid('n') AS n_pid \gset
SELECT throws_ok($$SELECT pg_temp.bind('n', 'tap-il-2pc', 71)$$, 'ZF011', NULL, 'a bind of 71, which raises, is ZF011 too');
SELECT is(pg_temp.binding_of(:n_pid), NULL, '... and binds nothing');
SELECT is(pg_temp.stored('tap-il-2pc'), 70::bigint, '... nor raises');
SELECT is(dblink_exec('adm', $$ROLLBACK PREPARED 'tap-il-2pc'$$), 'ROLLBACK PREPARED', 'the prepared transaction is rolled back');
SELECT is(pg_temp.raise('raiser', 'tap-il-2pc', 71), 71::bigint, 'then the raise to 71 succeeds');
SELECT is((SELECT count(*) FROM tap_charges WHERE who = 'tap-il-2pc'), 0::bigint, '... and the stale row never committed');

SELECT dblink_exec('adm', $$
    DELETE FROM fence.tokens WHERE resource LIKE 'tap-il%';
    DELETE FROM fence.bindings WHERE resource LIKE 'tap-il%';
    DELETE FROM tap_charges WHERE who LIKE 'tap-il%';
$$) \g /dev/null
SELECT dblink_disconnect(c) FROM unnest(dblink_get_connections()) AS c \g /dev/null
SELECT pg_temp.drop_login_role('tap_leader') \g /dev/null
SELECT * FROM finish();
ROLLBACK;
