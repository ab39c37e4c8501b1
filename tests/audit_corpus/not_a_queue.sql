-- expect: none
-- Row locks on tables that are not queues, taken by key: nothing to say.
UPDATE accounts
SET balance = balance - $2
WHERE id = (SELECT id FROM accounts WHERE user_id = $1 LIMIT 1 FOR UPDATE);

SELECT * FROM accounts WHERE user_id = $1 ORDER BY created_at LIMIT 1 FOR UPDATE;

SELECT * FROM app_job WHERE id = %s LIMIT 21 FOR UPDATE;

UPDATE users SET active = false
WHERE id IN (SELECT id FROM users WHERE last_login < now() - interval '1 year');

UPDATE orders SET status = 'shipped' WHERE id = $1;
