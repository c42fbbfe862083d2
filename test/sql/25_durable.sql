-- (D1) A raise is durable where a failover can take it: every function that raises a stored
-- token or records what an admission rests on makes its transaction commit with
-- synchronous_commit on, whatever the role (ALTER ROLE ... SET), the session or the client's
-- startup options set. Checked inside the transaction, after the call, before COMMIT: the
-- setting a commit uses is the one in force when it runs. (P7) is the local half of it.
\ir _psql.psql

BEGIN;
SELECT plan(20);
\ir _helpers.psql

SELECT pg_temp.store_key() \g /dev/null
SELECT pg_temp.login_role('tap_durable') \g /dev/null
SELECT pg_temp.connect('adm') \g /dev/null
SELECT dblink_exec('adm', $$
    DELETE FROM fence.tokens WHERE resource LIKE 'tap-durable%';
    DELETE FROM fence.bindings WHERE resource LIKE 'tap-durable%';
    DELETE FROM fence.leases WHERE resource LIKE 'tap-durable%';
    DELETE FROM fence.consul_tokens WHERE resource LIKE 'tap-durable%';
    ALTER ROLE tap_durable SET synchronous_commit = off;
$$) \g /dev/null

-- The role's setting: its sessions start with synchronous_commit off.
SELECT pg_temp.connect('s', 'tap_durable') \g /dev/null
SELECT is(pg_temp.remote('s', 'SHOW synchronous_commit'), 'off', 'ALTER ROLE ... SET synchronous_commit = off applies to the role''s sessions');
SELECT dblink_exec('s', 'BEGIN') \g /dev/null
SELECT is(pg_temp.bind('s', 'tap-durable', 5), 5::bigint, 'a bind that raises, role with synchronous_commit off (D1)');
SELECT is(pg_temp.remote('s', 'SHOW synchronous_commit'), 'on', '... commits with synchronous_commit on (D1)');
SELECT dblink_exec('s', 'COMMIT') \g /dev/null
SELECT is(pg_temp.remote('s', 'SHOW synchronous_commit'), 'off', '... for its own transaction only');

-- (D3) A client that asked for no warnings (client_min_messages = error) would not hear that
-- the commit's wait for the synchronous standbys was cancelled: the raise's transaction lowers
-- it to warning, for that transaction only (rolled back here: the stored token stays 5).
SELECT pg_temp.connect('s', 'tap_durable') \g /dev/null
SELECT dblink_exec('s', 'SET client_min_messages = error') \g /dev/null
SELECT dblink_exec('s', 'BEGIN') \g /dev/null
SELECT pg_temp.bind('s', 'tap-durable', 6) \g /dev/null
SELECT is(pg_temp.remote('s', 'SHOW client_min_messages'), 'warning', 'a raise''s transaction hears warnings whatever the client asked (D3)');
SELECT dblink_exec('s', 'ROLLBACK') \g /dev/null
SELECT is(pg_temp.remote('s', 'SHOW client_min_messages'), 'error', '... for its own transaction only');

-- A bind that raises nothing keeps the session's setting (nothing durable changes).
SELECT pg_temp.connect('s', 'tap_durable') \g /dev/null
SELECT dblink_exec('s', 'BEGIN') \g /dev/null
SELECT is(pg_temp.bind('s', 'tap-durable', 5), 5::bigint, 'a bind of the stored token raises nothing');
SELECT is(pg_temp.remote('s', 'SHOW synchronous_commit'), 'off', '... and commits without waiting for the flush');
SELECT dblink_exec('s', 'ROLLBACK') \g /dev/null

-- (D3) With synchronous standbys configured, a bind that raises nothing commits durably too:
-- its commit waits for them, and so for a raise before it whose own wait was cancelled. The
-- standby named here does not exist: the bind's transaction is rolled back, never committed.
SELECT dblink_exec('adm', $$ALTER SYSTEM SET synchronous_standby_names = 'fence_tap_no_such_standby'$$) \g /dev/null
SELECT pg_reload_conf() \g /dev/null
SELECT pg_temp.connect('s', 'tap_durable') \g /dev/null
DO $$
BEGIN
    FOR i IN 1..500 LOOP
        EXIT WHEN pg_temp.remote('s', 'SHOW synchronous_standby_names') = 'fence_tap_no_such_standby';
        PERFORM pg_sleep(0.01);
    END LOOP;
END
$$;
SELECT dblink_exec('s', 'BEGIN') \g /dev/null
SELECT is(pg_temp.bind('s', 'tap-durable', 5), 5::bigint, 'with synchronous standbys, a bind of the stored token raises nothing');
SELECT is(pg_temp.remote('s', 'SHOW synchronous_commit'), 'on', '... and commits with synchronous_commit on all the same, waiting for them (D3)');
SELECT dblink_exec('s', 'ROLLBACK') \g /dev/null
SELECT dblink_exec('adm', 'ALTER SYSTEM RESET synchronous_standby_names') \g /dev/null
SELECT pg_reload_conf() \g /dev/null
DO $$
BEGIN
    FOR i IN 1..500 LOOP
        EXIT WHEN pg_temp.remote('s', 'SHOW synchronous_standby_names') = '';
        PERFORM pg_sleep(0.01);
    END LOOP;
