-- fence.protect_row(): the trigger fence.protect puts on a protected table, with two
-- arguments: the expression that gives a row's resource (over the row's columns, checked by
-- fence.protect) and 'allow_unfenced' or 'refuse_unfenced'. As a BEFORE row trigger of
-- INSERT, UPDATE and DELETE (which COPY, INSERT ... ON CONFLICT DO UPDATE, MERGE and a write
-- to a partition fire too), it refuses a write to a row whose resource this backend is not
-- bound to, OLD's and NEW's both (R1, ZF012), a write to a row whose fence_token is higher
-- than this backend's token for its resource (R2, ZF001), and stamps NEW.fence_token with
-- that token. As a BEFORE TRUNCATE trigger it refuses TRUNCATE (R4). A session that is not
-- fenced is refused (ZF003) unless the table's owner allowed it, and then writes unchecked
-- and unstamped (R4).
--
-- It reads the binding without a lock (R3): the binding this backend's bind committed
-- before the client's first statement holds until a raise of its resource ends the backend,
-- and that raise commits only once the backend has exited, its open transaction aborted.
--
-- SECURITY INVOKER: the expression, the table owner's, runs with the writer's rights, never
-- the fence schema owner's. The search_path is pinned (R5) so that a writer cannot resolve
-- the expression's functions and operators to others of its own.
CREATE OR REPLACE FUNCTION fence.protect_row()
RETURNS trigger
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    expr        text := TG_ARGV[0];
    tbl         text;
    resources   text[];
    tokens      bigint[];
    starts      timestamptz[];
    started     timestamptz;
    res_old     text;
    res_new     text;
    tok_old     bigint;
    tok_new     bigint;
    res         text;
    bound       text;
