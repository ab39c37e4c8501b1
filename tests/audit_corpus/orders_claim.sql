-- expect: SL003, SL007
-- Any table used as a work queue counts: here orders, taken by status, with a lock that
-- waits and no order.
SELECT id, customer_id
FROM orders
WHERE status = 'new'
LIMIT 10
FOR UPDATE;
