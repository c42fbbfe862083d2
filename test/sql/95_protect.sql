-- fence.protect: rows fenced by their partition's token (R1-R5). A table of charges, owned by
-- tap_owner and written by sessions of tap_writer (neither a superuser) bound as the proxy
-- binds them: the rows of resource tap-billing-3 by a session bound to it, the other
-- partition's refused, a lower token refused, a stale writer ended by the raise before its
-- row can commit.
\ir _psql.psql

BEGIN;
SELECT plan(69);
\ir _helpers.psql

SELECT pg_temp.store_key() \g /dev/null
SELECT pg_temp.login_role('tap_owner') \g /dev/null
SELECT pg_temp.login_role('tap_writer') \g /dev/null
SELECT pg_temp.connect('adm') \g /dev/null
SELECT dblink_exec('adm', $$
    DELETE FROM fence.tokens WHERE resource LIKE 'tap-billing%';
    DELETE FROM fence.bindings WHERE resource LIKE 'tap-billing%';
    DROP TABLE IF EXISTS public.tap_charges, public.tap_parted;
    DROP SCHEMA IF EXISTS tap_evil CASCADE;
    DROP ROLE IF EXISTS tap_other;
    GRANT CREATE ON SCHEMA public TO tap_owner;
$$) \g /dev/null
SELECT pg_temp.connect('own', 'tap_owner') \g /dev/null
SELECT dblink_exec('own', $$
    CREATE TABLE public.tap_charges (id int PRIMARY KEY, shard int NOT NULL, amount int NOT NULL);
    GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON public.tap_charges TO tap_writer;
    INSERT INTO public.tap_charges VALUES (100, 7, 1);
$$) \g /dev/null

-- The declaration, by the owner in a session without a token.
SELECT throws_ok($$SELECT pg_temp.remote('own', $q$SELECT fence.protect('public.tap_charges', $e$'tap-billing-' || random()::text$e$)$q$)$$,
    'ZF004', NULL, '(R5) an expression that is not over the row''s columns with immutable functions is ZF004');
SELECT throws_ok($$SELECT pg_temp.remote('own', $q$SELECT fence.protect('public.tap_charges', $e$'tap-billing-' || fence_token$e$)$q$)$$,
    'ZF004', NULL, '(R5) ... and so is one of fence_token');
SELECT throws_ok($$SELECT pg_temp.remote('own', $q$SELECT fence.protect('public.tap_charges', $e$'tap-billing-' || nosuchcolumn$e$)$q$)$$,
    'ZF004', NULL, '(R5) ... and one of a column the table does not have');
SELECT pg_temp.connect('w', 'tap_writer') \g /dev/null
SELECT dblink_exec('own', 'ALTER TABLE public.tap_charges ADD COLUMN shard2 int GENERATED ALWAYS AS (shard) STORED') \g /dev/null
SELECT throws_ok($$SELECT pg_temp.remote('own', $q$SELECT fence.protect('public.tap_charges', $e$'tap-billing-' || shard2$e$)$q$)$$,
    'ZF004', NULL, '(R5) ... and one of a generated column, which BEFORE triggers see before it is computed');
SELECT dblink_exec('own', 'ALTER TABLE public.tap_charges DROP COLUMN shard2') \g /dev/null
SELECT throws_ok($$SELECT pg_temp.remote('w', $q$SELECT fence.protect('public.tap_charges', $e$'tap-billing-' || shard$e$)$q$)$$,
    '42501', NULL, 'only the table''s owner protects it');
SELECT lives_ok($$SELECT pg_temp.remote('own', $q$SELECT fence.protect('public.tap_charges', $e$'tap-billing-' || shard$e$)$q$)$$,
    'the owner protects the table');
SELECT is((SELECT format_type(atttypid, atttypmod) || ' ' || attnotnull FROM pg_attribute
           WHERE attrelid = 'public.tap_charges'::regclass AND attname = 'fence_token'), 'bigint true',
    'fence.protect adds fence_token bigint NOT NULL');
