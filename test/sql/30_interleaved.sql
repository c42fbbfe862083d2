-- Interleaved sessions (dblink): an old leader's transaction is open with uncommitted writes
-- while a new leader raises from another session. The raise must not wait for the old
-- transaction; the old one's commit-time check must then fail with ZF001 (also under
-- REPEATABLE READ and SERIALIZABLE, whose snapshot predates the raise: the check does not read
-- through the snapshot) and its rows vanish.
\ir _psql.psql

BEGIN;
SELECT plan(44);
\ir _helpers.psql

SELECT dblink_connect('adm', pg_temp.connstr()) \g /dev/null
SELECT dblink_connect('old', pg_temp.connstr()) \g /dev/null
SELECT dblink_connect('new', pg_temp.connstr()) \g /dev/null
SELECT dblink_exec('adm', $$
    DELETE FROM fence.tokens WHERE resource LIKE 'tap-il%';
    CREATE TABLE IF NOT EXISTS tap_charges (id serial PRIMARY KEY, who text NOT NULL);
    GRANT ALL ON TABLE tap_charges, tap_charges_id_seq TO PUBLIC;
    DELETE FROM tap_charges WHERE who LIKE 'tap-il%';
$$) \g /dev/null
-- A raise must never wait long: fail instead of hanging if it does.
SELECT dblink_exec('new', $$SET lock_timeout = '2s'$$) \g /dev/null

-- The frozen old leader at one isolation level. When snapshot_first, the old transaction takes
-- its snapshot (its first write) before the raise; otherwise after it.
CREATE FUNCTION pg_temp.frozen(level text, resource text, snapshot_first boolean, want text)
RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE
    began timestamptz;
BEGIN
    PERFORM pg_temp.remote('adm', format('SELECT fence.raise(%L, 40)', resource));
    PERFORM dblink_exec('old', 'BEGIN ISOLATION LEVEL ' || level);
    IF snapshot_first THEN
        PERFORM dblink_exec('old', format('INSERT INTO tap_charges (who) VALUES (%L)', resource));
    END IF;

    began := clock_timestamp();
    RETURN NEXT is(pg_temp.remote('new', format('SELECT fence.raise(%L, 41)::text', resource)), '41',
        format('%s: the new leader''s raise commits while the old transaction is open', level));
    RETURN NEXT cmp_ok(clock_timestamp() - began, '<', interval '2 seconds',
        format('%s: ... within 2 s (took %s)', level, clock_timestamp() - began));

    IF NOT snapshot_first THEN
        PERFORM dblink_exec('old', format('INSERT INTO tap_charges (who) VALUES (%L)', resource));
    END IF;
    RETURN NEXT throws_ok(format('SELECT pg_temp.remote(%L, %L)', 'old', format('SELECT fence.check(%L, 40)', resource)),
        'ZF001', want, format('%s: the old leader''s commit-time check is ZF001', level));
    PERFORM dblink_exec('old', 'ROLLBACK');
    RETURN NEXT is(pg_temp.remote('adm', format('SELECT count(*)::text FROM tap_charges WHERE who = %L', resource)), '0',
        format('%s: none of the old leader''s rows committed', level));
END
$$;

SELECT * FROM pg_temp.frozen('READ COMMITTED', 'tap-il-rc', true,
    'stale fencing token: resource "tap-il-rc" token 40 is lower than the highest admitted token 41');
SELECT * FROM pg_temp.frozen('REPEATABLE READ', 'tap-il-rr', true,
    'stale fencing token: resource "tap-il-rr" token 40 is lower than the highest admitted token 41');
SELECT * FROM pg_temp.frozen('SERIALIZABLE', 'tap-il-ser', true,
    'stale fencing token: resource "tap-il-ser" token 40 is lower than the highest admitted token 41');
SELECT * FROM pg_temp.frozen('REPEATABLE READ', 'tap-il-rr-late', false,
    'stale fencing token: resource "tap-il-rr-late" token 40 is lower than the highest admitted token 41');

