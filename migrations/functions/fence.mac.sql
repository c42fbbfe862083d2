-- fence.mac(key, kind, resource, token, pid): the MAC the proxy computes with its key (P5):
-- hex(sha256(key || sha256(key || message))), message = kind, database, resource, token and pid
-- joined by newlines, as bytes in the database's encoding (the bytes of the database name that
-- the proxy saw in the startup message). The nested hash is the NMAC construction (no length
-- extension: the outer hash covers a fixed-length inner digest); built-in sha256, no pgcrypto.
-- A plain SQL expression, so that fence.bind's query inlines it; operators schema-qualified,
-- since an inlined body is resolved with the caller's search_path.
CREATE OR REPLACE FUNCTION fence.mac(key bytea, kind text, resource text, token bigint, pid integer)
RETURNS text
LANGUAGE sql
STABLE
PARALLEL SAFE
AS $fn$
SELECT pg_catalog.encode(pg_catalog.sha256(key OPERATOR(pg_catalog.||) pg_catalog.sha256(key OPERATOR(pg_catalog.||)
    pg_catalog.convert_to(kind OPERATOR(pg_catalog.||) E'\n' OPERATOR(pg_catalog.||) pg_catalog.current_database()::pg_catalog.text
        OPERATOR(pg_catalog.||) E'\n' OPERATOR(pg_catalog.||) resource OPERATOR(pg_catalog.||) E'\n'
        OPERATOR(pg_catalog.||) token::pg_catalog.text OPERATOR(pg_catalog.||) E'\n' OPERATOR(pg_catalog.||) pid::pg_catalog.text,
        pg_catalog.getdatabaseencoding()))), 'hex')
$fn$;
REVOKE ALL ON FUNCTION fence.mac(bytea, text, text, bigint, integer) FROM PUBLIC;
