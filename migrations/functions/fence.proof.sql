-- fence.proof(kind, resource, token, pid): fence.mac under the stored key; NULL when no key is
-- stored. Not granted to PUBLIC.
CREATE OR REPLACE FUNCTION fence.proof(kind text, resource text, token bigint, pid integer)
RETURNS text
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
SELECT fence.mac(k.key, kind, resource, token, pid) FROM fence.keys AS k WHERE k.id = 1
$fn$;
REVOKE ALL ON FUNCTION fence.proof(text, text, bigint, integer) FROM PUBLIC;