BEGIN
    -- fence.session_bindings inline (every row pays for this). The rows of this pid first: a
    -- session without one is not bound; then this backend's backend_start, which a leftover
    -- row of an exited backend with this pid does not have (it reads NULL only under SET ROLE
    -- to a role the login role is not a member of, and then the SECURITY DEFINER function
    -- reads it).
    SELECT array_agg(b.resource), array_agg(b.token), array_agg(b.backend_start)
    INTO resources, tokens, starts FROM fence.bindings AS b WHERE b.pid = pg_backend_pid();
    IF resources IS NOT NULL THEN
        SELECT a.backend_start INTO started FROM pg_stat_get_activity(pg_backend_pid()) AS a;
        IF started IS NULL THEN
            SELECT array_agg(s.resource), array_agg(s.token) INTO resources, tokens FROM fence.session_bindings() AS s;
        ELSIF cardinality(starts) > 1 OR starts[1] <> started THEN
            SELECT array_agg(u.r), array_agg(u.t) INTO resources, tokens
            FROM unnest(resources, tokens, starts) AS u(r, t, st) WHERE u.st = started;
        END IF;
    END IF;

    IF resources IS NULL THEN
        IF TG_ARGV[1] = 'allow_unfenced' THEN -- (R4) the owner's explicit choice: unchecked, unstamped
            RETURN CASE TG_OP WHEN 'DELETE' THEN OLD WHEN 'TRUNCATE' THEN NULL ELSE NEW END;
        END IF;
        RAISE EXCEPTION USING -- (R4)
            ERRCODE = 'ZF003',
            MESSAGE = format('fencing token missing: %I.%I is a protected table (fence.protect) and this session is not fenced', TG_TABLE_SCHEMA, TG_TABLE_NAME),
            DETAIL = format('%s of a protected table needs a session bound to the resource of each row it writes.', TG_OP),
            HINT = 'Connect through fenceproxy with fence.resource (the resource of the rows to write) and the fence.token of its lock. The table''s owner may allow sessions without a token: fence.protect(table, expression, allow_unfenced => true).';
    END IF;
    IF TG_OP = 'TRUNCATE' THEN -- (R4)
        RAISE EXCEPTION USING
            ERRCODE = 'ZF008',
            MESSAGE = format('not allowed in a fenced session: TRUNCATE of %I.%I, a protected table, would remove the rows of every resource', TG_TABLE_SCHEMA, TG_TABLE_NAME),
            HINT = 'DELETE the rows of this session''s resource instead.';
    END IF;

    -- The resources of OLD and NEW, in one statement for an UPDATE.
    IF TG_OP = 'INSERT' THEN
        EXECUTE 'SELECT (' || expr || ')::text FROM (SELECT ($1).*) AS fence_row' INTO res_new USING NEW;
    ELSIF TG_OP = 'DELETE' THEN
        EXECUTE 'SELECT (' || expr || ')::text FROM (SELECT ($1).*) AS fence_row' INTO res_old USING OLD;
    ELSE
        EXECUTE 'SELECT (SELECT (' || expr || ')::text FROM (SELECT ($1).*) AS fence_row), '
             || '(SELECT (' || expr || ')::text FROM (SELECT ($2).*) AS fence_row)'
        INTO res_old, res_new USING OLD, NEW;
    END IF;
    tok_old := tokens[array_position(resources, res_old)];
    tok_new := tokens[array_position(resources, res_new)];

    -- (R1) Each row's resource bound: OLD's (UPDATE, DELETE) and NEW's (INSERT, UPDATE).
    IF (TG_OP <> 'INSERT' AND tok_old IS NULL) OR (TG_OP <> 'DELETE' AND tok_new IS NULL) THEN
        res := CASE WHEN TG_OP <> 'INSERT' AND tok_old IS NULL THEN res_old ELSE res_new END;
        tbl := format('%I.%I', TG_TABLE_SCHEMA, TG_TABLE_NAME);
        SELECT string_agg(format('resource "%s" token %s', r, t), ', ' ORDER BY r) INTO bound
        FROM unnest(resources, tokens) AS u(r, t);
        RAISE EXCEPTION USING
            ERRCODE = 'ZF012',
            MESSAGE = CASE WHEN res IS NULL
                THEN format('fencing resource not bound: the resource of a row of %s is NULL (%s), and this session is bound to %s',
                            tbl, expr, bound)
                ELSE format('fencing resource not bound: a row of %s belongs to resource "%s" (%s), and this session is bound to %s',
                            tbl, res, expr, bound) END,
            DETAIL = CASE WHEN TG_OP = 'UPDATE'
                THEN format('An UPDATE needs a binding to the resource of the row before it and after it; this is the row %s.',
                            CASE WHEN tok_old IS NULL THEN 'before' ELSE 'after' END)
                ELSE format('%s of a protected table needs a session bound to the resource of each row it writes.', TG_OP) END,
            HINT = CASE WHEN res IS NULL
                THEN 'Give the row the columns its resource is computed from.'
                ELSE format('Write the rows of resource "%s" in a session bound to it: connect with fence.resource=%s and the fence.token of its lock.', res, res) END;
    END IF;
    -- (R2) OLD written under a token no higher than this session's for its resource.
    IF TG_OP <> 'INSERT' AND coalesce(OLD.fence_token, 0) > tok_old THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF001',
            MESSAGE = format('stale fencing token: resource "%s" token %s is lower than the token %s a row of %I.%I was written under',
                             res_old, tok_old, OLD.fence_token, TG_TABLE_SCHEMA, TG_TABLE_NAME),
            DETAIL = 'A session with a higher token wrote this row; this session may no longer write it.',
            HINT = format('A stale leader of "%s" must stop writing, acquire the lock again and reconnect with the new token. If this is the current leader (the row came from another token sequence: a fence reset that lowered the token, a row moved from another partition, fence.protect with a new expression), the table''s owner clears the row''s fence_token (docs/partitions.md).', res_old);
    END IF;
    IF TG_OP = 'DELETE' THEN
        RETURN OLD;
    END IF;
    NEW.fence_token := tok_new; -- (R2) stamped, whatever the writer set
    RETURN NEW;
END
$fn$;
COMMENT ON FUNCTION fence.protect_row() IS
    'fenceproxy: the trigger of a protected table (fence.protect): refuses a write to a row whose resource this session is not bound to, or under a lower token; stamps fence_token';
REVOKE ALL ON FUNCTION fence.protect_row() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fence.protect_row() TO PUBLIC;
