-- The history of admitted tokens (migration 6): every raise that stores a token, through
-- fence.raise, a bind that raises, a lease acquisition or fence.reset, appends one row, with the
-- raising backend's role, application_name and pid, and the lease's holder; a raise that stores
-- nothing appends none. A failing insert never fails the raise (H1), and an application role
-- may read the history but neither write it, nor lock it against the raise, nor call
-- fence.record_raise (H2). The history is read through another connection ('adm', autocommit)
-- so that this transaction holds no lock on it when 'adm' alters the table.
\ir _psql.psql

BEGIN;
SELECT plan(15);
\ir _helpers.psql

SELECT pg_temp.store_key() \g /dev/null
SELECT pg_temp.connect('adm') \g /dev/null
SELECT dblink_exec('adm', $$
    DELETE FROM fence.tokens WHERE resource LIKE 'tap-hist%';
    DELETE FROM fence.bindings WHERE resource LIKE 'tap-hist%';
    DELETE FROM fence.leases WHERE resource LIKE 'tap-hist%';
    DELETE FROM fence.history WHERE resource LIKE 'tap-hist%';
$$) \g /dev/null
SELECT pg_temp.connect('raiser') \g /dev/null
SELECT dblink_exec('raiser', 'SET application_name = ''tap-proxy''') \g /dev/null

-- The history of resource as 'token previous reset application_name role holder' lines.
CREATE FUNCTION pg_temp.history(resource text) RETURNS text[] LANGUAGE sql AS $$
    SELECT coalesce(array_agg(x), '{}') FROM pg_temp.remote('adm', format(
        $q$SELECT concat_ws(' ', token, coalesce(previous::text, '-'), reset::text, coalesce(application_name, '-'), role,
                            coalesce(holder, '-')) FROM fence.history WHERE resource = %L ORDER BY id$q$, resource)) AS x
$$;

SELECT pg_temp.raise('raiser', 'tap-hist', 3) \g /dev/null
SELECT pg_temp.raise('raiser', 'tap-hist', 3) \g /dev/null
SELECT pg_temp.raise('raiser', 'tap-hist', 2) \g /dev/null
SELECT pg_temp.raise('raiser', 'tap-hist', 5) \g /dev/null
SELECT is(pg_temp.history('tap-hist'), ARRAY['3 0 false tap-proxy postgres -', '5 3 false tap-proxy postgres -'],
    'each raise that stores a token is recorded once, with the token before it; equal and lower ones are not');
SELECT is(pg_temp.remote('adm', $$SELECT array_agg(DISTINCT pid)::text FROM fence.history WHERE resource = 'tap-hist'$$),
    ARRAY[pg_temp.remote_pid('raiser')]::text, '... with the raising backend''s pid');
SELECT is(pg_temp.remote('adm', $$SELECT bool_and(raised_at <= clock_timestamp() AND raised_at > clock_timestamp() - interval '10 minutes')::text
                                   FROM fence.history WHERE resource = 'tap-hist'$$), 'true', '... and the time of the raise');

SELECT pg_temp.connect('binder') \g /dev/null
SELECT pg_temp.bind('binder', 'tap-hist', 7) \g /dev/null
SELECT pg_temp.bind('raiser', 'tap-hist', 7) \g /dev/null
SELECT is((pg_temp.history('tap-hist'))[3:], ARRAY['7 5 false - postgres -'], 'a bind that raises is recorded, one bound at the stored token is not');

SELECT pg_temp.remote('adm', $$SELECT fence.reset('tap-hist', 4)::text$$) \g /dev/null
SELECT is((pg_temp.history('tap-hist'))[4:], ARRAY['4 7 true - postgres -'], 'fence.reset is recorded, lowering too');

SELECT pg_temp.remote('adm', $$SELECT generation::text FROM fence.lease_acquire('tap-hist-lease', 'worker-1', '30 seconds')$$) \g /dev/null
SELECT pg_temp.remote('adm', $$SELECT fence.lease_release('tap-hist-lease', 'worker-1', 1)::text$$) \g /dev/null
SELECT pg_temp.remote('adm', $$SELECT generation::text FROM fence.lease_acquire('tap-hist-lease', 'worker-1', '30 seconds')$$) \g /dev/null
SELECT is(pg_temp.history('tap-hist-lease'), ARRAY['1 0 false - postgres worker-1', '2 1 false - postgres worker-1'],
    'each lease acquisition is recorded with its holder');

-- (H1) An insert that fails (here a constraint the owner added) leaves the raise as it was.
SELECT dblink_exec('adm', $$ALTER TABLE fence.history ADD CONSTRAINT tap_refuse CHECK (resource <> 'tap-hist-refused') NOT VALID$$) \g /dev/null
SELECT is(pg_temp.raise('raiser', 'tap-hist-refused', 9), 9::bigint, 'a raise whose history insert fails still raises');
SELECT is(pg_temp.stored('tap-hist-refused'), 9::bigint, '... and its token is stored');
SELECT is(pg_temp.history('tap-hist-refused'), '{}'::text[], '... without a history row');
SELECT is(pg_temp.remote('adm', $$SELECT fence.reset('tap-hist-refused', 11)::text$$), '9', 'a reset whose history insert fails still resets');
SELECT dblink_exec('adm', 'ALTER TABLE fence.history DROP CONSTRAINT tap_refuse') \g /dev/null

-- (H2) What an application role may do with the history.
CREATE ROLE tap_hist_app NOLOGIN;
SET LOCAL ROLE tap_hist_app;
SELECT lives_ok($$SELECT count(*) FROM fence.history$$, 'an application role may read the history');
SELECT throws_ok($$INSERT INTO fence.history (resource, token, reset, raised_at, role, pid) VALUES ('tap-hist', 99, false, now(), 'x', 1)$$,
    '42501', NULL, '... not insert into it');
SELECT throws_ok($$UPDATE fence.history SET token = 1$$, '42501', NULL, '... nor update it');
SELECT throws_ok($$LOCK TABLE fence.history IN SHARE MODE$$, '42501', NULL, '... nor lock it against the raise''s insert');
SELECT throws_ok($$SELECT fence.record_raise('tap-hist', 0, 99, false)$$, '42501', NULL, '... nor call fence.record_raise');
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;
