-- fence.forget_exited(resource): removes the bindings of resource's backends that have exited.
-- One anti-join against the activity list (a live pid whose backend_start reads NULL counts as
-- live). Not granted to PUBLIC.
CREATE OR REPLACE FUNCTION fence.forget_exited(resource text)
RETURNS void
LANGUAGE sql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
SELECT pg_stat_clear_snapshot();
DELETE FROM fence.bindings AS b
WHERE b.resource = $1
  AND NOT EXISTS (SELECT 1 FROM pg_stat_get_activity(NULL) AS a
                  WHERE a.pid = b.pid AND (a.backend_start = b.backend_start OR a.backend_start IS NULL));
$fn$;
REVOKE ALL ON FUNCTION fence.forget_exited(text) FROM PUBLIC;
