-- Recurring effects (outbox.Schedule, migration 0014): the dispatchers' rounds and the
-- operators' actions on the schedules table. Each slot's job is enqueued through the
-- core's enqueue (enqueue.sql) with the slot's key; these blocks keep the schedule's
-- state beside it, in the same transaction.

-- name: schedule_declare
-- A schedule declared in a dispatcher's code, upserted when it starts: written only when
-- its definition (or its source) changed, so a restart of an unchanged fleet writes
-- nothing and keeps the next slot due (the downtime's slots are then caught up). A
-- changed definition starts from %(next_slot)s. Code wins over a stored definition of
-- the same name: the previous source says whether one was replaced.
WITH previous AS (
    SELECT s.source, s.definition FROM {schema}.schedules s
    WHERE s.name = %(name)s::text FOR UPDATE
), written AS (
    INSERT INTO {schema}.schedules AS s (name, effect, definition, source, next_slot)
    VALUES (%(name)s::text, %(effect)s::text, %(definition)s::jsonb, 'code',
            %(next_slot)s::timestamptz)
    ON CONFLICT (name) DO UPDATE
    SET effect = EXCLUDED.effect, definition = EXCLUDED.definition, source = 'code',
        next_slot = CASE WHEN s.definition = EXCLUDED.definition THEN s.next_slot
                         ELSE EXCLUDED.next_slot END,
        last_error = NULL, updated_at = now()
    WHERE s.definition IS DISTINCT FROM EXCLUDED.definition OR s.source <> 'code'
    RETURNING s.name
)
SELECT (SELECT p.source FROM previous p) AS previous_source,
       (SELECT count(*) FROM written) > 0 AS written;

-- name: schedule_due
-- The schedules whose next slot is due at %(now)s (NULL: the database's clock), not
-- paused, locked for this transaction; those another dispatcher is doing are skipped.
-- Reads the partial index schedules_due only: a round costs the due rows, not the table.
SELECT s.name, s.definition::text AS definition, s.next_slot,
       coalesce(CAST(%(now)s AS timestamptz), now()) AS at
FROM {schema}.schedules s
WHERE NOT s.paused AND s.next_slot <= coalesce(CAST(%(now)s AS timestamptz), now())
ORDER BY s.next_slot
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED;

-- name: schedule_stamp
-- The slot of each job a schedule just created (job.scheduled_for).
UPDATE {schema}.jobs j
SET scheduled_for = s.at
FROM jsonb_to_recordset(CAST(%(stamps)s AS jsonb)) AS s(id bigint, at timestamptz)
WHERE j.id = s.id AND j.scheduled_for IS NULL;

-- name: schedule_advance
-- The state of each schedule of a round after it (one JSON array of {name, next_slot,
-- last_slot, job_id, error}), in the transaction that enqueued their slots.
UPDATE {schema}.schedules s
SET next_slot = a.next_slot,
    last_slot = coalesce(a.last_slot, s.last_slot),
    last_job_id = coalesce(a.job_id, s.last_job_id),
    last_error = a.error,
    updated_at = now()
FROM jsonb_to_recordset(CAST(%(advanced)s AS jsonb))
     AS a(name text, next_slot timestamptz, last_slot timestamptz, job_id bigint, error text)
WHERE s.name = a.name;

-- name: schedule_wait
-- Seconds until the next unpaused slot is due (NULL: none), one probe of schedules_due.
SELECT date_part('epoch', min(s.next_slot) - coalesce(CAST(%(now)s AS timestamptz), now()))
FROM {schema}.schedules s
WHERE NOT s.paused;

-- name: schedule_list
-- Every schedule with its state and its last job's status (NULL once retention removed
-- the job).
SELECT s.name, s.effect, s.definition::text AS definition, s.source, s.paused,
       s.next_slot, s.last_slot, s.last_job_id, j.status AS last_status, s.last_error,
       s.updated_at
FROM {schema}.schedules s
LEFT JOIN {schema}.jobs j ON j.id = s.last_job_id
ORDER BY s.name;

-- name: schedule_lock
-- One schedule, locked for an operator's change.
SELECT s.name, s.definition::text AS definition, s.source, s.paused, s.next_slot
FROM {schema}.schedules s
WHERE s.name = CAST(%(name)s AS text)
FOR UPDATE;

-- name: schedule_store
-- An operator's schedule (source 'stored'), added or changed; audited. A changed
-- definition starts from %(next_slot)s; an unchanged one keeps its state.
WITH written AS (
    INSERT INTO {schema}.schedules AS s (name, effect, definition, source, next_slot)
    VALUES (CAST(%(name)s AS text), CAST(%(effect)s AS text), CAST(%(definition)s AS jsonb),
            'stored', CAST(%(next_slot)s AS timestamptz))
    ON CONFLICT (name) DO UPDATE
    SET effect = EXCLUDED.effect, definition = EXCLUDED.definition,
        next_slot = CASE WHEN s.definition = EXCLUDED.definition THEN s.next_slot
                         ELSE EXCLUDED.next_slot END,
        last_error = NULL, updated_at = now()
    WHERE s.source = 'stored'
    RETURNING s.name
), audited AS (
    INSERT INTO {schema}.dashboard_audit (actor, action, job_id, detail, affected)
    VALUES (CAST(%(actor)s AS text), CAST(%(action)s AS text), NULL,
            jsonb_build_object('schedule', CAST(%(name)s AS text),
                               'definition', CAST(%(definition)s AS jsonb),
                               'via', CAST(%(via)s AS text)),
            (SELECT count(*) FROM written))
)
SELECT count(*) AS written FROM written;

-- name: schedule_set_paused
-- Pause or resume a schedule (code or stored); audited. A resume starts again from
-- %(next_slot)s: the slots of the pause are not caught up (a pause means "not these").
WITH changed AS (
    UPDATE {schema}.schedules s
    SET paused = CAST(%(paused)s AS boolean),
        next_slot = CASE WHEN CAST(%(paused)s AS boolean) THEN s.next_slot
                         ELSE CAST(%(next_slot)s AS timestamptz) END,
        updated_at = now()
    WHERE s.name = CAST(%(name)s AS text) AND s.paused <> CAST(%(paused)s AS boolean)
    RETURNING s.name
), audited AS (
    INSERT INTO {schema}.dashboard_audit (actor, action, job_id, detail, affected)
    VALUES (CAST(%(actor)s AS text),
            CASE WHEN CAST(%(paused)s AS boolean) THEN 'schedule_pause'
                 ELSE 'schedule_resume' END,
            NULL,
            jsonb_build_object('schedule', CAST(%(name)s AS text), 'via', CAST(%(via)s AS text)),
            (SELECT count(*) FROM changed))
)
SELECT count(*) AS changed FROM changed;

-- name: schedule_remove
-- Remove a stored schedule (a code one would come back with the next dispatcher);
-- audited. Its jobs stay.
WITH removed AS (
    DELETE FROM {schema}.schedules s
    WHERE s.name = CAST(%(name)s AS text) AND s.source = 'stored'
    RETURNING s.name
), audited AS (
    INSERT INTO {schema}.dashboard_audit (actor, action, job_id, detail, affected)
    VALUES (CAST(%(actor)s AS text), 'schedule_remove', NULL,
            jsonb_build_object('schedule', CAST(%(name)s AS text), 'via', CAST(%(via)s AS text)),
            (SELECT count(*) FROM removed))
)
SELECT count(*) AS removed FROM removed;

-- name: schedule_gauges
-- The schedules' metrics (outbox_schedule_*): at most %(limit)s of them, the unpaused
-- most overdue first, and how many unpaused schedules are overdue by %(grace)s seconds.
SELECT s.name, s.paused, date_part('epoch', s.next_slot) AS next_slot,
       date_part('epoch', s.last_slot) AS last_slot,
       count(*) FILTER (WHERE NOT s.paused
                        AND s.next_slot < now() - make_interval(secs => %(grace)s))
           OVER () AS overdue
FROM {schema}.schedules s
ORDER BY s.paused, s.next_slot, s.name
LIMIT %(limit)s;
