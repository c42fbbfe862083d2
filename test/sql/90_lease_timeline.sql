-- The lease's generations carry the timeline (schema version 11, L11): on timeline T an
-- acquisition issues a generation in ((T-1) * 2^32, T * 2^32), so a standby promoted from this
-- primary (a later timeline) issues only generations above every one this primary issued, even
-- those its asynchronous replication lost. This cluster is never promoted: it writes on timeline
-- 1, whose range is 1 to 4294967295. The promotion itself is tested with a real standby by
-- TestFailoverLeaseAsyncStandbyIssuesNoGenerationTwice (internal/proxy/failover_test.go).
\ir _psql.psql

BEGIN;
SELECT plan(9);
\ir _helpers.psql

SELECT pg_temp.login_role('tap_tl_locker') \g /dev/null
SELECT pg_temp.connect('adm') \g /dev/null
SELECT dblink_exec('adm', $$
    GRANT EXECUTE ON FUNCTION fence.lease_acquire(text, text, interval), fence.lease_renew(text, text, bigint, interval),
        fence.lease_release(text, text, bigint) TO tap_tl_locker;
    DELETE FROM fence.leases WHERE resource LIKE 'tap-tl%';
    DELETE FROM fence.tokens WHERE resource LIKE 'tap-tl%';
    DELETE FROM fence.bindings WHERE resource LIKE 'tap-tl%';
$$) \g /dev/null
SELECT pg_temp.connect('a', 'tap_tl_locker') \g /dev/null

-- fence.lease_acquire on conn as 'acquired generation holder'.
CREATE FUNCTION pg_temp.acquire_tl(conn text, resource text, holder text) RETURNS text LANGUAGE sql AS $$
    SELECT r FROM dblink(conn, format('SELECT acquired::text || '' '' || generation || '' '' || coalesce(current_holder, ''-'') FROM fence.lease_acquire(%L, %L, ''60 s'')',
                                      resource, holder)) AS t(r text)
$$;
CREATE FUNCTION pg_temp.acquire_tl_error(conn text, resource text, holder text) RETURNS text[] LANGUAGE sql AS $$
    SELECT pg_temp.error_of(format('SELECT * FROM dblink(%L, %L) AS t(r text)', conn,
        format('SELECT generation::text FROM fence.lease_acquire(%L, %L, ''60 s'')', resource, holder)))
$$;

SELECT is(substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8), '00000001', 'this cluster writes on timeline 1');

-- (L11) Timeline 1's range starts where the lease always started: generation 1.
SELECT is(pg_temp.acquire_tl('a', 'tap-tl', 'h1'), 'true 1 h1',
    'the first generation on timeline 1 is 1 (L11: timeline 1''s range starts at 1)');

-- (L11) The last generation of timeline 1 is 4294967295; one more would be in the range of the
-- timeline a promoted standby writes on, where it could be issued a second time.
SELECT dblink_exec('adm', $$
    UPDATE fence.leases SET holder = NULL, expires_at = NULL, generation = 4294967294 WHERE resource = 'tap-tl'
$$) \g /dev/null
SELECT is(pg_temp.acquire_tl('a', 'tap-tl', 'h2'), 'true 4294967295 h2',
    'generation 4294967295, the last of timeline 1, is issued (L11)');
SELECT is(pg_temp.remote('a', $$SELECT fence.lease_release('tap-tl', 'h2', 4294967295)::text$$), 'true', '... and released');
SELECT is((pg_temp.acquire_tl_error('a', 'tap-tl', 'h3'))[1:2],
    ARRAY['ZF004', 'fencing lease refused: resource "tap-tl" would get generation 4294967296, beyond 4294967295, the last generation of timeline 1 (a generation above it could be issued again by a standby promoted from this primary)'],
    'an acquisition beyond timeline 1''s range is refused (ZF004, L11)');
SELECT is((SELECT holder IS NULL AND generation = 4294967295 FROM fence.leases WHERE resource = 'tap-tl'), true,
    '... and rolls back: the lease stays free at generation 4294967295');
SELECT is(pg_temp.stored('tap-tl'), 4294967295::bigint, '... and the stored token is not raised');

-- (L11) A token stored above the range (a bare token before the lease) refuses the lease too.
SELECT pg_temp.remote('adm', $$SELECT coalesce(fence.reset('tap-tl-bare', 5000000000)::text, 'none')$$) \g /dev/null
SELECT is((pg_temp.acquire_tl_error('a', 'tap-tl-bare', 'h1'))[1], 'ZF004',
    'a resource whose stored token is above timeline 1''s range gets no lease there (ZF004, L11)');
SELECT is((SELECT count(*) FROM fence.leases WHERE resource = 'tap-tl-bare'), 0::bigint,
    '... and no lease row is committed');

SELECT dblink_exec('adm', $$
    DELETE FROM fence.leases WHERE resource LIKE 'tap-tl%';
    DELETE FROM fence.tokens WHERE resource LIKE 'tap-tl%';
    DELETE FROM fence.history WHERE resource LIKE 'tap-tl%';
    REVOKE EXECUTE ON FUNCTION fence.lease_acquire(text, text, interval), fence.lease_renew(text, text, bigint, interval),
        fence.lease_release(text, text, bigint) FROM tap_tl_locker;
$$) \g /dev/null
SELECT dblink_disconnect(c) FROM unnest(dblink_get_connections()) AS c \g /dev/null
SELECT pg_temp.drop_login_role('tap_tl_locker') \g /dev/null
SELECT * FROM finish();
ROLLBACK;