SELECT is(pg_temp.remote('adm', 'SELECT fence_token::text FROM public.tap_charges WHERE id = 100'), '0', '... 0 in the rows written before');
SELECT is((SELECT array_agg(tgname || ' ' || tgenabled::text ORDER BY tgname) FROM pg_trigger WHERE tgrelid = 'public.tap_charges'::regclass),
    ARRAY['zz_fence_protect A', 'zz_fence_protect_truncate A'],
    '(R1, R4) its triggers fire always, also under session_replication_role = replica');
SELECT lives_ok($$SELECT pg_temp.remote('own', $q$SELECT fence.protect('public.tap_charges', $e$'tap-billing-' || shard$e$)$q$)$$,
    'fence.protect again replaces the declaration');

-- A session that is not fenced (R4).
SELECT throws_ok($$SELECT dblink_exec('w', 'INSERT INTO public.tap_charges VALUES (1, 3, 10)')$$, 'ZF003',
    'fencing token missing: public.tap_charges is a protected table (fence.protect) and this session is not fenced',
    '(R4) a session without a token is refused: ZF003');
SELECT throws_ok($$SELECT dblink_exec('own', 'DELETE FROM public.tap_charges')$$, 'ZF003', NULL,
    '(R4) ... the table''s owner too');
SELECT throws_ok($$SELECT dblink_exec('adm', 'DELETE FROM public.tap_charges')$$, 'ZF003', NULL,
    '(R4) ... and a superuser');
SELECT throws_ok($$SELECT dblink_exec('adm', 'SET session_replication_role = replica; DELETE FROM public.tap_charges')$$, 'ZF003', NULL,
    '(R1) ... also under session_replication_role = replica');
SELECT dblink_exec('adm', 'RESET session_replication_role') \g /dev/null
SELECT throws_ok($$SELECT dblink_exec('w', 'TRUNCATE public.tap_charges')$$, 'ZF003', NULL, '(R4) ... TRUNCATE too');

-- A leftover binding of an exited backend whose pid this session has now (R1).
SELECT dblink_exec('adm', format($q$INSERT INTO fence.bindings (pid, backend_start, resource, token)
    VALUES (%s, '2000-01-01', 'tap-billing-3', 5)$q$, pg_temp.remote_pid('w'))) \g /dev/null
SELECT throws_ok($$SELECT dblink_exec('w', 'INSERT INTO public.tap_charges VALUES (1, 3, 10)')$$, 'ZF003', NULL,
    '(R1) a leftover binding with this session''s pid and another backend_start does not count');
SELECT dblink_exec('adm', format('DELETE FROM fence.bindings WHERE pid = %s', pg_temp.remote_pid('w'))) \g /dev/null

-- Sessions bound to tap-billing-3 (token 5) and tap-billing-7 (token 2).
SELECT pg_temp.connect('s3', 'tap_writer') \g /dev/null
SELECT pg_temp.connect('s7', 'tap_writer') \g /dev/null
SELECT pg_temp.bind('s3', 'tap-billing-3', 5) \g /dev/null
SELECT pg_temp.bind('s7', 'tap-billing-7', 2) \g /dev/null
SELECT is(pg_temp.remote('s3', 'SELECT resource || '' '' || token FROM fence.session_bindings()'), 'tap-billing-3 5',
    '(R1) fence.session_bindings says what the session is bound to');
SELECT is(pg_temp.remote('w', 'SELECT count(*)::text FROM fence.session_bindings()'), '0', '(R1) ... nothing when it is not fenced');

SELECT lives_ok($$SELECT dblink_exec('s3', 'INSERT INTO public.tap_charges VALUES (1, 3, 10)')$$,
    '(R1) a session bound to tap-billing-3 inserts a row of tap-billing-3');
SELECT is(pg_temp.remote('adm', 'SELECT fence_token::text FROM public.tap_charges WHERE id = 1'), '5', '(R2) ... stamped with its token');
SELECT lives_ok($$SELECT dblink_exec('s3', 'INSERT INTO public.tap_charges (id, shard, amount, fence_token) VALUES (2, 3, 10, 99)')$$,
    '(R2) a row whose writer sets fence_token');
SELECT is(pg_temp.remote('adm', 'SELECT fence_token::text FROM public.tap_charges WHERE id = 2'), '5', '(R2) ... gets the session''s token all the same');
SELECT lives_ok($$SELECT dblink_exec('s3', 'UPDATE public.tap_charges SET amount = 11, fence_token = 1 WHERE id = 1')$$,
    '(R1) ... updates its rows');
