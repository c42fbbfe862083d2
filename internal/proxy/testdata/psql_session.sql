-- Run by TestPsql through the proxy and directly; the two outputs must be
-- identical (process IDs aside). Errors are part of the script.
\set ON_ERROR_STOP 0
\pset pager off
SELECT 1 AS one, 'two' AS two, NULL AS three;
CREATE TEMP TABLE t (id int PRIMARY KEY, v text);
INSERT INTO t SELECT g, md5(g::text) FROM generate_series(1, 2000) g;
COPY t FROM STDIN;
2001	first
2002	second
\.
COPY t FROM STDIN;
2003	fine
2003	duplicate key
\.
COPY t FROM STDIN (FORMAT csv);
2004,"quoted, with comma"
2005,"multi
line"
\.
SELECT count(*), sum(id), md5(string_agg(v, ',' ORDER BY id)) FROM t;
COPY (SELECT * FROM t WHERE id > 1990 ORDER BY id) TO STDOUT;
\copy (SELECT id, v FROM t WHERE id <= 3 ORDER BY id) TO STDOUT WITH (FORMAT csv, HEADER)
PREPARE twice(int) AS SELECT $1 * 2 AS doubled;
EXECUTE twice(21);
DEALLOCATE twice;
DO $$BEGIN RAISE NOTICE 'a notice with %', 'a parameter'; RAISE WARNING 'and a warning' USING HINT = 'a hint'; END$$;
LISTEN psql_chan;
NOTIFY psql_chan, 'hello through psql';
SELECT 1/0;
BEGIN;
SELECT 1/0;
SELECT 'ignored';
ROLLBACK;
BEGIN;
INSERT INTO t VALUES (3000, 'kept');
SAVEPOINT s;
INSERT INTO t VALUES (3001, 'rolled back');
ROLLBACK TO SAVEPOINT s;
COMMIT;
SELECT id, v FROM t WHERE id >= 3000;
SET application_name = 'psql through fenceproxy';
SHOW application_name;
SET TimeZone = 'Pacific/Chatham';
SELECT '2024-01-01 00:00:00+00'::timestamptz;
SELECT 'SELECT ' || g || ' AS gexec' FROM generate_series(1, 2) g \gexec
SELECT 41 + 1 AS answer \gset
\echo answer is :answer
SELECT repeat('x', 100000) = repeat('x', 100000) AS big;
SELECT length(string_agg(md5(g::text), '')) FROM generate_series(1, 100000) g;
SELECT * FROM generate_series(1, 5) g \g
\errverbose
SELECT nosuchcolumn;
\errverbose
