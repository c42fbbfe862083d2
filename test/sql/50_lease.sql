-- The PostgreSQL lease (migration 5): fence.leases written only through fence.lease_acquire,
-- fence.lease_renew and fence.lease_release, called here as tap_locker (not a superuser, granted
-- EXECUTE on them as the README says for the role of `fenceproxy lock --store postgres`) in
-- autocommit transactions of their own, as `fenceproxy lock` calls them; what the application
-- role tap_lessee (no grant of its own) may not do; and fence.bind's check of lease tokens (L6).
\ir _psql.psql

BEGIN;
SELECT plan(70);
\ir _helpers.psql

CREATE ROLE tap_nobody_lease NOLOGIN;
SELECT pg_temp.store_key() \g /dev/null
SELECT pg_temp.login_role('tap_lessee') \g /dev/null
SELECT pg_temp.login_role('tap_locker') \g /dev/null
SELECT pg_temp.connect('adm') \g /dev/null
SELECT dblink_exec('adm', $$
    GRANT EXECUTE ON FUNCTION fence.lease_acquire(text, text, interval), fence.lease_renew(text, text, bigint, interval),
        fence.lease_release(text, text, bigint) TO tap_locker
$$) \g /dev/null
SELECT dblink_exec('adm', $$
    DELETE FROM fence.leases WHERE resource LIKE 'tap-lease%';
    DELETE FROM fence.tokens WHERE resource LIKE 'tap-lease%';
    DELETE FROM fence.bindings WHERE resource LIKE 'tap-lease%';
$$) \g /dev/null
SELECT pg_temp.connect('a', 'tap_locker') \g /dev/null
SELECT pg_temp.connect('app', 'tap_lessee') \g /dev/null

-- fence.lease_acquire on conn as 'acquired generation holder' (f when refused).
CREATE FUNCTION pg_temp.acquire(conn text, resource text, holder text, ttl text) RETURNS text LANGUAGE sql AS $$
    SELECT r FROM dblink(conn, format('SELECT acquired::text || '' '' || generation || '' '' || coalesce(current_holder, ''-'') FROM fence.lease_acquire(%L, %L, %L)',
                                      resource, holder, ttl)) AS t(r text)
$$;
CREATE FUNCTION pg_temp.renew(conn text, resource text, holder text, generation bigint, ttl text) RETURNS boolean LANGUAGE sql AS $$
    SELECT r FROM dblink(conn, format('SELECT fence.lease_renew(%L, %L, %s, %L)', resource, holder, generation, ttl)) AS t(r boolean)
$$;
CREATE FUNCTION pg_temp.release(conn text, resource text, holder text, generation bigint) RETURNS boolean LANGUAGE sql AS $$
    SELECT r FROM dblink(conn, format('SELECT fence.lease_release(%L, %L, %s)', resource, holder, generation)) AS t(r boolean)
$$;
CREATE FUNCTION pg_temp.lease(resource text) RETURNS text LANGUAGE sql AS $$
    SELECT coalesce(l.holder, '-') || ' ' || l.generation || ' ' || (l.expires_at IS NOT NULL)
    FROM fence.leases AS l WHERE l.resource = lease.resource
$$;

-- The table and who may write it (L5).
SELECT has_table('fence', 'leases', 'fence.leases exists');
SELECT col_is_pk('fence', 'leases', 'resource', 'leases.resource is the primary key');
SELECT col_type_is('fence', 'leases', 'generation', 'bigint', 'leases.generation is bigint');
SELECT col_type_is('fence', 'leases', 'expires_at', 'timestamp with time zone', 'leases.expires_at is timestamptz');
SELECT table_privs_are('fence', 'leases', 'tap_nobody_lease', ARRAY['SELECT'], 'PUBLIC may only read fence.leases');
SELECT function_privs_are('fence', 'check_lease_args', ARRAY['text', 'text', 'interval'], 'tap_nobody_lease', ARRAY[]::text[],
    'PUBLIC may not execute fence.check_lease_args');
SELECT function_privs_are('fence', 'lease_acquire', ARRAY['text', 'text', 'interval'], 'tap_nobody_lease', ARRAY[]::text[],
    'PUBLIC may not execute fence.lease_acquire: an acquisition raises the stored token');
SELECT function_privs_are('fence', 'lease_renew', ARRAY['text', 'text', 'bigint', 'interval'], 'tap_nobody_lease', ARRAY[]::text[],
    'PUBLIC may not execute fence.lease_renew');
