-- In the caller's transaction: what every transaction kind runs (psycopg, SQLAlchemy,
-- Django; outbox/_enqueue.py), the inbox's receive, the flows' resolve and the Kafka
-- consumer's offsets
--
-- Named blocks, loaded by outbox/_sql.py (the core's files, CORE_FILES, bound as one set
-- of names: queries(schema).<name>). {schema} is replaced by the quoted schema identifier
-- when a block is loaded (psycopg.sql.Identifier); values are always bound parameters, by
-- name. A write about a claimed job is conditional on status = 'running' AND
-- claim_version = the claim's version, so a stale worker's write changes 0 rows. A
-- `-- fragment: X` block is no statement: its text is bound into every block of the core
-- files and the dashboard's that names {X}, so a rule used by several is written once.

-- Enqueue: the blocks every transaction kind runs (psycopg, SQLAlchemy, Django), the
-- inbox's receive too. SQLAlchemy's text() reads ":key::text" as a parameter named "ke",
-- so their parameters are cast with CAST(... AS ...), never with "::".


-- name: enqueue
-- Insert one job unless its key is already a job or a ledger row: one row (the new id)
-- out, or none when the key is known (the caller then asks lookup_keys what holds it: the
-- known key costs a second statement, the new one none). One plain INSERT, no CTE: the
-- business transaction pays for each plan node of this statement.
-- The notify wakes idle dispatchers when the transaction commits (PostgreSQL folds
-- repeats into one); it is sent only when no dispatcher serving the effect is awake
-- (migration 0019: a NOTIFY serialises the commits of every transaction that sent one),
-- or outside READ COMMITTED, where the snapshot may predate a dispatcher's going to sleep.
-- The decision is a CASE on the returned row (the second column, true when it notified),
-- not a subquery around the call: fewer plan nodes for every enqueue to prepare.
INSERT INTO {schema}.jobs AS j (effect, key, payload, fingerprint, available_at, ordering_key,
                                max_attempts, trace_context, group_key, priority)
SELECT CAST(%(effect)s AS text), CAST(%(key)s AS text), CAST(%(payload)s AS jsonb),
       CAST(%(fingerprint)s AS text), coalesce(CAST(%(run_at)s AS timestamptz), now()),
       CAST(%(ordering_key)s AS text), CAST(%(max_attempts)s AS integer),
       CAST(%(trace_context)s AS jsonb), CAST(%(group_key)s AS text),
       CAST(%(priority)s AS integer)
WHERE NOT EXISTS (SELECT 1 FROM {schema}.effect_results r WHERE r.key = CAST(%(key)s AS text))
ON CONFLICT (key) DO NOTHING
RETURNING j.id,
    CASE WHEN current_setting('transaction_isolation') <> 'read committed'
              OR NOT EXISTS (SELECT 1 FROM {schema}.awake a
                             WHERE a.effect = j.effect AND a.until > now())
         THEN pg_notify(CAST(%(channel)s AS text), '') IS NOT NULL END AS notified;

-- name: enqueue_many
-- The bulk path: one statement for any number of jobs, created ids out. The jobs arrive
-- as one JSON array (each payload already canonical JSON, embedded as is): one
-- parameter, parsed by the server, however many jobs. A field at its default is left
-- out of a job's object (run_at, ordering_key, group_key: NULL; priority: 0). The batch
-- shares one enqueue span, so one trace context (NULL when tracing is off).
WITH wanted AS (
    SELECT *
    FROM ROWS FROM (jsonb_to_recordset(CAST(%(jobs)s AS jsonb))
                    AS (effect text, key text, payload jsonb, fingerprint text,
                        run_at timestamptz, ordering_key text, max_attempts integer,
                        group_key text, priority integer))
         WITH ORDINALITY
         AS w(effect, key, payload, fingerprint, run_at, ordering_key, max_attempts, group_key,
              priority, ord)
), inserted AS (
    INSERT INTO {schema}.jobs (effect, key, payload, fingerprint, available_at, ordering_key, max_attempts,
                               trace_context, group_key, priority)
    SELECT w.effect, w.key, w.payload, w.fingerprint, coalesce(w.run_at, now()), w.ordering_key, w.max_attempts,
           CAST(%(trace_context)s AS jsonb), w.group_key, coalesce(w.priority, 0)
    FROM wanted w
    WHERE NOT EXISTS (SELECT 1 FROM {schema}.effect_results r WHERE r.key = w.key)
    ORDER BY w.ord
    ON CONFLICT (key) DO NOTHING
    RETURNING id, key
)
SELECT i.key, i.id FROM inserted i
UNION ALL
SELECT NULL, NULL FROM (
    SELECT pg_notify(CAST(%(channel)s AS text), '')
    FROM (SELECT 1 FROM inserted LIMIT 1) AS any_inserted
    WHERE current_setting('transaction_isolation') <> 'read committed'
       OR EXISTS (SELECT 1 FROM (SELECT DISTINCT w.effect FROM wanted w) e
                  WHERE NOT EXISTS (SELECT 1 FROM {schema}.awake a
                                    WHERE a.effect = e.effect AND a.until > now()))) woken;