SELECT is(pg_temp.remote('adm', $q$SELECT amount || ' ' || fence_token FROM public.tap_charges WHERE id = 1$q$), '11 5', '(R2) ... stamped again');
SELECT lives_ok($$SELECT dblink_exec('s7', 'UPDATE public.tap_charges SET amount = 2 WHERE id = 100')$$,
    '(R1) a session bound to tap-billing-7 updates a row of tap-billing-7 written before the protection');

SELECT throws_ok($$SELECT dblink_exec('s3', 'INSERT INTO public.tap_charges VALUES (3, 7, 10)')$$, 'ZF012',
    'fencing resource not bound: a row of public.tap_charges belongs to resource "tap-billing-7" (''tap-billing-'' || shard), and this session is bound to resource "tap-billing-3" token 5',
    '(R1) a row of tap-billing-7 from the session of tap-billing-3 is ZF012');
SELECT is((pg_temp.error_of($$SELECT dblink_exec('s3', 'INSERT INTO public.tap_charges VALUES (3, 7, 10)')$$))[4],
    'Write the rows of resource "tap-billing-7" in a session bound to it: connect with fence.resource=tap-billing-7 and the fence.token of its lock.',
    '(R1) ... saying what to do');
SELECT throws_ok($$SELECT dblink_exec('s3', 'INSERT INTO public.tap_charges SELECT g, 3 + 4 * (g % 2), 1 FROM generate_series(10, 13) AS g')$$,
    'ZF012', NULL, '(R1) ... also among rows of its own in one statement');
SELECT throws_ok($$SELECT dblink_exec('s3', 'UPDATE public.tap_charges SET amount = 0 WHERE id = 100')$$, 'ZF012', NULL,
    '(R1) an UPDATE of tap-billing-7''s row is ZF012');
SELECT throws_ok($$SELECT dblink_exec('s3', 'DELETE FROM public.tap_charges WHERE id = 100')$$, 'ZF012', NULL,
    '(R1) ... a DELETE');
SELECT throws_ok($$SELECT dblink_exec('s3', 'INSERT INTO public.tap_charges VALUES (100, 3, 5) ON CONFLICT (id) DO UPDATE SET amount = 0')$$,
    'ZF012', NULL, '(R1) ... an INSERT ON CONFLICT DO UPDATE of it');
