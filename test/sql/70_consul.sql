-- Consul's record (migration 7): fence.consul_tokens written only through fence.consul_admit and
-- fence.consul_regress, called on dblink connections as the proxy calls them (autocommit, with the
-- proof of the calling backend), as an application role with no grant of its own (tap_consul);
-- and fence.reset as the one way out. C1-C4 are the proof obligations of the migration.
\ir _psql.psql

BEGIN;
SELECT plan(44);
\ir _helpers.psql

CREATE ROLE tap_nobody_consul NOLOGIN;
SELECT pg_temp.store_key() \g /dev/null
SELECT pg_temp.login_role('tap_consul') \g /dev/null
SELECT dblink_exec(pg_temp.connstr('postgres'), $$
    DELETE FROM fence.consul_tokens WHERE resource LIKE 'tap-consul%';
    DELETE FROM fence.tokens WHERE resource LIKE 'tap-consul%';
$$) \g /dev/null
SELECT pg_temp.connect('p1', 'tap_consul') \g /dev/null
SELECT pg_temp.connect('p2', 'tap_consul') \g /dev/null

-- fence.consul_admit on conn with a valid proof, as 'recorded holder regression?'.
CREATE FUNCTION pg_temp.admit(conn text, resource text, token bigint, holder text) RETURNS text LANGUAGE sql AS $$
    SELECT r FROM dblink(conn, format('SELECT recorded || '' '' || recorded_holder || '' '' || (regression IS NOT NULL) FROM fence.consul_admit(%L, %s, %L, %L)',
                                      resource, token, holder, pg_temp.proof('consul', resource, token, conn))) AS t(r text)
$$;
CREATE FUNCTION pg_temp.regress(conn text, resource text, token bigint, reason text) RETURNS text LANGUAGE sql AS $$
    SELECT r FROM dblink(conn, format('SELECT fence.consul_regress(%L, %s, %L, %L)',
                                      resource, token, reason, pg_temp.proof('consul', resource, token, conn))) AS t(r text)
$$;
CREATE FUNCTION pg_temp.regression_of(resource text) RETURNS text LANGUAGE sql AS $$
    SELECT r FROM dblink(pg_temp.connstr('postgres'), format('SELECT regression FROM fence.consul_tokens WHERE resource = %L', resource)) AS t(r text)
$$;

-- The table and who may write it (C4).
SELECT has_table('fence', 'consul_tokens', 'fence.consul_tokens exists');
SELECT col_is_pk('fence', 'consul_tokens', 'resource', 'consul_tokens.resource is the primary key');
SELECT table_privs_are('fence', 'consul_tokens', 'tap_nobody_consul', ARRAY['SELECT'], 'PUBLIC may only read fence.consul_tokens');
SELECT is(array_agg(p.proname::text ORDER BY p.proname), ARRAY['consul_admit', 'consul_depose', 'consul_regress'],
    'the Consul functions are SECURITY DEFINER with search_path pinned to pg_catalog, pg_temp')
FROM pg_proc AS p
WHERE p.pronamespace = 'fence'::regnamespace AND p.proname LIKE 'consul%' AND p.prosecdef
  AND p.proconfig = ARRAY['search_path=pg_catalog, pg_temp'];
SELECT isnt(obj_description('fence.consul_tokens'::regclass, 'pg_class'), NULL, 'fence.consul_tokens is documented');

-- Only the proxy writes (C4): no proof, or another backend's proof, is ZF010.
SELECT is((pg_temp.error_of(format('SELECT * FROM dblink(%L, %L) AS t(a bigint, b text, c text)', 'p1',
    'SELECT * FROM fence.consul_admit(''tap-consul'', 5, ''s1'', ''nope'')')))[1], 'ZF010',
    'fence.consul_admit without the proxy''s proof: ZF010');
SELECT is((pg_temp.error_of(format('SELECT * FROM dblink(%L, %L) AS t(r text)', 'p1',
    format('SELECT fence.consul_regress(''tap-consul'', 5, ''x'', %L)', pg_temp.proof('consul', 'tap-consul', 5, 'p2')))))[1], 'ZF010',
    'fence.consul_regress with another backend''s proof: ZF010');
