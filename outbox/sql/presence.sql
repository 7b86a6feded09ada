-- Dispatchers' presence (presence.py) and the awake marks that spare enqueues a NOTIFY
-- (awake.py)
--
-- Named blocks, loaded by outbox/_sql.py (the core's files, CORE_FILES, bound as one set
-- of names: queries(schema).<name>). {schema} is replaced by the quoted schema identifier
-- when a block is loaded (psycopg.sql.Identifier); values are always bound parameters, by
-- name. A write about a claimed job is conditional on status = 'running' AND
-- claim_version = the claim's version, so a stale worker's write changes 0 rows. A
-- `-- fragment: X` block is no statement: its text is bound into every block of the core
-- files and the dashboard's that names {X}, so a rule used by several is written once.

-- name: dispatcher_beat
-- A dispatcher's heartbeat: record (or refresh) which effects it serves, valid for
-- %(ttl)s seconds; forget dispatchers whose heartbeat stopped long ago.
WITH gone AS (
    DELETE FROM {schema}.dispatchers
    WHERE expires_at < now() - interval '1 hour' AND worker_id <> %(worker)s
)
INSERT INTO {schema}.dispatchers AS d (worker_id, effects, expires_at)
VALUES (%(worker)s, %(effects)s::text[], now() + CAST(%(ttl)s AS float8) * interval '1 second')
ON CONFLICT (worker_id) DO UPDATE
SET effects = EXCLUDED.effects, heartbeat_at = now(), expires_at = EXCLUDED.expires_at;

-- name: awake_mark
-- A dispatcher that keeps claiming: awake for each effect it serves until %(seconds)s
-- from now, so enqueues of those effects need not notify (migration 0019).
INSERT INTO {schema}.awake AS a (effect, dispatcher, until)
SELECT e, %(worker)s, now() + CAST(%(seconds)s AS float8) * interval '1 second'
FROM unnest(CAST(%(effects)s AS text[])) AS e
ON CONFLICT (effect, dispatcher) DO UPDATE SET until = EXCLUDED.until;

-- name: fall_asleep
-- A dispatcher about to sleep: awake no more, and every enqueue that saw it awake has
-- ended (migration 0019). True when that wait held within %(timeout)s.
SELECT {schema}.fall_asleep(%(worker)s, %(timeout)s);

-- name: dispatcher_leave
-- A dispatcher that stops takes its row away at once.
DELETE FROM {schema}.dispatchers WHERE worker_id = %(worker)s;

-- name: unhandled_due
-- Due pending jobs of effects no live dispatcher serves, per effect: how many, and how
-- long the oldest has waited. Looks only at the %(limit)s oldest and the %(limit)s newest
-- due jobs (the claimable index, read from both ends), so the check stays cheap behind a
-- large backlog of served effects: jobs nobody claims grow oldest, and a fresh typo is
-- among the newest. The counts are exact up to 2 x %(limit)s due jobs.
WITH due AS (
    (SELECT id, effect, available_at FROM {schema}.jobs
     WHERE status = 'pending' AND available_at <= now()
     ORDER BY available_at, id
     LIMIT %(limit)s)
    UNION
    (SELECT id, effect, available_at FROM {schema}.jobs
     WHERE status = 'pending' AND available_at <= now()
     ORDER BY available_at DESC, id DESC
     LIMIT %(limit)s)
)
SELECT effect, count(*) AS due,
       extract(epoch FROM now() - min(available_at))::float8 AS oldest_age
FROM due
WHERE NOT EXISTS (SELECT 1 FROM {schema}.dispatchers d
                  WHERE d.expires_at > now() AND due.effect = ANY(d.effects))
GROUP BY effect
ORDER BY effect;

-- name: live_dispatchers
-- The dispatchers whose heartbeat is current, with the effects each serves.
SELECT worker_id, effects, started_at,
       extract(epoch FROM now() - heartbeat_at)::float8 AS heartbeat_age
FROM {schema}.dispatchers
WHERE expires_at > now()
ORDER BY worker_id;
-- ---------------------------------------------------------------------------------------
-- Provider limits (effect_limits): budgets, throttles, the breaker and pauses, shared by
-- every dispatcher on the schema.
-- ---------------------------------------------------------------------------------------
