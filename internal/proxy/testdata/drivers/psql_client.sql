-- psql through fenceproxy: run by psql_client.sh (one cell of TestTransparencyMatrix).
\set VERBOSITY verbose
\set AUTOCOMMIT off
-- The first statement. With AUTOCOMMIT off psql begins a transaction block
-- before a statement only when libpq says the session is idle; then the block
-- began with that BEGIN, before this statement.
SELECT transaction_timestamp() < statement_timestamp() AS began \gset
\if :began
\echo ok idle after connect
\else
\echo FAIL idle after connect: psql began no transaction block before the first statement
\endif
CREATE TEMP TABLE t (id int PRIMARY KEY, tag text NOT NULL DEFAULT 'copied');
INSERT INTO t VALUES (1, 'rolled back');
ROLLBACK;
SELECT to_regclass('pg_temp.t') IS NULL AS gone \gset
ROLLBACK;
\if :gone
\echo ok rollback leaves nothing
\else
\echo FAIL rollback leaves nothing: the rolled-back first transaction's table is left
\endif
\set AUTOCOMMIT on

DROP TABLE IF EXISTS pg_temp.t;
CREATE TEMP TABLE t (id int PRIMARY KEY, tag text NOT NULL DEFAULT 'copied');
BEGIN;
INSERT INTO t VALUES (1, 'kept');
SAVEPOINT s;
INSERT INTO t VALUES (2, 'undone');
ROLLBACK TO SAVEPOINT s;
INSERT INTO t VALUES (3, 'kept');
COMMIT;
BEGIN;
SELECT 1/0;
\set div :SQLSTATE
ROLLBACK;
SELECT string_agg(id::text, ',' ORDER BY id) = '1,3' AND :'div' = '22012' AS tx_ok FROM t \gset
\if :tx_ok
\echo ok transaction and savepoints
\else
\echo FAIL transaction and savepoints: rows or the division by zero's SQLSTATE (:div) not as expected
\endif

PREPARE double(int) AS SELECT $1 * 2 AS doubled;
EXECUTE double(21) \gset
EXECUTE double(:doubled) \gset
SELECT :doubled = 84 AS prepared \gset
\if :prepared
\echo ok prepared statement
\else
\echo FAIL prepared statement: got :doubled
\endif

\copy t (id) FROM PROGRAM 'seq 4 1000'
SELECT count(*) = 999 AS copied FROM t \gset
\if :copied
\echo ok copy in
\else
\echo FAIL copy in: not 999 rows
\endif
\copy (SELECT id, tag FROM t ORDER BY id) TO 'copy_out.txt'
\! sh "$PSQL_CLIENT" copy-out copy_out.txt

LISTEN :CHANNEL;
\! sh "$PSQL_CLIENT" notify
\o notify.txt
SELECT pg_sleep(0.05);
SELECT 1;
\o
\! sh "$PSQL_CLIENT" notified notify.txt

\if :FENCED
-- A new holder's session makes this one stale: its next statement fails with ZF001.
\! sh "$PSQL_CLIENT" stale
SELECT 1;
\setenv STALE_SQLSTATE :SQLSTATE
\! sh "$PSQL_CLIENT" stale-state
\endif