SELECT is(pg_temp.regression_of('tap-consul'), NULL, 'nothing recorded by refused calls');
SELECT is((pg_temp.error_of(format('SELECT * FROM dblink(%L, %L) AS t(a bigint, b text, c text)', 'p1',
    format('SELECT * FROM fence.consul_admit(''tap-consul'', 5, '''', %L)', pg_temp.proof('consul', 'tap-consul', 5, 'p1')))))[1], 'ZF004',
    'fence.consul_admit without a holder: ZF004');

-- Admissions and the growing record (C3).
SELECT is(pg_temp.admit('p1', 'tap-consul', 5, 's1'), '5 s1 false', 'first admission recorded with its holder');
SELECT is(pg_temp.admit('p2', 'tap-consul', 5, 's1'), '5 s1 false', 'the same token and holder again, through another proxy: admitted');
SELECT is(pg_temp.admit('p2', 'tap-consul', 7, 's2'), '7 s2 false', 'a higher token is recorded');
SELECT is(pg_temp.admit('p1', 'tap-consul', 6, 's9'), '7 s2 false',
    'a lower token (an older hand-over reported late) changes nothing and is no regression: the proxy asks Consul');
SELECT is(pg_temp.regression_of('tap-consul'), NULL, 'no regression recorded so far');

-- One token, one holder (C2).
SELECT is(pg_temp.admit('p1', 'tap-consul', 7, 's3'), '7 s2 true', 'the recorded token with another holder: a regression');
SELECT matches(pg_temp.regression_of('tap-consul'), 'token 7 was admitted for consul session s2 and is now held by consul session s3: Consul issued',
    'the regression names both holders');

-- Never forgotten (C1): every later admission answers with it, the first reason stays.
SELECT is(pg_temp.admit('p2', 'tap-consul', 7, 's2'), '7 s2 true', 'the first holder is refused too');
SELECT is(pg_temp.admit('p2', 'tap-consul', 8, 's4'), '7 s2 true', 'a higher token does not clear it, nor is it recorded');
SELECT matches(pg_temp.regress('p1', 'tap-consul', 8, 'another reason'), 'token 7 was admitted',
    'fence.consul_regress keeps the first reason');
SELECT pg_temp.connect('p1', 'tap_consul') \g /dev/null
SELECT is(pg_temp.admit('p1', 'tap-consul', 8, 's4'), '7 s2 true', 'a new connection (a restarted proxy) still gets it');

-- A regression recorded directly (a proxy's watch saw the token go back).
SELECT is(pg_temp.regress('p1', 'tap-consul-b', 3, 'LockIndex went from 3 to 0'), 'LockIndex went from 3 to 0',
    'fence.consul_regress records a regression for a resource without a row');
SELECT is(pg_temp.admit('p2', 'tap-consul-b', 3, 's1'), '0  true', 'and admissions answer with it');

-- (C5, migration 8) A second holder of the recorded token deposes the first: the backends
-- bound to that token (or a lower one) are ended before the regression commits.
SELECT function_privs_are('fence', 'consul_depose', ARRAY['text', 'bigint'], 'tap_nobody_consul', ARRAY[]::text[],
    'PUBLIC may not execute fence.consul_depose');
SELECT is(pg_temp.admit('p1', 'tap-consul-c', 4, 's1'), '4 s1 false', 'token 4 admitted for s1');
SELECT pg_temp.connect('s1a', 'tap_consul') \g /dev/null
SELECT is(pg_temp.bind('s1a', 'tap-consul-c', 4), 4::bigint, '... and a session of s1 bound to it');
SELECT pg_temp.remote_pid('s1a') AS s1a_pid \gset
SELECT is(pg_temp.admit('p2', 'tap-consul-c', 4, 's1'), '4 s1 false', 'the recorded holder again: admitted (the shared path)');
SELECT is(pg_temp.admit('p2', 'tap-consul-c', 4, 's2'), '4 s1 true', 'token 4 now shown held by s2: a regression');
SELECT is(pg_temp.alive(:s1a_pid), false, '... and the session bound to token 4 was ended before it committed');
SELECT is((SELECT holder FROM fence.history WHERE resource = 'tap-consul-c' ORDER BY id DESC LIMIT 1),
    'consul session s1', 'the history names the Consul session a raise admitted (migration 8)');

-- (W1, migration 9) Each service's holders in its own words: the etcd and ZooKeeper guards
-- record "etcd lease <id>" and "zookeeper session <id>".
SELECT is(pg_temp.admit('p1', 'tap-consul-e', 9, 'etcd lease 1a'), '9 etcd lease 1a false', 'token 9 admitted for an etcd lease');
SELECT is(pg_temp.admit('p2', 'tap-consul-e', 9, 'etcd lease 2b'), '9 etcd lease 1a true', 'token 9 now held by another lease: a regression');
SELECT is(pg_temp.regression_of('tap-consul-e'),
    'token 9 was admitted for etcd lease 1a and is now held by etcd lease 2b: etcd issued the number twice (its sequence went back and came up again)',
    'an etcd regression speaks of etcd''s leases, not of Consul');
SELECT is(pg_temp.admit('p1', 'tap-consul-z', 4, 'zookeeper session 7'), '4 zookeeper session 7 false', 'token 4 admitted for a ZooKeeper session');
SELECT pg_temp.connect('z1', 'tap_consul') \g /dev/null
SELECT pg_temp.bind('z1', 'tap-consul-z', 4) \g /dev/null
SELECT is((SELECT holder FROM fence.history WHERE resource = 'tap-consul-z' ORDER BY id DESC LIMIT 1),
    'zookeeper session 7', 'the history names a ZooKeeper holder as the guard recorded it, not as a Consul session');

-- fence.reset is the way out (not granted to PUBLIC).
SELECT function_privs_are('fence', 'reset', ARRAY['text', 'bigint'], 'tap_nobody_consul', ARRAY[]::text[],
    'PUBLIC may not execute fence.reset');
SELECT is(pg_temp.remote(pg_temp.connstr('postgres'), $$SELECT fence.reset('tap-consul', 8)::text$$)::text, '0',
    'fence.reset of the resource (no token stored before: 0, the row the deposition locked)');
SELECT is(pg_temp.regression_of('tap-consul'), NULL, 'fence.reset forgets the Consul row');
SELECT is(pg_temp.admit('p1', 'tap-consul', 8, 's4'), '8 s4 false', 'after the reset, the current holder is admitted');

-- (L12) A lock service's token on a resource with a PostgreSQL lease row is refused up front
-- (a leftover lease of an earlier trial made a newcomer's Consul resource fail with ZF002 and a
-- lease hint), held or not, until the schema's owner deletes the row; fence.reset keeps it
-- (forgetting it let a lowering reset issue its generations again: a review's F2).
SELECT dblink_exec(pg_temp.connstr('postgres'), $$
    INSERT INTO fence.leases (resource, generation) VALUES ('tap-consul-lease', 3);
    INSERT INTO fence.leases (resource, holder, generation, expires_at) VALUES ('tap-consul-held', 'h', 4, now() + interval '1 hour');
$$) \g /dev/null
SELECT throws_ok($$SELECT pg_temp.admit('p1', 'tap-consul-lease', 9, 's5')$$, 'ZF004',
    'fencing lock service refused: resource "tap-consul-lease" is led through the PostgreSQL lease (fence.leases has its row: generation 3, not held now)',
    'a lock service''s token on a resource with a lease row is ZF004, naming the lease (L12)');
SELECT throws_ok($$SELECT pg_temp.admit('p1', 'tap-consul-held', 9, 's5')$$, 'ZF004', NULL, '... also one held now (L12)');
SELECT is(pg_temp.remote(pg_temp.connstr('postgres'), $$SELECT fence.reset('tap-consul-lease', 9)::text$$)::text, NULL,
    'fence.reset of the resource with a lease that is not held');
SELECT throws_ok($$SELECT pg_temp.admit('p1', 'tap-consul-lease', 9, 's5')$$, 'ZF004', NULL, 'fence.reset keeps the lease row (L12)');
SELECT dblink_exec(pg_temp.connstr('postgres'), $$DELETE FROM fence.leases WHERE resource = 'tap-consul-lease'$$) \g /dev/null
SELECT is(pg_temp.admit('p1', 'tap-consul-lease', 9, 's5'), '9 s5 false', 'once the owner deleted the row, the lock service''s token is admitted (L12)');
SELECT is(pg_temp.remote(pg_temp.connstr('postgres'), $$SELECT count(*)::text FROM fence.leases WHERE resource = 'tap-consul-held'$$)::text, '1',
    'a held lease stays whatever happens to the lock service''s tokens');
SELECT dblink_exec(pg_temp.connstr('postgres'), $$DELETE FROM fence.leases WHERE resource LIKE 'tap-consul%'$$) \g /dev/null

SELECT dblink_exec(pg_temp.connstr('postgres'), $$
    DELETE FROM fence.consul_tokens WHERE resource LIKE 'tap-consul%';
    DELETE FROM fence.tokens WHERE resource LIKE 'tap-consul%';
    DELETE FROM fence.bindings WHERE resource LIKE 'tap-consul%';
    DELETE FROM fence.history WHERE resource LIKE 'tap-consul%';
$$) \g /dev/null
SELECT * FROM finish();
ROLLBACK;
