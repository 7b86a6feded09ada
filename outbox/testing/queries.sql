-- Test kit readers (outbox.testing): what a test asserts on, so users write no SQL. Kept
-- apart from the product's statements (sql/queries.sql): nothing but the test kit runs
-- them. {schema} is the quoted schema identifier.

-- name: testkit_jobs
-- Every job, oldest first; narrowed to one effect and/or one key when those are given.
SELECT * FROM {schema}.jobs
WHERE (%(effect)s::text IS NULL OR effect = %(effect)s::text)
  AND (%(key)s::text IS NULL OR key = %(key)s::text)
ORDER BY id;

-- name: testkit_ledger
-- Every ledger row, oldest first; narrowed to one key when it is given.
SELECT * FROM {schema}.effect_results
WHERE %(key)s::text IS NULL OR key = %(key)s::text
ORDER BY recorded_at, key;

-- name: testkit_audit
-- The audit trail (operators' actions and the reconciler's decisions), oldest first;
-- narrowed to one actor when it is given.
SELECT * FROM {schema}.dashboard_audit
WHERE %(actor)s::text IS NULL OR actor = %(actor)s::text
ORDER BY id;

-- name: testkit_inbox
-- The message ids a consumer received (its inbox rows), in the order received.
SELECT message_id FROM {schema}.inbox
WHERE consumer = %(consumer)s::text
ORDER BY received_at, message_id;
