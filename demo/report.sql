-- The demo's outcome, read from the database itself (the ground truth), one
-- `name value` line per figure. Run with psql -X -A -t -F ' ' -f demo/report.sql.
--   customers  customers in the run
--   charged    customers charged at least once
--   pending    customers not charged yet
--   charges    charge rows
--   duplicates charges beyond the first for the same customer (must be 0 with fencing)
SELECT 'customers', count(*) FROM customers
UNION ALL
SELECT 'charged', count(DISTINCT customer_id) FROM charges
UNION ALL
SELECT 'pending', count(*) FROM customers WHERE NOT charged
UNION ALL
SELECT 'charges', count(*) FROM charges
UNION ALL
SELECT 'duplicates', count(*) - count(DISTINCT customer_id) FROM charges;

-- Every customer charged more than once, with who charged when under which token.
SELECT 'duplicate', customer_id,
       string_agg(format('%s (token %s)', replica, coalesce(token::text, 'none')), ' and ' ORDER BY id)
FROM charges
GROUP BY customer_id
HAVING count(*) > 1
ORDER BY customer_id;