SELECT function_privs_are('fence', 'lease_release', ARRAY['text', 'text', 'bigint'], 'tap_nobody_lease', ARRAY[]::text[],
    'PUBLIC may not execute fence.lease_release');
SELECT is(array_agg(p.proname::text ORDER BY p.proname), ARRAY['check_lease_args', 'lease_acquire', 'lease_bind', 'lease_release', 'lease_renew'],
    'the lease functions are SECURITY DEFINER with search_path pinned to pg_catalog, pg_temp')
FROM pg_proc AS p WHERE p.pronamespace = 'fence'::regnamespace AND p.prosecdef
  AND p.proconfig = ARRAY['search_path=pg_catalog, pg_temp'] AND (p.proname LIKE 'lease%' OR p.proname = 'check_lease_args');

-- Acquire (L1, L2): the first acquisition is generation 1, admitted at once.
SELECT is(pg_temp.acquire('a', 'tap-lease', 'h1', '10 s'), 'true 1 h1', 'a free lease is acquired with generation 1');
SELECT is(pg_temp.lease('tap-lease'), 'h1 1 true', '... the row shows the holder, the generation and an expiry');
SELECT is(pg_temp.stored('tap-lease'), 1::bigint, '... and the generation is admitted (fence.tokens) in the same transaction');
SELECT cmp_ok((SELECT expires_at FROM fence.leases WHERE resource = 'tap-lease'), '>', clock_timestamp() + interval '9 s',
    '... expiring ttl from now by the server''s clock');