-- REPEATABLE READ is not over-eager: a raise of another resource does not refuse the commit.
SELECT pg_temp.remote('adm', $$SELECT fence.raise('tap-il-rr-ok', 45)$$) \g /dev/null
SELECT dblink_exec('old', 'BEGIN ISOLATION LEVEL REPEATABLE READ') \g /dev/null
SELECT dblink_exec('old', $$INSERT INTO tap_charges (who) VALUES ('tap-il-rr-ok')$$) \g /dev/null
SELECT pg_temp.remote('new', $$SELECT fence.raise('tap-il-other', 99)::text$$) \g /dev/null
SELECT lives_ok($$SELECT pg_temp.remote('old', $q$SELECT fence.check('tap-il-rr-ok', 45)$q$)$$,
    'REPEATABLE READ: the current token passes although another resource was raised meanwhile');
SELECT is(dblink_exec('old', 'COMMIT'), 'COMMIT', '... and commits');
SELECT is(pg_temp.remote('adm', $$SELECT count(*)::text FROM tap_charges WHERE who = 'tap-il-rr-ok'$$), '1', '... its row');

-- A check that meets an in-flight raise waits for it, then sees its outcome, at every isolation
-- level (the old transaction's snapshot is taken by its write, before the raise commits).
CREATE FUNCTION pg_temp.inflight(resource text, outcome text, level text DEFAULT 'READ COMMITTED')
RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE
    old_pid int := pg_temp.remote_pid('old');
BEGIN
    PERFORM pg_temp.remote('adm', format('SELECT fence.raise(%L, 50)', resource));
    PERFORM dblink_exec('new', 'BEGIN');
    PERFORM pg_temp.remote('new', format('SELECT fence.raise(%L, 51)', resource));
    PERFORM dblink_exec('old', 'BEGIN ISOLATION LEVEL ' || level);
    PERFORM dblink_exec('old', format('INSERT INTO tap_charges (who) VALUES (%L)', resource));
    PERFORM dblink_send_query('old', format('SELECT fence.check(%L, 50)', resource));
    RETURN NEXT ok(pg_temp.waits_for_lock(old_pid, 10),
        format('%s: the check waits for the in-flight raise (%s)', level, outcome));
    PERFORM dblink_exec('new', outcome);
    IF outcome = 'COMMIT' THEN
        RETURN NEXT throws_ok(format('SELECT x FROM dblink_get_result(%L) AS t(x text)', 'old'), 'ZF001',
            format('stale fencing token: resource "%s" token 50 is lower than the highest admitted token 51', resource),
            'the raise committed: the waiting check is ZF001');
    ELSE
        RETURN NEXT lives_ok(format('SELECT x FROM dblink_get_result(%L) AS t(x text)', 'old'),
            'the raise rolled back: the waiting check passes');
    END IF;
    PERFORM x FROM dblink_get_result('old') AS t(x text); -- the end of the asynchronous query
    PERFORM dblink_exec('old', 'ROLLBACK');
END
$$;
SELECT * FROM pg_temp.inflight('tap-il-inflight-c', 'COMMIT');
SELECT * FROM pg_temp.inflight('tap-il-inflight-r', 'ROLLBACK');
SELECT * FROM pg_temp.inflight('tap-il-inflight-rr', 'COMMIT', 'REPEATABLE READ');
SELECT * FROM pg_temp.inflight('tap-il-inflight-ser', 'COMMIT', 'SERIALIZABLE');

-- A check that locked first orders the old commit before the new admission: the raise waits
-- for that commit (the only moment a raise waits for a writer), and both succeed.
SELECT pg_temp.remote('adm', $$SELECT fence.raise('tap-il-order', 60)$$) \g /dev/null
SELECT dblink_exec('old', 'BEGIN') \g /dev/null
SELECT dblink_exec('old', $$INSERT INTO tap_charges (who) VALUES ('tap-il-order')$$) \g /dev/null
SELECT lives_ok($$SELECT pg_temp.remote('old', $q$SELECT fence.check('tap-il-order', 60)$q$)$$,
    'the old leader passes its check before the raise');
SELECT pg_temp.remote_pid('new') AS new_pid \gset
SELECT is(dblink_send_query('new', $$SELECT fence.raise('tap-il-order', 61)::text$$), 1, 'the new leader raises');
SELECT ok(pg_temp.waits_for_lock(:new_pid, 10), '... and waits for the checked transaction');
SELECT is(dblink_exec('old', 'COMMIT'), 'COMMIT', 'the checked transaction commits');
SELECT is((SELECT x FROM dblink_get_result('new') AS t(x text)), '61', 'then the raise completes');
SELECT is((SELECT count(*) FROM dblink_get_result('new') AS t(x text)), 0::bigint, '... alone');
SELECT is(pg_temp.remote('adm', $$SELECT count(*)::text FROM tap_charges WHERE who = 'tap-il-order'$$), '1',
    'the old leader''s row committed before the new token was admitted');

-- A transaction prepared after its check (PREPARE TRANSACTION; the proxy checks before it) keeps
-- the check's lock until COMMIT PREPARED: a raise waits for that commit, which is then ordered
-- before the admission, as the COMMIT above was.
SELECT pg_temp.remote('adm', $$SELECT fence.raise('tap-il-2pc', 70)$$) \g /dev/null
SELECT dblink_exec('old', 'BEGIN') \g /dev/null
SELECT dblink_exec('old', $$INSERT INTO tap_charges (who) VALUES ('tap-il-2pc')$$) \g /dev/null
SELECT pg_temp.remote('old', $q$SELECT fence.check('tap-il-2pc', 70)$q$) \g /dev/null
SELECT is(dblink_exec('old', $$PREPARE TRANSACTION 'tap-il-2pc'$$), 'PREPARE TRANSACTION', 'the old leader prepares its checked transaction');
SELECT is(dblink_send_query('new', $$SELECT fence.raise('tap-il-2pc', 71)::text$$), 1, 'the new leader raises');
SELECT ok(pg_temp.waits_for_lock(:new_pid, 10), '... and waits for the prepared transaction');
SELECT is(dblink_exec('adm', $$COMMIT PREPARED 'tap-il-2pc'$$), 'COMMIT PREPARED', 'the prepared transaction commits');
SELECT is((SELECT x FROM dblink_get_result('new') AS t(x text)), '71', 'then the raise completes');
SELECT is((SELECT count(*) FROM dblink_get_result('new') AS t(x text)), 0::bigint, '... alone');

-- After the raise, the old leader's next transaction is refused too, and the new one's passes.
SELECT dblink_exec('old', 'BEGIN') \g /dev/null
SELECT dblink_exec('old', $$INSERT INTO tap_charges (who) VALUES ('tap-il-order')$$) \g /dev/null
SELECT throws_ok($$SELECT pg_temp.remote('old', $q$SELECT fence.check('tap-il-order', 60)$q$)$$, 'ZF001', NULL,
    'the old leader''s next write is refused');
SELECT dblink_exec('old', 'ROLLBACK') \g /dev/null
SELECT dblink_exec('new', 'BEGIN') \g /dev/null
SELECT dblink_exec('new', $$INSERT INTO tap_charges (who) VALUES ('tap-il-order')$$) \g /dev/null
SELECT lives_ok($$SELECT pg_temp.remote('new', $q$SELECT fence.check('tap-il-order', 61)$q$)$$,
    'the new leader''s write passes');
SELECT is(dblink_exec('new', 'COMMIT'), 'COMMIT', '... and commits');
SELECT is(pg_temp.remote('adm', $$SELECT count(*)::text FROM tap_charges WHERE who = 'tap-il-order'$$), '2',
    'exactly the old leader''s checked row and the new leader''s row committed');

SELECT dblink_disconnect('adm') \g /dev/null
SELECT dblink_disconnect('old') \g /dev/null
SELECT dblink_disconnect('new') \g /dev/null
SELECT * FROM finish();
ROLLBACK;
