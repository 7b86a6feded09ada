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
-- Due pending jobs of effects no live dispatcher serves, per effect: how many (counted up
-- to 2 x %(limit)s), and how long the oldest has waited. The effects with pending jobs
-- come from a loose index scan (pending_effects, one probe each), and only an effect
-- nobody serves has its due jobs read, in its range of jobs_claimable_effect (the oldest
-- one probe): the check stays cheap behind any backlog of served effects, and a typo's
-- jobs are found however many jobs of other effects are due before or after them.
WITH RECURSIVE {pending_effects}
SELECT u.effect, u.due, u.oldest_age
FROM (
    SELECT p.effect,
           -- in the index's order: the ORDER BY holds the planner to it (with a LIMIT
           -- alone, PostgreSQL 15 may walk the table's history instead)
           (SELECT count(*) FROM (SELECT 1 FROM {schema}.jobs j
                                  WHERE j.status = 'pending' AND j.effect = p.effect
                                    AND j.available_at <= now()
                                  ORDER BY j.available_at
                                  LIMIT 2 * %(limit)s::integer) d) AS due,
           extract(epoch FROM now() - (
               SELECT min(j.available_at) FROM {schema}.jobs j
               WHERE j.status = 'pending' AND j.effect = p.effect
                 AND j.available_at <= now()))::float8 AS oldest_age
    FROM pending_effects p
    WHERE p.effect IS NOT NULL
      AND NOT EXISTS (SELECT 1 FROM {schema}.dispatchers d
                      WHERE d.expires_at > now() AND p.effect = ANY(d.effects))
    OFFSET 0  -- a subquery of its own: flattened, the count would run again for the WHERE
) u
WHERE u.due > 0
ORDER BY u.effect;

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
