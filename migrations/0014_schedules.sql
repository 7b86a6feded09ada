-- Recurring effects (outbox.Schedule): one row per schedule, declared in a dispatcher's
-- code (source 'code', upserted when the dispatcher starts) or stored by an operator
-- (source 'stored': outbox schedules add, the dashboard). The row holds the schedule's
-- state, so a restart or a deploy around a slot loses nothing: the last slot enqueued
-- (and its job), and the next slot due. A dispatcher's round takes the due rows
-- (next_slot <= now, not paused: the partial index schedules_due, so a round reads only
-- them however many schedules there are) FOR UPDATE SKIP LOCKED, enqueues their slots
-- and advances next_slot in the same transaction; the slot's job key
-- (schedule:<name>:<slot>) makes a second enqueue of a slot a no-op.
--
-- A new table, a nullable column without default on jobs (a catalogue change, no
-- rewrite) and the audit trail's new actions: no long lock.

CREATE TABLE {schema}.schedules (
    name        text        PRIMARY KEY CHECK (name <> '' AND length(name) <= 200),
    effect      text        NOT NULL CHECK (effect <> ''),
    -- effect, cron or every, payload, timezone, catch_up, group, priority
    -- (outbox.Schedule.definition()).
    definition  jsonb       NOT NULL,
    source      text        NOT NULL CHECK (source IN ('code', 'stored')),
    paused      boolean     NOT NULL DEFAULT false,
    last_slot   timestamptz,
    last_job_id bigint,
    next_slot   timestamptz NOT NULL,
    -- Why the last slot could not be enqueued (the payload refused, say), else NULL.
    last_error  text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX schedules_due ON {schema}.schedules (next_slot) WHERE NOT paused;

-- The slot a schedule's job is for (job.scheduled_for); NULL for other jobs.
ALTER TABLE {schema}.jobs ADD COLUMN scheduled_for timestamptz;

-- Operators add, change, pause, resume and remove schedules from the command line and
-- the dashboard: audited in the same trail as their other actions.
ALTER TABLE {schema}.dashboard_audit DROP CONSTRAINT dashboard_audit_action_check;
ALTER TABLE {schema}.dashboard_audit ADD CONSTRAINT dashboard_audit_action_check
    CHECK (action IN ('retry', 'resolve_done', 'resolve_failed', 'cancel', 'bulk_retry',
                      'reconcile', 'pause', 'resume', 'schedule_add', 'schedule_change',
                      'schedule_pause', 'schedule_resume', 'schedule_remove'));

-- Dispatchers read and advance schedules: every role granted a privilege on the jobs
-- table (a dispatcher's role granted table by table) gets it on schedules too, so a
-- running deployment keeps working once migrated. Names from the catalogue, as 0011.
DO $grant$
DECLARE
    jobs_table oid := (SELECT t.typrelid FROM pg_type t
                       WHERE t.oid = pg_typeof(NULL::{schema}.jobs));
    schedules_table regclass := (SELECT t.typrelid::regclass FROM pg_type t
                                 WHERE t.oid = pg_typeof(NULL::{schema}.schedules));
    grant_row record;
BEGIN
    FOR grant_row IN
        SELECT DISTINCT a.privilege_type AS privilege,
               CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE a.grantee::regrole::text END AS reader
        FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a
        WHERE c.oid = jobs_table AND a.grantee <> c.relowner
          AND a.privilege_type IN ('SELECT', 'INSERT', 'UPDATE', 'DELETE')
    LOOP
        EXECUTE format('GRANT %s ON %s TO %s', grant_row.privilege, schedules_table,
                       grant_row.reader);
    END LOOP;
END
$grant$;
