-- The operators' reads beside the queue model's (queue.sql): outbox status, outbox
-- schedules and the dashboard (outbox/cli.py, outbox/web)
--
-- Named blocks, loaded by outbox/_sql.py (the core's files, CORE_FILES, bound as one set
-- of names: queries(schema).<name>). {schema} is replaced by the quoted schema identifier
-- when a block is loaded (psycopg.sql.Identifier); values are always bound parameters, by
-- name. A write about a claimed job is conditional on status = 'running' AND
-- claim_version = the claim's version, so a stale worker's write changes 0 rows. A
-- `-- fragment: X` block is no statement: its text is bound into every block of the core
-- files and the dashboard's that names {X}, so a rule used by several is written once.

-- name: effect_named
-- Whether anything has named %(effect)s: an unfinished job, a dispatcher's row, or a row of
-- effect_limits (a limit declared, a pause, a throttle); and the effects those name, for
-- an operator's typo to be told what exists. `outbox pause` asks before pausing.
SELECT (EXISTS (SELECT 1 FROM {schema}.jobs j
                WHERE j.status IN ('pending', 'running') AND j.effect = %(effect)s::text)
        OR EXISTS (SELECT 1 FROM {schema}.dispatchers d WHERE %(effect)s::text = ANY(d.effects))
        OR EXISTS (SELECT 1 FROM {schema}.effect_limits l WHERE l.effect = %(effect)s::text))
           AS named,
       ARRAY(SELECT n.effect FROM (
                 SELECT unnest(d.effects) AS effect FROM {schema}.dispatchers d
                 UNION SELECT l.effect FROM {schema}.effect_limits l) n
             ORDER BY n.effect LIMIT 20) AS known;

-- name: recent_failures
SELECT id, effect, key, status, attempts, last_error, updated_at
FROM {schema}.jobs
WHERE status IN ('failed', 'reconcile')
ORDER BY updated_at DESC, id DESC
LIMIT %(limit)s;

-- name: failed_groups
-- Failed jobs grouped by effect and error fingerprint: the error's class and message
-- with ids (long hex or prefixed tokens like req_abc123) and numbers replaced, so one
-- cause counts once however many jobs it failed. Largest groups first.
SELECT g.effect, g.fingerprint, count(*) AS jobs, max(g.updated_at) AS latest,
       min(g.sample) AS sample
FROM (
    SELECT j.effect, j.updated_at, left(j.last_error, 300) AS sample,
           regexp_replace(regexp_replace(left(coalesce(j.last_error, ''), 300),
               '[A-Za-z]+_[A-Za-z0-9]{{6,}}|[0-9a-fA-F-]{{16,}}', '<id>', 'g'),
               '[0-9]+(\.[0-9]+)?', 'N', 'g') AS fingerprint
    FROM {schema}.jobs j
    WHERE j.status = 'failed'
) g
GROUP BY g.effect, g.fingerprint
ORDER BY count(*) DESC, g.effect
LIMIT %(limit)s;