SELECT is(pg_temp.acquire('a', 'tap-lease', 'h2', '10 s'), 'false 1 h1', 'another holder is refused while it is held');
SELECT is(pg_temp.lease('tap-lease'), 'h1 1 true', '... and nothing changes');
-- (L1', migration 8) A lease is won only by winning it: naming its holder takes nothing.
SELECT is(pg_temp.acquire('a', 'tap-lease', 'h1', '10 s'), 'false 1 h1',
    'the lock role naming the current holder does not take its lease (nor a new generation)');
SELECT is(pg_temp.stored('tap-lease'), 1::bigint, '... and nothing is admitted');
SELECT pg_temp.release('a', 'tap-lease', 'h1', 1) \g /dev/null
SELECT is(pg_temp.acquire('a', 'tap-lease', 'h1', '10 s'), 'true 2 h1', 'released, it is won again with the next generation');
SELECT is(pg_temp.stored('tap-lease'), 2::bigint, '... admitted too');

-- Renew (L4): the holder of the current generation only.
SELECT is(pg_temp.renew('a', 'tap-lease', 'h1', 2, '10 s'), true, 'the holder renews its generation');
SELECT is(pg_temp.renew('a', 'tap-lease', 'h1', 1, '10 s'), false, 'an older generation of the same holder does not renew');
SELECT is(pg_temp.renew('a', 'tap-lease', 'h2', 2, '10 s'), false, 'another holder does not renew');
SELECT is(pg_temp.renew('a', 'tap-lease', 'h1', 3, '10 s'), false, 'a generation not issued does not renew');

-- Release (L4): the holder of the current generation only; the generation stays (L2).
SELECT is(pg_temp.release('a', 'tap-lease', 'h2', 2), false, 'another holder does not release');
SELECT is(pg_temp.release('a', 'tap-lease', 'h1', 1), false, 'an older generation does not release');
SELECT is(pg_temp.release('a', 'tap-lease', 'h1', 2), true, 'the holder releases');
SELECT is(pg_temp.lease('tap-lease'), '- 2 false', '... the lease is free and keeps its generation');
SELECT is(pg_temp.release('a', 'tap-lease', 'h1', 2), false, 'a second release does nothing');
SELECT is(pg_temp.renew('a', 'tap-lease', 'h1', 2, '10 s'), false, 'a released lease is not renewed');
SELECT is(pg_temp.acquire('a', 'tap-lease', 'h2', '10 s'), 'true 3 h2', 'a released lease is taken with the next generation');

-- Expiry by the database's clock (L3): renewal refused, takeover allowed, generation + 1.
SELECT is(pg_temp.acquire('a', 'tap-lease-x', 'h1', '1 s'), 'true 1 h1', 'a lease with a 1 s TTL');
SELECT is(pg_temp.renew('a', 'tap-lease-x', 'h1', 1, '1 s'), true, '... is renewed before it expires');
SELECT is(pg_temp.acquire('a', 'tap-lease-x', 'h2', '1 s'), 'false 1 h1', '... and not taken over');
SELECT pg_sleep(1.2) \g /dev/null
SELECT is(pg_temp.renew('a', 'tap-lease-x', 'h1', 1, '1 s'), false, 'once expired it is not renewed, even by its holder');
SELECT is(pg_temp.acquire('a', 'tap-lease-x', 'h2', '10 s'), 'true 2 h2', '... and another holder takes it over with generation 2');
SELECT is(pg_temp.stored('tap-lease-x'), 2::bigint, '... admitted');

-- A resource led through another store before goes on above its admitted token (L2).
SELECT pg_temp.raise('adm', 'tap-lease-c', 34) \g /dev/null
SELECT is(pg_temp.acquire('a', 'tap-lease-c', 'h1', '10 s'), 'true 35 h1', 'the first generation is above the admitted token 34');

-- Malformed arguments.
SELECT throws_ok($$SELECT pg_temp.acquire('a', 'tap-lease', 'h1', '0.5 s')$$, 'ZF004',
    'malformed lease TTL: 00:00:00.5 (a TTL is 1 second to 24 hours, in hours, minutes and seconds)', 'a TTL below 1 s is ZF004');
SELECT throws_ok($$SELECT pg_temp.acquire('a', 'tap-lease', 'h1', '25 hours')$$, 'ZF004', NULL, 'a TTL above 24 h is ZF004 (L5)');
SELECT throws_ok($$SELECT pg_temp.acquire('a', 'tap-lease', 'h1', '1200 mon -35999 days')$$, 'ZF004', NULL,
    'a TTL of months and days that compares equal to a day is ZF004 (it would expire ~525 days later)');
SELECT throws_ok($$SELECT pg_temp.renew('a', 'tap-lease', 'h1', 1, '1200 mon -35999 days')$$, 'ZF004', NULL,
    '... in a renewal too');
SELECT throws_ok($$SELECT pg_temp.renew('a', 'tap-lease', 'h2', 3, '48 hours')$$, 'ZF004', NULL, '... also for a renewal');
SELECT throws_ok($$SELECT pg_temp.acquire('a', 'tap-lease', '', '10 s')$$, 'ZF004', NULL, 'an empty holder is ZF004');
SELECT throws_ok(format('SELECT pg_temp.acquire(%L, %L, %L, %L)', 'a', 'tap-lease', E'h\x1b[2Jx', '10 s'), 'ZF004',
    'malformed lease holder: ''h?[2Jx'' (a holder is 1 to 200 characters, none of them control characters)',
    'a holder with control characters is ZF004 (L7, migration 8), and the message does not echo them');
SELECT throws_ok($$SELECT pg_temp.acquire('a', 'Tap', 'h1', '10 s')$$, 'ZF004', NULL, 'a malformed resource is ZF004');
SELECT dblink_exec('adm', $$INSERT INTO fence.consul_tokens (resource, token, holder) VALUES ('tap-lease-consul', 3, 'consul session x')$$) \g /dev/null
SELECT throws_ok($$SELECT pg_temp.acquire('a', 'tap-lease-consul', 'h1', '10 s')$$, 'ZF004', NULL,
    'no lease on a resource a lock service leads (L8)');
SELECT dblink_exec('adm', $$DELETE FROM fence.consul_tokens WHERE resource = 'tap-lease-consul'$$) \g /dev/null

-- Nobody forges a generation (L5): the application role may not campaign, and no role but the
-- owner may write the table, not even the lock role.
SELECT throws_ok($$SELECT pg_temp.acquire('app', 'tap-lease-free', 'app', '24 hours')$$, '42501',
    'permission denied for function lease_acquire', 'the application role may not acquire a lease (and so raise the token)');
SELECT throws_ok($$SELECT pg_temp.renew('app', 'tap-lease', 'h2', 3, '10 s')$$, '42501', NULL, '... nor renew one');
SELECT throws_ok($$SELECT pg_temp.release('app', 'tap-lease', 'h2', 3)$$, '42501', NULL, '... nor release one');
SELECT throws_ok($$SELECT dblink_exec('app', 'UPDATE fence.leases SET generation = 1000000 WHERE resource = ''tap-lease''')$$,
    '42501', 'permission denied for table leases', 'nor update a generation');
SELECT throws_ok($$SELECT dblink_exec('a', 'UPDATE fence.leases SET generation = 1000000 WHERE resource = ''tap-lease''')$$,
    '42501', 'permission denied for table leases', 'the lock role may not update a generation either');
SELECT throws_ok($$SELECT dblink_exec('a', 'INSERT INTO fence.leases (resource, generation) VALUES (''tap-lease-f'', 1000000)')$$,
    '42501', NULL, 'it may not insert a lease');
SELECT throws_ok($$SELECT dblink_exec('a', 'DELETE FROM fence.leases')$$, '42501', NULL, 'it may not delete leases');
SELECT throws_ok($$SELECT dblink_exec('a', 'TRUNCATE fence.leases')$$, '42501', NULL, 'it may not truncate leases');
SELECT throws_ok($$SELECT dblink_exec('a', 'SELECT fence.check_lease_args(''tap-lease'', ''h'', NULL)')$$, '42501', NULL,
    'it may not call fence.check_lease_args');
SELECT is(pg_temp.lease('tap-lease'), 'h2 3 true', 'the lease is as the functions left it');

-- fence.bind and lease tokens (L6), from sessions of the application role.
SELECT pg_temp.connect('s', 'tap_lessee') \g /dev/null
SELECT throws_ok($$SELECT pg_temp.bind('s', 'tap-lease', 4)$$, 'ZF002',
    'fencing token not issued: resource "tap-lease" token 4 is higher than the lease''s current generation 3',
    'a token above the generation is ZF002');
SELECT is(pg_temp.stored('tap-lease'), 3::bigint, '... and is not raised');
SELECT throws_ok($$SELECT pg_temp.bind('s', 'tap-lease', 1000000)$$, 'ZF002', NULL, '... however high');
SELECT throws_ok($$SELECT pg_temp.bind('s', 'tap-lease', 2)$$, 'ZF001', NULL, 'an older generation is ZF001');
SELECT is(pg_temp.bind('s', 'tap-lease', 3), 3::bigint, 'the current generation of a held lease binds');
SELECT is(pg_temp.binding_of(pg_temp.remote_pid('s')), 'tap-lease 3', '... the session');

-- The holder's lease expires (released here): its token binds no new session (ZF006); a
-- takeover ends the session bound to it before the acquisition commits (L2).
SELECT pg_temp.release('a', 'tap-lease', 'h2', 3) \g /dev/null
SELECT pg_temp.connect('s2', 'tap_lessee') \g /dev/null
SELECT throws_ok($$SELECT pg_temp.bind('s2', 'tap-lease', 3)$$, 'ZF006',
    'fencing lock not held: the lease of resource "tap-lease" (generation 3) expired or was released',
    'the generation of a released lease binds no new session (ZF006)');
SELECT is(pg_temp.remote('s', 'SELECT 1::text'), '1', 'the session bound before goes on until a takeover');
SELECT pg_temp.remote_pid('s') AS s_pid \gset
SELECT is(pg_temp.acquire('a', 'tap-lease', 'h3', '10 s'), 'true 4 h3', 'another holder takes over with generation 4');
SELECT is(pg_temp.alive(:s_pid), false, '... and the session bound to generation 3 was ended before that committed');

-- (L9, migration 9) No generation above the largest bigint: a clear refusal, not an overflow.
SELECT is(pg_temp.remote('adm', $$SELECT coalesce(fence.reset('tap-lease-max', 9223372036854775807)::text, 'none')$$)::text, 'none',
    'the operator stores the largest token for a resource');
SELECT is((pg_temp.error_of(format('SELECT * FROM dblink(%L, %L) AS t(r text)', 'a',
    $$SELECT acquired::text FROM fence.lease_acquire('tap-lease-max', 'h1', '10 s')$$)))[1], 'ZF004',
    'fence.lease_acquire above it: ZF004 (no higher generation exists), not 22003');
SELECT is((SELECT count(*) FROM fence.leases WHERE resource = 'tap-lease-max' AND holder IS NOT NULL), 0::bigint,
    '... and no lease is held');

SELECT dblink_exec('adm', $$
    DELETE FROM fence.leases WHERE resource LIKE 'tap-lease%';
    DELETE FROM fence.tokens WHERE resource LIKE 'tap-lease%';
    DELETE FROM fence.bindings WHERE resource LIKE 'tap-lease%';
$$) \g /dev/null
SELECT dblink_exec('adm', $$
    REVOKE EXECUTE ON FUNCTION fence.lease_acquire(text, text, interval), fence.lease_renew(text, text, bigint, interval),
        fence.lease_release(text, text, bigint) FROM tap_locker
$$) \g /dev/null
SELECT dblink_disconnect(c) FROM unnest(dblink_get_connections()) AS c \g /dev/null
SELECT pg_temp.drop_login_role('tap_lessee') \g /dev/null
SELECT pg_temp.drop_login_role('tap_locker') \g /dev/null
SELECT * FROM finish();
ROLLBACK;