END
$$;

-- The client's startup options (what a proxy passes on from its client's options).
SELECT dblink_disconnect('s') \g /dev/null
SELECT dblink_connect('s', pg_temp.connstr('tap_durable') || ' options=''-c synchronous_commit=remote_write''') \g /dev/null
SELECT dblink_exec('s', 'BEGIN') \g /dev/null
SELECT is(pg_temp.raise('s', 'tap-durable', 6), 6::bigint, 'fence.raise in a session started with -c synchronous_commit=remote_write (D1)');
SELECT is(pg_temp.remote('s', 'SHOW synchronous_commit'), 'on', '... commits with synchronous_commit on (D1)');
SELECT dblink_exec('s', 'COMMIT') \g /dev/null

-- remote_apply is stronger than on: kept.
SELECT dblink_exec('s', 'SET synchronous_commit = remote_apply; BEGIN') \g /dev/null
SELECT is(pg_temp.raise('s', 'tap-durable', 7), 7::bigint, 'fence.raise in a session with synchronous_commit remote_apply');
SELECT is(pg_temp.remote('s', 'SHOW synchronous_commit'), 'remote_apply', '... keeps remote_apply (D1)');
SELECT dblink_exec('s', 'COMMIT') \g /dev/null

-- The lease acquisition, which raises (L2), and the operator's reset.
SELECT dblink_disconnect('s') \g /dev/null
SELECT dblink_connect('s', pg_temp.connstr('postgres') || ' options=''-c synchronous_commit=off''') \g /dev/null
SELECT dblink_exec('s', 'BEGIN') \g /dev/null
SELECT is((SELECT r FROM dblink('s', $$SELECT acquired::text || ' ' || generation FROM fence.lease_acquire('tap-durable-lease', 'h1', '1 minute')$$) AS t(r text)),
    'true 1', 'fence.lease_acquire in a session with synchronous_commit off');
SELECT is(pg_temp.remote('s', 'SHOW synchronous_commit'), 'on', '... commits with synchronous_commit on (D1, L2)');
SELECT dblink_exec('s', 'COMMIT') \g /dev/null
SELECT dblink_exec('s', 'BEGIN') \g /dev/null
SELECT is((SELECT r FROM dblink('s', $$SELECT coalesce(fence.reset('tap-durable', 9)::text, '-')$$) AS t(r text)), '7',
    'fence.reset in a session with synchronous_commit off');
SELECT is(pg_temp.remote('s', 'SHOW synchronous_commit'), 'on', '... commits with synchronous_commit on (D1)');
SELECT dblink_exec('s', 'COMMIT') \g /dev/null

-- A lock service's record, in the statement the proxy runs (fence.consul_admit, then a bind
-- that raises nothing: it must not turn synchronous_commit off again).
SELECT pg_temp.connect('s', 'tap_durable') \g /dev/null
SELECT dblink_exec('s', 'BEGIN') \g /dev/null
SELECT is((SELECT r FROM dblink('s', format(
        'SELECT a.recorded || '' '' || fence.bind(%L, %s, %L) FROM fence.consul_admit(%L, %s, %L, %L) AS a',
        'tap-durable', 9, pg_temp.proof('bind', 'tap-durable', 9, 's'),
        'tap-durable', 9, 'session-a', pg_temp.proof('consul', 'tap-durable', 9, 's'))) AS t(r text)),
    '9 9', 'fence.consul_admit records a holder and fence.bind binds to the stored token, one statement');
SELECT is(pg_temp.remote('s', 'SHOW synchronous_commit'), 'on', '... commits with synchronous_commit on (D1, C2)');
SELECT dblink_exec('s', 'COMMIT') \g /dev/null

SELECT dblink_exec('adm', $$
    DELETE FROM fence.tokens WHERE resource LIKE 'tap-durable%';
    DELETE FROM fence.bindings WHERE resource LIKE 'tap-durable%';
    DELETE FROM fence.leases WHERE resource LIKE 'tap-durable%';
    DELETE FROM fence.consul_tokens WHERE resource LIKE 'tap-durable%';
    DELETE FROM fence.history WHERE resource LIKE 'tap-durable%';
$$) \g /dev/null
SELECT dblink_disconnect(c) FROM unnest(dblink_get_connections()) AS c \g /dev/null
SELECT pg_temp.drop_login_role('tap_durable') \g /dev/null
SELECT * FROM finish();
ROLLBACK;
