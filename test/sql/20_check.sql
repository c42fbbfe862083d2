-- fence.check and fence.check_readonly in one session: the messages, SQLSTATEs, DETAIL and
-- HINT of a refusal, and the no-op for transactions that wrote nothing.
\ir _psql.psql

BEGIN;
SELECT plan(22);
\ir _helpers.psql

SELECT dblink_connect('adm', pg_temp.connstr()) \g /dev/null
SELECT dblink_connect('s', pg_temp.connstr()) \g /dev/null
SELECT dblink_exec('adm', $$
    DELETE FROM fence.tokens WHERE resource LIKE 'tap-check%';
    CREATE TABLE IF NOT EXISTS tap_charges (id serial PRIMARY KEY, who text NOT NULL);
    GRANT ALL ON TABLE tap_charges, tap_charges_id_seq TO PUBLIC;
    DELETE FROM tap_charges WHERE who LIKE 'tap-check%';
    INSERT INTO tap_charges (who) VALUES ('tap-check-seed');
    DO $d$ BEGIN PERFORM fence.raise('tap-check', 34); PERFORM fence.raise('tap-check-ro', 34); END $d$;
$$) \g /dev/null

-- This session: pgTAP itself writes (its temporary tables), so the transaction has an xid and
-- fence.check does its full work here.
SELECT isnt(pg_current_xact_id_if_assigned(), NULL, 'the test transaction has an xid (it wrote)');
SELECT lives_ok($$SELECT fence.check('tap-check', 34)$$, 'the current token passes');
SELECT lives_ok($$SELECT fence.check('tap-check', 35)$$, 'a higher token passes');
SELECT throws_ok($$SELECT fence.check('tap-check', 33)$$, 'ZF001',
    'stale fencing token: resource "tap-check" token 33 is lower than the highest admitted token 34',
    'a stale token is ZF001 with the resource, its token and the admitted one');
SELECT is(pg_temp.error_of($$SELECT fence.check('tap-check', 33)$$),
    ARRAY['ZF001',
          'stale fencing token: resource "tap-check" token 33 is lower than the highest admitted token 34',
          'The transaction was rolled back; none of its changes were committed.',
          'This process is no longer the leader for "tap-check": stop writing, acquire the lock again to get a new fencing token, and reconnect with it.'],
    'the refusal says the transaction was rolled back and what to do');
SELECT throws_ok($$SELECT fence.check('tap-check-none', 5)$$, 'ZF001',
    'stale fencing token: resource "tap-check-none" token 5 was not admitted (no token is stored for this resource)',
    'a resource without a stored token is ZF001');
SELECT throws_ok($$SELECT fence.check('tap-check', 0)$$, 'ZF004', NULL, 'token 0 is ZF004');
SELECT throws_ok($$SELECT fence.check('tap-check', NULL)$$, 'ZF004', NULL, 'a NULL token is ZF004');
SELECT throws_ok($$SELECT fence.check('TAP', 5)$$, 'ZF004', NULL, 'a malformed resource is ZF004');
SELECT throws_ok($$SELECT fence.check_readonly()$$, '25006',
    'fenceproxy: this session is read-only (no fencing token); its transaction tried to write',
    'check_readonly refuses a transaction that wrote');

-- Another session, in transactions that wrote nothing: the check is a no-op whatever the
-- token, takes no lock and assigns no xid.
SELECT dblink_exec('s', 'BEGIN') \g /dev/null
SELECT is(pg_temp.remote('s', $q$SELECT count(*)::text FROM tap_charges WHERE who = 'tap-check-seed'$q$), '1', 'the reader reads');
SELECT lives_ok($$SELECT pg_temp.remote('s', $q$SELECT fence.check('tap-check-ro', 1)$q$)$$,
    'a stale token passes in a transaction that wrote nothing');
SELECT lives_ok($$SELECT pg_temp.remote('s', $q$SELECT fence.check('tap-check-none', 1)$q$)$$,
    '... as does a resource without a stored token');
SELECT is(pg_temp.remote('s', 'SELECT pg_current_xact_id_if_assigned()::text'), NULL,
    '... and the check assigned no xid');
SELECT is(pg_temp.remote('s', $q$SELECT count(*)::text FROM pg_locks WHERE locktype = 'transactionid' AND pid = pg_backend_pid()$q$), '0',
    '... nor locked anything');
SELECT is(pg_temp.remote('adm', $q$SET lock_timeout = '1s'; SELECT fence.raise('tap-check-ro', 35)::text$q$), '35',
    'a raise does not wait for that reader');
SELECT lives_ok($$SELECT pg_temp.remote('s', 'SELECT fence.check_readonly()')$$,
    'check_readonly passes a transaction that wrote nothing');
SELECT is(dblink_exec('s', 'COMMIT'), 'COMMIT', 'the reader commits');

-- Writes of every kind give the transaction an xid, and check_readonly refuses them.
SELECT dblink_exec('s', 'BEGIN') \g /dev/null
SELECT dblink_exec('s', 'CREATE TEMP TABLE tap_scratch (x int)') \g /dev/null
SELECT throws_ok($$SELECT pg_temp.remote('s', 'SELECT fence.check_readonly()')$$, '25006', NULL,
    'check_readonly refuses a transaction that created a temporary table');
SELECT dblink_exec('s', 'ROLLBACK') \g /dev/null
SELECT dblink_exec('s', 'BEGIN') \g /dev/null
SELECT dblink_exec('s', $$INSERT INTO tap_charges (who) VALUES ('tap-check-ro')$$) \g /dev/null
SELECT throws_ok($$SELECT pg_temp.remote('s', 'SELECT fence.check_readonly()')$$, '25006', NULL,
    'check_readonly refuses a transaction that inserted');
SELECT dblink_exec('s', 'ROLLBACK') \g /dev/null
SELECT dblink_exec('s', 'BEGIN') \g /dev/null
SELECT pg_temp.remote('s', 'SELECT count(*)::text FROM (SELECT * FROM tap_charges FOR UPDATE) AS locked') \g /dev/null
SELECT throws_ok($$SELECT pg_temp.remote('s', $q$SELECT fence.check('tap-check-ro', 1)$q$)$$, 'ZF001', NULL,
    'a stale token is refused for a transaction that only locked rows (it has an xid)');
SELECT dblink_exec('s', 'ROLLBACK') \g /dev/null
SELECT is(pg_temp.remote('adm', $q$SELECT count(*)::text FROM tap_charges WHERE who = 'tap-check-ro'$q$), '0',
    'nothing the refused transactions wrote was committed');

-- No cleanup of the rows here: this transaction still holds a share lock on 'tap-check' (from
-- the checks that passed), so another session would wait for it. The setup above clears them.
SELECT dblink_disconnect('adm') \g /dev/null
SELECT dblink_disconnect('s') \g /dev/null
SELECT * FROM finish();
ROLLBACK;