-- name: enqueue_withdrawn
-- A batch sent in parts (``Transaction.enqueue_many``) whose later part proved invalid:
-- the jobs its earlier parts created in this transaction are taken back, so that the
-- batch keeps nothing, as one refused before anything was sent. No other transaction
-- can see them yet; found by the primary key.
DELETE FROM {schema}.jobs WHERE id = ANY(CAST(%(ids)s AS bigint[])) AND status = 'pending';

-- name: lookup_keys
-- What already holds each key: a job (id, effect, fingerprint) or only the ledger.
SELECT k.key, j.id, coalesce(j.effect, r.effect) AS effect,
       coalesce(j.fingerprint, r.fingerprint) AS fingerprint
FROM unnest(CAST(%(keys)s AS text[])) AS k(key)
LEFT JOIN {schema}.jobs j ON j.key = k.key
LEFT JOIN {schema}.effect_results r ON r.key = k.key;

-- Inbox: the idempotent consumer's record of the messages it handled.

-- name: receive
-- Record a message in the caller's transaction; a row comes back only the first time.
-- A concurrent insert of the same message waits for the other transaction and then
-- conflicts (no row) if it committed, or inserts (a row) if it rolled back.
INSERT INTO {schema}.inbox (consumer, message_id)
VALUES (CAST(%(consumer)s AS text), CAST(%(message_id)s AS text))
ON CONFLICT (consumer, message_id) DO NOTHING
RETURNING true AS first;

-- name: receive_many
-- receive for many messages in one statement; the ids that come back were recorded now
-- (first time), the others had been received before. Waits on concurrent receives as
-- receive does.
INSERT INTO {schema}.inbox (consumer, message_id)
SELECT CAST(%(consumer)s AS text), m
FROM unnest(CAST(%(message_ids)s AS text[])) AS m
ON CONFLICT (consumer, message_id) DO NOTHING
RETURNING message_id;

-- name: jobs_in_transaction
-- Every job in enqueue order as the caller's transaction sees them: tests that run inside
-- a transaction which never commits (Django's TestCase) assert on what it enqueued.
SELECT id, effect, key, CAST(payload AS text) AS payload, status, group_key, priority
FROM {schema}.jobs
ORDER BY id;

-- Flows: the provider's own word that a job was performed (outbox.flows).

-- name: resolve_by_event
-- An event from the provider says the job with this key was performed (a Stripe webhook
-- whose metadata carries the key). A job in reconcile, or pending between attempts, goes
-- (back) to pending with the provider's answer kept: the next claim records it without
-- performing, runs on_done and writes the ledger row, fenced like any completion. A
-- running job is left to its claim. Audited as the reconciler's decision.
WITH resolved AS (
    UPDATE {schema}.jobs j
    SET status = 'pending', performed_result = CAST(%(result)s AS jsonb), attempts = 0,
        available_at = now(), reconcile_at = NULL, reconcile_checks = 0,
        last_error = CAST(%(note)s AS text), updated_at = now()
    WHERE j.key = CAST(%(key)s AS text) AND j.status IN ('reconcile', 'pending')
      AND j.performed_result IS NULL
    RETURNING j.id
), audited AS (
    INSERT INTO {schema}.dashboard_audit (actor, action, job_id, detail, affected)
    SELECT 'reconciler', 'reconcile', r.id,
           jsonb_build_object('decision', 'performed', 'source', CAST(%(source)s AS text)), 1
    FROM resolved r
)
SELECT r.id FROM resolved r, pg_notify(CAST(%(channel)s AS text), '');

-- Kafka consumer offsets (effects.kafka.InboxConsumer).

-- name: kafka_offsets
-- The next offset to read of each partition of %(topics)s stored for a consumer group.
SELECT topic, partition, next_offset
FROM {schema}.kafka_offsets
WHERE consumer = %(consumer)s::text AND topic = ANY(%(topics)s::text[]);

-- name: store_kafka_offsets
-- In the caller's transaction: the next offsets to read, per topic and partition.
INSERT INTO {schema}.kafka_offsets (consumer, topic, partition, next_offset)
SELECT %(consumer)s::text, o.topic, o.partition, o.next_offset
FROM jsonb_to_recordset(%(offsets)s::jsonb) AS o(topic text, partition int, next_offset bigint)
ON CONFLICT (consumer, topic, partition)
DO UPDATE SET next_offset = EXCLUDED.next_offset, updated_at = now();
