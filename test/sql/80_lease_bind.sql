-- fence.lease_bind (migration 10, L10): the bind of a resource declared as led through the
-- PostgreSQL lease (--lease-resource). Called as the application role tap_lb_app through dblink
-- with the proxy's proof, as the proxy calls it: no token is bound or stored before the
-- resource's lease exists; afterwards it binds as fence.bind does (L6 included) and names the
-- lease's holder.
\ir _psql.psql

BEGIN;
SELECT plan(10);
\ir _helpers.psql

CREATE ROLE tap_nobody_lb NOLOGIN;
SELECT pg_temp.store_key() \g /dev/null
SELECT pg_temp.login_role('tap_lb_app') \g /dev/null
SELECT pg_temp.connect('adm') \g /dev/null
SELECT dblink_exec('adm', $$
    DELETE FROM fence.leases WHERE resource LIKE 'tap-lb%';
    DELETE FROM fence.tokens WHERE resource LIKE 'tap-lb%';
    DELETE FROM fence.bindings WHERE resource LIKE 'tap-lb%';
$$) \g /dev/null

-- The SQL of fence.lease_bind on conn with a valid proof (fence.bind's: kind 'bind').
CREATE FUNCTION pg_temp.lease_bind_sql(conn text, resource text, token bigint) RETURNS text LANGUAGE sql AS $$
    SELECT format('SELECT coalesce(holder, ''-'') || '' '' || stored FROM fence.lease_bind(%L, %L, %L)',
                  resource, token, pg_temp.proof('bind', resource, token, conn))
$$;
CREATE FUNCTION pg_temp.lease_bind(conn text, resource text, token bigint) RETURNS text LANGUAGE sql AS $$
    SELECT x FROM pg_temp.remote(conn, pg_temp.lease_bind_sql(conn, resource, token)) AS x
$$;

SELECT has_function('fence', 'lease_bind', ARRAY['text', 'bigint', 'text'], 'fence.lease_bind exists');
SELECT function_privs_are('fence', 'lease_bind', ARRAY['text', 'bigint', 'text'], 'tap_nobody_lb', ARRAY['EXECUTE'],
    'PUBLIC may execute fence.lease_bind, like fence.bind: it only refuses more (L10)');
SELECT is((SELECT p.prosecdef AND p.proconfig = ARRAY['search_path=pg_catalog, pg_temp'] FROM pg_proc AS p
           WHERE p.oid = 'fence.lease_bind(text, bigint, text)'::regprocedure), true,
    'fence.lease_bind is SECURITY DEFINER with search_path pinned to pg_catalog, pg_temp');

-- (L10) Before the lease exists: refused, nothing stored or bound, whatever the token.
SELECT pg_temp.connect('app', 'tap_lb_app') \g /dev/null
SELECT is((pg_temp.error_of(format('SELECT * FROM dblink(%L, %L) AS t(x text)', 'app',
                                   pg_temp.lease_bind_sql('app', 'tap-lb', 9223372036854775807))))[1:2],
    ARRAY['ZF006', 'fencing lease missing: resource "tap-lb" is led through the PostgreSQL lease, but no lease was ever acquired for it in this database; token 9223372036854775807 is not admitted'],
    'a lease resource without a lease row refuses even the largest token (ZF006)');
SELECT ok((pg_temp.error_of(format('SELECT * FROM dblink(%L, %L) AS t(x text)', 'app',
                                   pg_temp.lease_bind_sql('app', 'tap-lb', 1))))[4] LIKE '%fenceproxy lock --store postgres --resource tap-lb%',
    '... and its hint says to create the lease with fenceproxy lock --store postgres');
SELECT is(pg_temp.stored('tap-lb'), NULL, '... and no token is stored');
SELECT is(pg_temp.binding_of(pg_temp.remote_pid('app')), NULL, '... nor the backend bound');

-- With the lease: its generation binds, naming the holder; a higher token is refused (L6).
SELECT pg_temp.remote('adm', $$ SELECT generation::text FROM fence.lease_acquire('tap-lb', 'tap-holder', '60 s') $$) \g /dev/null
SELECT is(pg_temp.lease_bind('app', 'tap-lb', 1), 'tap-holder 1', 'the lease''s generation binds, with the lease''s holder');
SELECT pg_temp.connect('app2', 'tap_lb_app') \g /dev/null
SELECT is((pg_temp.error_of(format('SELECT * FROM dblink(%L, %L) AS t(x text)', 'app2',
                                   pg_temp.lease_bind_sql('app2', 'tap-lb', 2))))[1], 'ZF002',
    'a token above the lease''s generation is refused (ZF002, L6)');
SELECT is((pg_temp.error_of(format('SELECT * FROM dblink(%L, %L) AS t(x text)', 'app2',
                                   pg_temp.call_sql('bind', 'tap-lb', 1, 'forged'))))[1], 'ZF010',
    'without the proxy''s proof nothing binds (ZF010, P5)');

SELECT dblink_exec('adm', $$
    DELETE FROM fence.leases WHERE resource LIKE 'tap-lb%';
    DELETE FROM fence.tokens WHERE resource LIKE 'tap-lb%';
    DELETE FROM fence.bindings WHERE resource LIKE 'tap-lb%';
$$) \g /dev/null
SELECT dblink_disconnect(c) FROM unnest(dblink_get_connections()) AS c \g /dev/null
SELECT pg_temp.drop_login_role('tap_lb_app') \g /dev/null
SELECT * FROM finish();
ROLLBACK;
