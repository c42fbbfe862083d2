-- fence.protect(table, resource, allow_unfenced): declares that each row of table belongs to
-- the resource that the expression resource (SQL over the row's columns) gives, and puts
-- the trigger fence.protect_row on it and on each of its partitions: from then on a write to
-- a row needs a session bound to its resource under a token no lower than the row's
-- fence_token (R1, R2), and stamps the row's fence_token with that token. Adds fence_token
-- (bigint NOT NULL DEFAULT 0: rows written before stay writable by any bound session) when
-- the table has none. allow_unfenced lets sessions that are not fenced write unchecked; by
-- default they are refused (R4). Run it again to change the declaration, and after adding a
-- partition (its TRUNCATE trigger). fence.unprotect undoes it.
--
-- SECURITY INVOKER: it does what its caller may do (ALTER TABLE, CREATE TRIGGER), and only the
-- table's owner may. The expression is checked (R5) under the search_path the trigger runs
-- with (pg_catalog): only the table's own columns, not fence_token nor a generated column
-- (BEFORE triggers see those before they are computed), and only immutable functions, so that
-- a row's resource is the same whenever it is computed.
CREATE OR REPLACE FUNCTION fence.protect(tbl regclass, resource text, allow_unfenced boolean DEFAULT false)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    p_table  ALIAS FOR $1;
    p_expr   ALIAS FOR $2;
    p_allow  ALIAS FOR $3;
    kind     "char";
    owner    oid;
    tok_type regtype;
    cols     text;
    why      text;
    later    text;
    part     regclass;
BEGIN
    -- (R5) Refused in a fenced session; takes the triggers of an earlier declaration off.
    PERFORM fence.unprotect(p_table);
    IF p_table IS NULL OR p_expr IS NULL OR btrim(p_expr) = '' OR p_allow IS NULL THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = 'malformed arguments of fence.protect: table, resource expression and allow_unfenced must not be NULL or empty';
    END IF;
    SELECT c.relkind, c.relowner INTO kind, owner FROM pg_class AS c WHERE c.oid = p_table;
    IF kind NOT IN ('r', 'p') THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('malformed arguments of fence.protect: %s is not a table', p_table);
    END IF;
    IF NOT pg_has_role(current_user, owner, 'USAGE') THEN
        RAISE EXCEPTION USING
            ERRCODE = '42501',
            MESSAGE = format('must be owner of table %s to protect it', p_table);
    END IF;

    SELECT a.atttypid::regtype INTO tok_type FROM pg_attribute AS a
    WHERE a.attrelid = p_table AND a.attname = 'fence_token' AND a.attnum > 0 AND NOT a.attisdropped;
    IF tok_type IS NULL THEN
        EXECUTE format('ALTER TABLE %s ADD COLUMN fence_token bigint NOT NULL DEFAULT 0', p_table);
    ELSIF tok_type <> 'bigint'::regtype THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('malformed arguments of fence.protect: %s.fence_token is %s, not bigint', p_table, tok_type);
    END IF;

    -- (R5) The expression over a copy of the row's own columns (no fence_token, no generated
    -- column) as an index expression, which PostgreSQL accepts only with immutable functions;
    -- then as the trigger evaluates it.
    SELECT string_agg(quote_ident(a.attname), ', ' ORDER BY a.attnum) INTO cols FROM pg_attribute AS a
    WHERE a.attrelid = p_table AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
      AND a.attname <> 'fence_token';
    BEGIN
        EXECUTE format('CREATE TEMP TABLE fence_protect_check AS SELECT %s FROM %s WITH NO DATA', cols, p_table);
        EXECUTE format('CREATE INDEX ON pg_temp.fence_protect_check (((%s)::text))', p_expr);
        DROP TABLE pg_temp.fence_protect_check;
        EXECUTE format('SELECT (%s)::text FROM (SELECT (NULL::%s).*) AS fence_row', p_expr, p_table);
    EXCEPTION WHEN OTHERS THEN
        GET STACKED DIAGNOSTICS why = MESSAGE_TEXT;
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('malformed resource expression of fence.protect for %s: %s: %s', p_table, p_expr, why),
            HINT = 'The expression gives a row''s resource from the row''s own columns (not fence_token, not generated columns) with immutable functions; names outside pg_catalog are schema-qualified. For example $$''billing-'' || shard::text$$.';
    END;

    -- (R1) Named to fire after the table's other BEFORE row triggers (they fire in name
    -- order), so that it checks the row they made; ENABLE ALWAYS: also under
    -- session_replication_role = replica.
    EXECUTE format('CREATE TRIGGER zz_fence_protect BEFORE INSERT OR UPDATE OR DELETE ON %s FOR EACH ROW EXECUTE FUNCTION fence.protect_row(%L, %L)',
                   p_table, p_expr, CASE WHEN p_allow THEN 'allow_unfenced' ELSE 'refuse_unfenced' END);
    -- (R4) TRUNCATE, on the table and each partition (statement triggers are not inherited).
    FOR part IN SELECT p_table UNION SELECT t.relid FROM pg_partition_tree(p_table) AS t LOOP
        EXECUTE format('CREATE TRIGGER zz_fence_protect_truncate BEFORE TRUNCATE ON %s FOR EACH STATEMENT EXECUTE FUNCTION fence.protect_row(%L, %L)',
                       part, p_expr, CASE WHEN p_allow THEN 'allow_unfenced' ELSE 'refuse_unfenced' END);
        EXECUTE format('ALTER TABLE %s ENABLE ALWAYS TRIGGER zz_fence_protect_truncate', part);
        EXECUTE format('ALTER TABLE %s ENABLE ALWAYS TRIGGER zz_fence_protect', part);
    END LOOP;

    SELECT string_agg(format('%s on %s', t.tgname, t.tgrelid::regclass), ', ') INTO later
    FROM pg_trigger AS t WHERE t.tgrelid IN (SELECT p_table UNION SELECT p.relid FROM pg_partition_tree(p_table) AS p)
      AND t.tgtype & 3 = 3 AND t.tgname COLLATE "C" > 'zz_fence_protect';
    IF later IS NOT NULL THEN
        RAISE WARNING USING
            MESSAGE = format('fence.protect: the BEFORE row triggers %s fire after zz_fence_protect, which does not check what they change', later),
            HINT = 'Rename them to sort before zz_fence_protect.';
    END IF;
END
$fn$;
COMMENT ON FUNCTION fence.protect(regclass, text, boolean) IS
    'fenceproxy: protect a table''s rows by their resource: writes need a session bound to it, under a token no lower than the row''s fence_token';
REVOKE ALL ON FUNCTION fence.protect(regclass, text, boolean) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fence.protect(regclass, text, boolean) TO PUBLIC;
