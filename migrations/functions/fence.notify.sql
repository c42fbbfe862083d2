-- fence.notify(payload, max_usage): tells the listening proxies of a raise on 'fence_raise'
-- (NOTIFY is transactional: they hear of it when the raise commits), unless the notification
-- queue is more than max_usage full. A full queue fails the commit of every transaction that
-- notifies ("too many notifications in the NOTIFY queue", at commit), and any role can fill it
-- (a session that LISTENs and stays idle in a transaction while others notify): notifying
-- regardless would let any client make every raise fail, locking the new leader out. The
-- guarantee does not rest on the notification (P2 ends the stale backends), only the
-- promptness of the proxies' errors, and they ask the database anyway (fence.settled). Not
-- granted to PUBLIC.
CREATE OR REPLACE FUNCTION fence.notify(payload text, max_usage double precision DEFAULT 0.5)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF pg_notification_queue_usage() < max_usage THEN
        PERFORM pg_notify('fence_raise', payload);
    ELSE
        RAISE LOG 'fenceproxy: raise "%" not notified: the NOTIFY queue is %%% full',
            payload, round((100 * pg_notification_queue_usage())::numeric, 1);
    END IF;
END
$fn$;
REVOKE ALL ON FUNCTION fence.notify(text, double precision) FROM PUBLIC;
