-- Upkeep: retention of done jobs, the ledger and the inbox (claimer.py), statistics and
-- vacuum (statistics.py, vacuum.py)
--
-- Named blocks, loaded by outbox/_sql.py (the core's files, CORE_FILES, bound as one set
-- of names: queries(schema).<name>). {schema} is replaced by the quoted schema identifier
-- when a block is loaded (psycopg.sql.Identifier); values are always bound parameters, by
-- name. A write about a claimed job is conditional on status = 'running' AND
-- claim_version = the claim's version, so a stale worker's write changes 0 rows. A
-- `-- fragment: X` block is no statement: its text is bound into every block of the core
-- files and the dashboard's that names {X}, so a rule used by several is written once.

-- fragment: may_maintain
-- Whether this role may ANALYZE and VACUUM the table of pg_class row c: it owns it (or is
-- a member of its owner), or is a superuser.
(pg_has_role(c.relowner, 'USAGE')
 OR (SELECT r.rolsuper FROM pg_roles r WHERE r.rolname = current_user))

-- name: unanalyzed_tables
-- The queue tables autovacuum never analyzed that this role may ANALYZE (it owns them,
-- or is a superuser), and whether each has changed by more than its statistics describe:
-- %(rows)s changes at first, then twice the rows counted at the last ANALYZE
-- (outbox._dispatch.statistics). No row: autovacuum keeps every one's statistics now.
SELECT s.relname AS name,
       s.n_mod_since_analyze >= greatest(%(rows)s::bigint, 2 * c.reltuples::bigint) AS ready
FROM pg_stat_user_tables s
JOIN pg_class c ON c.oid = s.relid
WHERE s.schemaname = %(schema_name)s::text AND s.relname = ANY(%(tables)s::text[])
  AND s.last_autoanalyze IS NULL
  AND {may_maintain};

-- name: vacuum_due
-- The queue tables this role may VACUUM (it owns them, or is a superuser) whose dead rows
-- reached %(rows)s and %(share)s of their live ones, and that nobody (a dispatcher,
-- autovacuum) vacuumed in the last %(gap)s seconds (outbox._dispatch.vacuum). The most
-- dead rows first.
SELECT s.relname AS name
FROM pg_stat_user_tables s
JOIN pg_class c ON c.oid = s.relid
WHERE s.schemaname = %(schema_name)s::text AND s.relname = ANY(%(tables)s::text[])
  AND s.n_dead_tup >= greatest(%(rows)s::bigint, (%(share)s::float8 * s.n_live_tup)::bigint)
  AND coalesce(greatest(s.last_vacuum, s.last_autovacuum), '-infinity'::timestamptz)
      < now() - %(gap)s::float8 * interval '1 second'
  AND {may_maintain}
ORDER BY s.n_dead_tup DESC;

-- name: purge_done
-- Retention: delete done jobs older than %(age)s seconds, a batch at a time; a job that
-- waited on parents (after=[...]) takes its edges along.
WITH doomed AS (
    SELECT id FROM {schema}.jobs
    WHERE status = 'done' AND updated_at < now() - %(age)s::float8 * interval '1 second'
    ORDER BY updated_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), unlinked AS (
    DELETE FROM {schema}.after_edges e WHERE e.child_id = ANY (ARRAY(SELECT d.id FROM doomed d))
)
DELETE FROM {schema}.jobs j USING doomed d
WHERE j.id = d.id AND j.status = 'done';

-- name: purge_ledger
-- Retention of the ledger, on its own (longer) period.
WITH doomed AS (
    SELECT key FROM {schema}.effect_results
    WHERE recorded_at < now() - %(age)s::float8 * interval '1 second'
    ORDER BY recorded_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
-- The keys through an array, so the rows are found by the primary key: joined to the
-- CTE, the planner hashed it and read the whole ledger for every batch (a plan test).
DELETE FROM {schema}.effect_results r
WHERE r.key = ANY (ARRAY(SELECT d.key FROM doomed d));

-- name: purge_inbox
-- Retention of the inbox: delete rows received more than %(age)s seconds ago, at most
-- %(limit)s per call (repeat while it deletes %(limit)s). A repeat arriving after its row
-- is purged counts as new: keep the retention longer than any redelivery can lag.
WITH doomed AS (
    SELECT consumer, message_id FROM {schema}.inbox
    WHERE received_at < now() - CAST(%(age)s AS float8) * interval '1 second'
    ORDER BY received_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM {schema}.inbox i USING doomed d
WHERE i.consumer = d.consumer AND i.message_id = d.message_id;