SELECT throws_ok($$SELECT dblink_exec('s3', 'MERGE INTO public.tap_charges AS c USING (VALUES (100, 0), (8, 0)) AS v(id, amount) ON c.id = v.id
        WHEN MATCHED THEN UPDATE SET amount = v.amount WHEN NOT MATCHED THEN INSERT VALUES (v.id, 3, v.amount)')$$,
    'ZF012', NULL, '(R1) ... a MERGE that updates it');
SELECT throws_ok($$SELECT dblink_exec('s3', 'UPDATE public.tap_charges SET shard = 7 WHERE id = 1')$$, 'ZF012', NULL,
    '(R1) ... an UPDATE that moves a row of its own to tap-billing-7');
SELECT throws_ok($$SELECT dblink_exec('s7', 'UPDATE public.tap_charges SET shard = 7 WHERE id = 1')$$, 'ZF012', NULL,
    '(R1) ... and one that moves tap-billing-3''s row to the writer''s own');
SELECT throws_ok($$SELECT dblink_exec('s3', 'TRUNCATE public.tap_charges')$$, 'ZF008', NULL,
    '(R4) TRUNCATE of a protected table is ZF008 in a fenced session');
SELECT is(pg_temp.remote('adm', $q$SELECT string_agg(id || ' ' || shard || ' ' || amount || ' ' || fence_token, ', ' ORDER BY id) FROM public.tap_charges$q$),
    '1 3 11 5, 2 3 10 5, 100 7 2 2', '(R1) none of the refused writes changed a row');

-- Under SET ROLE to a role that is not a member of the login role, the session's own
-- backend_start reads NULL to it: the binding still counts (R1).
SELECT dblink_exec('adm', 'CREATE ROLE tap_other; GRANT tap_other TO tap_writer; GRANT ALL ON public.tap_charges TO tap_other') \g /dev/null
SELECT is(pg_temp.remote('s3', 'SET ROLE tap_other; SELECT coalesce(backend_start::text, ''hidden'') FROM pg_stat_activity WHERE pid = pg_backend_pid()'),
    'hidden', '(R1) a session under SET ROLE that cannot read its own backend_start');
SELECT lives_ok($$SELECT dblink_exec('s3', 'UPDATE public.tap_charges SET amount = 10 WHERE id = 2')$$, '(R1) ... writes its rows');
SELECT throws_ok($$SELECT dblink_exec('s3', 'DELETE FROM public.tap_charges WHERE id = 100')$$, 'ZF012', NULL, '(R1) ... and not the others''');
SELECT dblink_exec('s3', 'RESET ROLE') \g /dev/null

-- A BEFORE trigger of the table's own that changes the partition key fires before
-- zz_fence_protect, which checks the row it made (R1).
SELECT dblink_exec('own', $$
    CREATE FUNCTION public.tap_move() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN IF NEW.amount = 777 THEN NEW.shard := 7; END IF; RETURN NEW; END';
    CREATE TRIGGER move_777 BEFORE INSERT ON public.tap_charges FOR EACH ROW EXECUTE FUNCTION public.tap_move();
$$) \g /dev/null
SELECT throws_ok($$SELECT dblink_exec('s3', 'INSERT INTO public.tap_charges VALUES (5, 3, 777)')$$, 'ZF012', NULL,
    '(R1) a row another BEFORE trigger moved to tap-billing-7 is checked as it was made');
SELECT dblink_exec('own', 'DROP TRIGGER move_777 ON public.tap_charges; DROP FUNCTION public.tap_move()') \g /dev/null

-- The writer's search_path does not change how a row's resource is computed (R5): an operator
-- || of its own that says every row is tap-billing-3.
SELECT dblink_exec('adm', $$
    CREATE SCHEMA tap_evil;
    GRANT USAGE ON SCHEMA tap_evil TO PUBLIC;
    CREATE FUNCTION tap_evil.cat(text, int) RETURNS text LANGUAGE sql IMMUTABLE AS 'SELECT ''tap-billing-3''';
    CREATE OPERATOR tap_evil.|| (LEFTARG = text, RIGHTARG = int, FUNCTION = tap_evil.cat);
$$) \g /dev/null
SELECT is(pg_temp.remote('s3', $q$SET search_path = tap_evil, pg_catalog; SELECT 'tap-billing-' || 7$q$), 'tap-billing-3',
    '(R5) with search_path tap_evil first, the writer''s || says tap-billing-3');
SELECT throws_ok($$SELECT dblink_exec('s3', 'DELETE FROM public.tap_charges WHERE id = 100')$$, 'ZF012', NULL,
    '(R5) ... and the trigger still finds tap-billing-7''s row');
SELECT dblink_exec('s3', 'RESET search_path') \g /dev/null

-- Neither fence.protect nor fence.unprotect in a fenced session (R5), even the owner's.
SELECT pg_temp.connect('o3', 'tap_owner') \g /dev/null
SELECT pg_temp.bind('o3', 'tap-billing-3', 5) \g /dev/null
SELECT throws_ok($$SELECT pg_temp.remote('o3', $q$SELECT fence.unprotect('public.tap_charges')$q$)$$, 'ZF008', NULL,
    '(R5) fence.unprotect is ZF008 in a fenced session');
SELECT throws_ok($$SELECT pg_temp.remote('o3', $q$SELECT fence.protect('public.tap_charges', 'shard::text')$q$)$$, 'ZF008', NULL,
    '(R5) ... fence.protect too');

-- The raise of tap-billing-3 (R3): the writer of token 5 with an open transaction is ended before
-- the raise commits; its row never commits; tap-billing-7 writes on.
SELECT dblink_exec('s3', 'BEGIN') \g /dev/null
SELECT dblink_exec('s3', 'INSERT INTO public.tap_charges VALUES (4, 3, 40)') \g /dev/null
SELECT pg_temp.connect('n3', 'tap_writer') \g /dev/null
SELECT is(pg_temp.bind('n3', 'tap-billing-3', 6), 6::bigint, '(R3) a session with token 6 of tap-billing-3 is admitted');
SELECT ok(pg_temp.connection_lost($$SELECT dblink_exec('s3', 'COMMIT')$$), '(R3) ... the writer of token 5 was ended: its COMMIT fails');
SELECT is(pg_temp.remote('adm', 'SELECT count(*)::text FROM public.tap_charges WHERE id = 4'), '0', '(R3) ... and its row never committed');
SELECT pg_temp.connect('s3', 'tap_writer') \g /dev/null
SELECT throws_ok($$SELECT pg_temp.bind('s3', 'tap-billing-3', 5)$$, 'ZF001', NULL, '(R3) token 5 is not bound again (P3)');
SELECT lives_ok($$SELECT dblink_exec('s7', 'INSERT INTO public.tap_charges VALUES (7, 7, 70)')$$, '(R3) tap-billing-7 writes on');
SELECT lives_ok($$SELECT dblink_exec('n3', 'UPDATE public.tap_charges SET amount = 12 WHERE id = 1')$$,
    '(R2) token 6 writes the row of token 5');
SELECT is(pg_temp.remote('adm', $q$SELECT amount || ' ' || fence_token FROM public.tap_charges WHERE id = 1$q$), '12 6', '(R2) ... which now carries 6');

-- A token lower than the row's (R2): the operator lowers tap-billing-3 to 5 again (fence.reset),
-- and a session of token 5 finds the row of token 6.
SELECT * FROM dblink('adm', $$SELECT fence.reset('tap-billing-3', 5)$$) AS t(x bigint) \g /dev/null
SELECT pg_temp.connect('s3', 'tap_writer') \g /dev/null
SELECT pg_temp.bind('s3', 'tap-billing-3', 5) \g /dev/null
SELECT is(pg_temp.error_of($$SELECT dblink_exec('s3', 'DELETE FROM public.tap_charges WHERE id = 1')$$),
    ARRAY['ZF001',
          'stale fencing token: resource "tap-billing-3" token 5 is lower than the token 6 a row of public.tap_charges was written under',
          'A session with a higher token wrote this row; this session may no longer write it.',
          'A stale leader of "tap-billing-3" must stop writing, acquire the lock again and reconnect with the new token. If this is the current leader (the row came from another token sequence: a fence reset that lowered the token, a row moved from another partition, fence.protect with a new expression), the table''s owner clears the row''s fence_token (docs/partitions.md).'],
    '(R2) a write under token 5 to a row of token 6 is ZF001, saying what to do');
SELECT lives_ok($$SELECT dblink_exec('s3', 'UPDATE public.tap_charges SET amount = 3 WHERE id = 2')$$,
    '(R2) ... while the rows of token 5 stay its own');

-- allow_unfenced (R4): the owner's explicit choice lets sessions without a token write, unchecked
-- and unstamped; fenced sessions are checked as before.
SELECT lives_ok($$SELECT pg_temp.remote('own', $q$SELECT fence.protect('public.tap_charges', $e$'tap-billing-' || shard$e$, allow_unfenced => true)$q$)$$,
    '(R4) the owner allows sessions without a token');
SELECT lives_ok($$SELECT dblink_exec('w', 'INSERT INTO public.tap_charges (id, shard, amount, fence_token) VALUES (50, 9, 1, 3)')$$,
    '(R4) ... which then write');
SELECT is(pg_temp.remote('adm', 'SELECT fence_token::text FROM public.tap_charges WHERE id = 50'), '3', '(R4) ... unstamped');
SELECT throws_ok($$SELECT dblink_exec('s7', 'DELETE FROM public.tap_charges WHERE id = 50')$$, 'ZF012', NULL,
    '(R4) a fenced session is checked all the same');
SELECT throws_ok($$SELECT dblink_exec('s7', 'TRUNCATE public.tap_charges')$$, 'ZF008', NULL,
    '(R4) ... and may not TRUNCATE');
SELECT lives_ok($$SELECT dblink_exec('w', 'BEGIN; TRUNCATE public.tap_charges; ROLLBACK')$$,
    '(R4) a session without a token may TRUNCATE then');

-- A partitioned table (R1, R4): the row trigger on every partition, present and later; the
-- TRUNCATE trigger on each partition fence.protect saw.
SELECT dblink_exec('own', $$
    CREATE TABLE public.tap_parted (id int, shard int NOT NULL, PRIMARY KEY (shard, id)) PARTITION BY LIST (shard);
    CREATE TABLE public.tap_parted_3 PARTITION OF public.tap_parted FOR VALUES IN (3);
    CREATE TABLE public.tap_parted_7 PARTITION OF public.tap_parted FOR VALUES IN (7);
    GRANT ALL ON public.tap_parted, public.tap_parted_3, public.tap_parted_7 TO tap_writer;
    SELECT fence.protect('public.tap_parted', $e$'tap-billing-' || shard$e$);
    CREATE TABLE public.tap_parted_9 PARTITION OF public.tap_parted FOR VALUES IN (9);
    GRANT ALL ON public.tap_parted_9 TO tap_writer;
$$) \g /dev/null
SELECT lives_ok($$SELECT dblink_exec('s7', 'INSERT INTO public.tap_parted VALUES (1, 7)')$$, '(R1) a partitioned table: its own row');
SELECT throws_ok($$SELECT dblink_exec('s7', 'INSERT INTO public.tap_parted_3 VALUES (1, 3)')$$, 'ZF012', NULL,
    '(R1) ... another''s row, written to its partition directly, is ZF012');
SELECT throws_ok($$SELECT dblink_exec('s7', 'INSERT INTO public.tap_parted_9 VALUES (1, 9)')$$, 'ZF012', NULL,
    '(R1) ... also in a partition created after fence.protect');
SELECT throws_ok($$SELECT dblink_exec('s7', 'UPDATE public.tap_parted SET shard = 3')$$, 'ZF012', NULL,
    '(R1) ... and an UPDATE that moves its row to another partition');
SELECT throws_ok($$SELECT dblink_exec('s7', 'TRUNCATE public.tap_parted_7')$$, 'ZF008', NULL,
    '(R4) TRUNCATE of a partition is ZF008');

SELECT lives_ok($$SELECT pg_temp.remote('own', $q$SELECT fence.protect('public.tap_parted', $e$'tap-billing-' || shard$e$)$q$)$$,
    '(R4) fence.protect again after a partition was added');
SELECT throws_ok($$SELECT dblink_exec('s7', 'TRUNCATE public.tap_parted_9')$$, 'ZF008', NULL,
    '(R4) ... puts the TRUNCATE trigger on it too');

-- fence.unprotect takes the triggers off; fence_token stays.
SELECT lives_ok($$SELECT pg_temp.remote('own', $q$SELECT fence.unprotect('public.tap_parted')$q$)$$, 'fence.unprotect by the owner');
SELECT is((SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'zz_fence_protect%'
           AND tgrelid::regclass::text LIKE 'tap_parted%'), 0::bigint,
    '... takes the triggers off the table and its partitions');
SELECT lives_ok($$SELECT dblink_exec('s3', 'INSERT INTO public.tap_parted VALUES (2, 7)')$$, '... and any session writes again');

SELECT dblink_disconnect(c) FROM unnest(dblink_get_connections()) AS c \g /dev/null
SELECT pg_temp.connect('adm') \g /dev/null
SELECT dblink_exec('adm', $$
    DROP TABLE public.tap_charges, public.tap_parted;
    DROP SCHEMA tap_evil CASCADE;
    DROP ROLE tap_other;
    REVOKE CREATE ON SCHEMA public FROM tap_owner;
    DELETE FROM fence.tokens WHERE resource LIKE 'tap-billing%';
    DELETE FROM fence.bindings WHERE resource LIKE 'tap-billing%';
    DELETE FROM fence.history WHERE resource LIKE 'tap-billing%';
$$) \g /dev/null
SELECT dblink_disconnect('adm') \g /dev/null
SELECT pg_temp.drop_login_role('tap_owner') \g /dev/null
SELECT pg_temp.drop_login_role('tap_writer') \g /dev/null
SELECT * FROM finish();
ROLLBACK;
