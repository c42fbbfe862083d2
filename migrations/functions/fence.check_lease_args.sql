-- fence.check_lease_args(resource, holder, ttl): raises ZF004 for a malformed argument,
-- including a holder name with control characters (L7). Not granted to PUBLIC.
CREATE OR REPLACE FUNCTION fence.check_lease_args(resource text, holder text, ttl interval)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF $1 IS NULL OR $1 !~ '^[a-z][a-z0-9_.-]{0,62}$' THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('malformed fencing resource name: %s', quote_nullable($1)),
            HINT = 'A resource name is 1 to 63 characters of a-z, 0-9, "_", "." and "-", starting with a letter.';
    END IF;
    IF $2 IS NULL OR $2 = '' OR length($2) > 200 OR $2 ~ '[[:cntrl:]]' THEN -- (L7)
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('malformed lease holder: %s (a holder is 1 to 200 characters, none of them control characters)',
                             quote_nullable(pg_catalog.regexp_replace($2, '[[:cntrl:]]', '?', 'g')));
    END IF;
    -- (L5) A lease held for ever would stop every failover; too short a one cannot be renewed.
    -- Only a time part: interval comparison counts a month as 30 days, but adding months and
    -- days to a timestamp follows the calendar, so '1200 mon -35999 days' compares equal to
    -- a day and expires about 525 days later.
    IF $3 IS NOT NULL AND ($3 < interval '1 second' OR $3 > interval '24 hours'
                           OR extract(year FROM $3) <> 0 OR extract(month FROM $3) <> 0
                           OR extract(day FROM $3) <> 0) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'ZF004',
            MESSAGE = format('malformed lease TTL: %s (a TTL is 1 second to 24 hours, in hours, minutes and seconds)', $3);
    END IF;
END
$fn$;
REVOKE ALL ON FUNCTION fence.check_lease_args(text, text, interval) FROM PUBLIC;
