-- Every statement outbox runs, as named blocks. {schema} is replaced by the quoted schema
-- identifier when the block is loaded (psycopg.sql.Identifier); values are always bound
-- parameters, by name. Each state transition is one guarded statement: a write about a
-- claimed job is conditional on status = 'running' AND claim_version = the claim's
-- version, so a stale worker's write changes 0 rows. A `-- fragment: X` block is no
-- statement: its text is bound into every block (of this file, queue.sql, flows.sql or
-- the dashboard's) that names {X}, so a rule used by several statements is written once.

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
INSERT INTO {schema}.jobs (effect, key, payload, fingerprint, available_at, ordering_key, max_attempts,
                           trace_context, group_key, priority)
SELECT CAST(%(effect)s AS text), CAST(%(key)s AS text), CAST(%(payload)s AS jsonb),
       CAST(%(fingerprint)s AS text), coalesce(CAST(%(run_at)s AS timestamptz), now()),
       CAST(%(ordering_key)s AS text), CAST(%(max_attempts)s AS integer),
       CAST(%(trace_context)s AS jsonb), CAST(%(group_key)s AS text),
       CAST(%(priority)s AS integer)
WHERE NOT EXISTS (SELECT 1 FROM {schema}.effect_results r WHERE r.key = CAST(%(key)s AS text))
ON CONFLICT (key) DO NOTHING
RETURNING id,
    (SELECT count(*) FROM (
        SELECT pg_notify(CAST(%(channel)s AS text), '')
        WHERE current_setting('transaction_isolation') <> 'read committed'
           OR NOT EXISTS (SELECT 1 FROM {schema}.awake a
                          WHERE a.effect = CAST(%(effect)s AS text) AND a.until > now())) n)
    AS notified;

-- name: enqueue_many
-- The bulk path: one statement for any number of jobs, created ids out. The jobs arrive
-- as one JSON array (each payload already canonical JSON, embedded as is): one
-- parameter, parsed by the server, however many jobs. The batch shares one enqueue span,
-- so one trace context (NULL when tracing is off).
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
           CAST(%(trace_context)s AS jsonb), w.group_key, w.priority
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

-- name: lookup_keys
-- What already holds each key: a job (id, effect, fingerprint) or only the ledger.
SELECT k.key, j.id, coalesce(j.effect, r.effect) AS effect,
       coalesce(j.fingerprint, r.fingerprint) AS fingerprint
FROM unnest(CAST(%(keys)s AS text[])) AS k(key)
LEFT JOIN {schema}.jobs j ON j.key = k.key
LEFT JOIN {schema}.effect_results r ON r.key = k.key;

-- fragment: claimable
-- Whether the job j is one a claim takes now, whatever its effect: pending, due, not in
-- a group an operator paused (group_pauses), and not held back by its ordering key (a
-- job with a key is claimable only when no earlier job of that key is pending and none
-- is running). Written once: the claims (claim, limit_claim), has_due_work and the queue
-- model's "due" (queue.sql) all bind it.
(j.status = 'pending'
 AND j.available_at <= now()
 -- A scalar subquery (one primary-key probe per candidate), not NOT EXISTS: the planner
 -- would make that an anti join, which costs the claims their index-ordered scans (a
 -- sort of a whole group's backlog per claim, measured).
 -- The probe is skipped while no group is paused at all (an uncorrelated test, run once
 -- a statement): a probe per candidate of an empty table cost the claim 0.6 µs of the
 -- server's CPU a job (2,000 jobs a claim, measured).
 AND (NOT EXISTS (SELECT FROM {schema}.group_pauses)
      OR NOT coalesce((SELECT gp.paused_until > now() FROM {schema}.group_pauses gp
                       WHERE gp.effect = j.effect AND gp.group_key = coalesce(j.group_key, '')),
                      false))
 -- The ordering key: j heads its key's line (the lowest id among the key's pending and
 -- running jobs: one probe of jobs_ordering, whose predicate this matches) and none of
 -- the key's jobs runs (looked at for the heads only). Written as a NOT EXISTS over
 -- "earlier or running" rows, the planner chose a scan of the table per candidate
 -- whenever the statistics showed a long line behind one key: quadratic in the line.
 -- The running look is a scalar subquery too: as NOT EXISTS the planner may hash every
 -- running job of the table (the leases' index) for each statement, as the sampled
 -- statistics lead it; as a probe of jobs_ordering it reads one row a head.
 AND (j.ordering_key IS NULL OR (
       (SELECT o.id FROM {schema}.jobs o
        WHERE o.ordering_key = j.ordering_key AND o.status IN ('pending', 'running')
        ORDER BY o.id LIMIT 1) = j.id
       AND NOT coalesce((SELECT true FROM {schema}.jobs o
                         WHERE o.ordering_key = j.ordering_key AND o.status = 'running'
                         LIMIT 1), false))))

-- fragment: claim_taken
-- The locked candidates (a CTE of ids) to running, at the time in the CTE clock (one row,
-- at): the claim counted as an attempt, a new claim_version (the fence), the lease taken.
-- The UPDATE repeats status = 'pending': EvalPlanQual rechecks only the UPDATE's own
-- conditions, so without the guard a session that waited on a row another session just
-- claimed would claim it too. The ids go through an array so the UPDATE probes the
-- primary key instead of letting the planner hash-join against every pending row.
UPDATE {schema}.jobs j
SET status = 'running',
    attempts = j.attempts + 1,
    claim_version = j.claim_version + 1,
    lease_until = (SELECT at FROM clock) + %(lease)s::float8 * interval '1 second',
    claimed_by = %(worker)s::text,
    first_attempted_at = coalesce(j.first_attempted_at, (SELECT at FROM clock)),
    updated_at = (SELECT at FROM clock)
WHERE j.id = ANY (ARRAY(SELECT id FROM candidates)) AND j.status = 'pending'
-- The payload as text: json.loads on a str costs a fraction of psycopg's jsonb loader,
-- and a claim decodes thousands of them.
RETURNING j.id, j.effect, j.key, j.payload::text, j.attempts, j.claim_version, j.ordering_key,
          j.max_attempts, j.first_attempted_at,
          -- how long the job had been due: the queue wait reported to observers
          -- (date_part gives float8 directly; extract() would compute a numeric)
          greatest(date_part('epoch', (SELECT at FROM clock) - j.available_at), 0) AS waited,
          -- the enqueue's span, for the attempt's span to link to (NULL when not traced)
          j.trace_context,
          -- the provider's answer kept after a completion hook raised: reused, not re-performed
          CAST(j.performed_result AS text) AS performed_result,
          j.group_key, j.priority,
          -- the slot of the schedule that enqueued the job (outbox.Schedule), else NULL
          j.scheduled_for,
          -- set only for a job that waited on parents (after=[...]): its claim reads their
          -- results (outbox._after), no other claim does
          j.after_failed

-- fragment: fair_busy
-- The busy groups of each effect in served (effect, after: where this dispatcher's last
-- claim of the effect stopped, '' at first), in turn: the groups after it in "C" order,
-- then from the first group around to it again, at most allowance.n per effect. Each
-- step is one probe of the index jobs_fair (a loose index scan), whatever the size of
-- a group; the NULL group walks as ''. The first row of an effect (n = 0) is the
-- starting point, not a group.
busy(effect, after, g, wrapped, n) AS (
    SELECT s.effect, s.after, s.after, false, 0 FROM served s
    UNION ALL
    SELECT b.effect, b.after, y.g, y.wrapped, b.n + 1
    FROM busy b
    -- OFFSET 0 keeps each probe a subquery of its own, run once a step: flattened,
    -- the planner copied the probe into every reference to its result (six index
    -- probes a step instead of one, measured).
    CROSS JOIN LATERAL (
        SELECT (SELECT coalesce(j.group_key, '') FROM {schema}.jobs j
                WHERE j.status = 'pending' AND j.effect = b.effect
                  AND coalesce(j.group_key, '') > b.g
                ORDER BY coalesce(j.group_key, '') LIMIT 1) AS nxt
        OFFSET 0
    ) x
    CROSS JOIN LATERAL (
        SELECT CASE WHEN x.nxt IS NOT NULL OR b.wrapped THEN x.nxt
                    ELSE (SELECT coalesce(j.group_key, '') FROM {schema}.jobs j
                          WHERE j.status = 'pending' AND j.effect = b.effect
                          ORDER BY coalesce(j.group_key, '') LIMIT 1) END AS g,
               b.wrapped OR x.nxt IS NULL AS wrapped
        OFFSET 0
    ) y
    WHERE b.n < (SELECT a.n FROM allowance a) AND y.g IS NOT NULL
      AND (NOT y.wrapped OR y.g <= b.after)
)

-- fragment: fair_candidates
-- Fair claiming: the head of each busy group's claimable jobs (fragment claimable), in
-- claim_rank order (priority with ageing, migration 0010), a share of the claim each,
-- at most capped.cap of a group (NULL: no cap; 0: none, and no scan); then taken in turns: every group's first
-- job before any group's second, so a group's backlog delays another group's jobs by at
-- most one turn. Needs the CTEs clock, served, allowance, busy (fair_busy) and capped
-- (effect, g, cap) before it.
shares AS (
    SELECT greatest(1, ceil((SELECT a.n FROM allowance a)::float8
                            / greatest(1, count(*))))::integer AS n
    FROM busy b WHERE b.n > 0
), heads AS (
    SELECT c.effect, c.g, c.cap, h.id, h.rank
    FROM capped c CROSS JOIN LATERAL (
        SELECT j.id, {schema}.claim_rank(j.available_at, j.priority) AS rank
        FROM {schema}.jobs j
        WHERE {claimable} AND j.effect = c.effect AND coalesce(j.group_key, '') = c.g
          -- An index bound no due job passes (priority >= -1000 ranks it at most 10,000 s
          -- past now): the walk stops before the jobs far ahead (waiting on parents, or
          -- scheduled late) instead of reading each to find it not due.
          AND {schema}.claim_rank(j.available_at, j.priority)
              <= date_part('epoch', now()) + 10000.0
        ORDER BY {schema}.claim_rank(j.available_at, j.priority), j.id
        LIMIT least((SELECT s.n FROM shares s), c.cap)
        FOR UPDATE SKIP LOCKED
    ) h
), fair_picks AS (
    SELECT t.id
    FROM (SELECT hd.id, hd.rank, hd.cap,
                 row_number() OVER (PARTITION BY hd.effect, hd.g ORDER BY hd.rank, hd.id) AS turn
          FROM heads hd) t
    WHERE t.cap IS NULL OR t.turn <= t.cap
    ORDER BY t.turn, t.rank, t.id
    LIMIT (SELECT a.n FROM allowance a)
), missing AS (
    -- what the turns left of the allowance, for the top-up to fill
    SELECT greatest(0, (SELECT a.n FROM allowance a)
                       - (SELECT count(*) FROM fair_picks))::bigint AS n
), topped_up AS (
    -- A busy group is one with pending jobs, not necessarily claimable ones (a retry not
    -- due yet, an ordering key's later job), and a small group fills less than its
    -- share: what the turns left of the allowance is filled with the oldest due jobs, so
    -- a claim is never short while claimable jobs wait. Oldest by available_at, the
    -- order of the index jobs_claimable_effect, walked per served effect (the effect an
    -- index condition) and merged: the top-up reads about as many entries as it takes of
    -- each effect, and never the backlog of an effect it does not serve. In claim_rank
    -- order no index serves it across groups, and each claim read and sorted the whole
    -- backlog (0.3 to 0.7 s behind 100,000 jobs, measured); walked across effects in
    -- jobs_claimable, a claim of an effect with nothing due read every due job of the
    -- others (0.1 s a claim behind another effect's 100,000, measured). Each effect locks
    -- at most what is missing; what the merge leaves out is unlocked at the claim's commit.
    SELECT t.id
    FROM served s CROSS JOIN LATERAL (
        SELECT j.id, j.available_at
        FROM {schema}.jobs j
        -- The effect as a range of one value, not an equality: an equality makes the
        -- planner drop the effect from the ORDER BY (fixed in the subquery) and walk
        -- jobs_claimable instead, filtering on the effect (every due job of the others,
        -- read to find none). Ordered by effect first, only jobs_claimable_effect
        -- gives the order without a sort.
        WHERE {claimable} AND j.effect >= s.effect AND j.effect <= s.effect
          AND j.id <> ALL (ARRAY(SELECT f.id FROM fair_picks f))
          -- groups capped by a limit per group are never topped up past their cap
          AND NOT EXISTS (SELECT 1 FROM capped c WHERE c.cap IS NOT NULL)
        ORDER BY j.effect, j.available_at, j.id
        LIMIT (SELECT m.n FROM missing m)
        FOR UPDATE SKIP LOCKED
    ) t
    ORDER BY t.available_at, t.id
    LIMIT (SELECT m.n FROM missing m)
), candidates AS (
    SELECT f.id FROM fair_picks f
    UNION ALL
    SELECT u.id FROM topped_up u
)

-- name: claim
-- Claim up to %(limit)s due jobs of %(effects)s, fairly across their groups (fragments
-- fair_busy and fair_candidates); %(after)s (a JSON object effect -> group) says where
-- this dispatcher's previous claim of each effect stopped.
WITH RECURSIVE clock AS (
    SELECT now() AS at
), served AS (
    SELECT e.effect, coalesce(CAST(%(after)s AS jsonb) ->> e.effect, '') COLLATE "C" AS after
    FROM unnest(%(effects)s::text[]) AS e(effect)
), allowance AS (
    SELECT %(limit)s::integer AS n
), {fair_busy}, capped AS (
    SELECT b.effect, b.g, NULL::integer AS cap FROM busy b WHERE b.n > 0
), {fair_candidates}
{claim_taken};

-- name: heartbeat
-- Extend the leases of the claims this worker still holds; ids missing from the result
-- are claims it has lost; cancel says an operator asked this claim to stop (outbox
-- cancel: the fallback of its notification). Batches arrive as one JSON array of {id, version, ...}
-- objects: one parameter, parsed by the server, whatever the batch size.
UPDATE {schema}.jobs j
SET lease_until = now() + %(lease)s::float8 * interval '1 second'
FROM jsonb_to_recordset(%(claims)s::jsonb) AS h(id bigint, version bigint)
WHERE j.id = h.id AND j.status = 'running' AND j.claim_version = h.version
RETURNING j.id, j.cancel_version IS NOT DISTINCT FROM j.claim_version AS cancel;

-- fragment: recorded
-- The ledger row of each job the fenced status change in the CTE finished took (its id,
-- key, effect, claim_version, fingerprint and result), written in the same statement: a
-- ledger row is never written otherwise. A key already in the ledger keeps its row.
recorded AS (
    INSERT INTO {schema}.effect_results (key, effect, job_id, claim_version, result, fingerprint)
    SELECT f.key, f.effect, f.id, f.claim_version, f.result, f.fingerprint FROM finished f
    ON CONFLICT (key) DO NOTHING
)

-- name: complete
-- running -> done and the ledger row, in one statement and so in one transaction.
WITH finished AS (
    UPDATE {schema}.jobs j
    SET status = 'done', lease_until = NULL, claimed_by = NULL, last_error = NULL,
        updated_at = now()
    FROM jsonb_to_recordset(%(claims)s::jsonb) AS d(id bigint, version bigint, result jsonb)
    WHERE j.id = d.id AND j.status = 'running' AND j.claim_version = d.version
    RETURNING j.id, j.key, j.effect, j.claim_version, j.fingerprint, d.result
), {recorded}, parents AS (
    -- jobs waiting on these (after=[...]) count them done (fragment after_released)
    SELECT f.key, 'done'::text AS outcome, NULL::text AS error FROM finished f
), {after_released}
SELECT f.id FROM finished f;

-- ---------------------------------------------------------------------------------------
-- Delete on done (retention = 0): no done rows are kept, so completion deletes the job.
-- ---------------------------------------------------------------------------------------

-- name: complete_delete
-- running -> gone and the ledger row, in one statement and so in one transaction; fenced
-- exactly like complete, so a stale claim deletes nothing and writes no ledger row. A
-- delete adds no index entries where the done update adds one to every index of the
-- table, and leaves no row for retention to delete later. Enqueue dedup then rests on
-- the ledger row alone, which recorded_claims reads too.
WITH finished AS (
    DELETE FROM {schema}.jobs j
    USING jsonb_to_recordset(%(claims)s::jsonb) AS d(id bigint, version bigint, result jsonb)
    WHERE j.id = d.id AND j.status = 'running' AND j.claim_version = d.version
    RETURNING j.id, j.key, j.effect, j.claim_version, j.fingerprint, d.result, j.after_failed
), {recorded}, parents AS (
    -- jobs waiting on these (after=[...]) count them done (fragment after_released)
    SELECT f.key, 'done'::text AS outcome, NULL::text AS error FROM finished f
), {after_released}, unlinked AS (
    -- A deleted job's own edges (it waited on parents) go with it: looked for by the
    -- primary key, and only for jobs that had parents (after_failed is set), so none is
    -- looked for while after=[...] is unused.
    DELETE FROM {schema}.after_edges e
    WHERE e.child_id = ANY (ARRAY(SELECT f.id FROM finished f
                                  WHERE f.after_failed IS NOT NULL))
)
SELECT f.id FROM finished f;

-- name: recorded_claims
-- Which of these claims already completed: after a lost reply, tells "my own done
-- landed" apart from "my claim was lost".
SELECT r.job_id
FROM {schema}.effect_results r
JOIN jsonb_to_recordset(%(claims)s::jsonb) AS c(id bigint, version bigint)
  ON r.job_id = c.id AND r.claim_version = c.version;

-- name: settle
-- running -> pending (retry, or release with the attempt refunded), failed or reconcile:
-- the decisions of outbox._lifecycle (settle, and expired for the rescuer's). A claim the
-- rescuer found expired (expired: true) is also fenced on its lease still being expired,
-- so a heartbeat that commits first wins.
-- A claim an operator cancelled (cancel_version) never goes back to pending: failed.
-- A job failed for good settles the jobs waiting on it (fragment after_released).
WITH settled AS (
UPDATE {schema}.jobs j
SET status = CASE WHEN s.status = 'pending' AND j.cancel_version = j.claim_version
                  THEN 'failed' ELSE s.status END,
    attempts = j.attempts - CASE WHEN s.refund THEN 1 ELSE 0 END,
    available_at = CASE WHEN s.status = 'pending'
                        THEN now() + s.delay * interval '1 second'
                        ELSE j.available_at END,
    last_error = CASE WHEN s.status = 'pending' AND j.cancel_version = j.claim_version
                      THEN 'cancelled by an operator while running'
                           || coalesce(': ' || s.error, '')
                      ELSE coalesce(s.error, j.last_error) END,
    lease_until = NULL,
    claimed_by = NULL,
    updated_at = now()
FROM jsonb_to_recordset(%(claims)s::jsonb)
     AS s(id bigint, version bigint, status text, delay float8, error text, refund boolean,
          expired boolean)
WHERE j.id = s.id AND j.status = 'running' AND j.claim_version = s.version
  AND (s.expired IS NOT TRUE OR j.lease_until < now())
RETURNING j.id, j.key, j.status, j.last_error
), parents AS (
    SELECT t.key, 'failed'::text AS outcome, t.last_error AS error
    FROM settled t WHERE t.status = 'failed'
), {after_released}
SELECT t.id FROM settled t;

-- name: rescue
-- Claims whose lease expired (the worker died or stalled), oldest first, with what the
-- rescuer's decision (outbox._lifecycle.expired: an unknown outcome, settled as one)
-- reads, and the database's clock to decide with. Rows another session has locked (a
-- heartbeat or an outcome being written) are skipped. Nothing is written here: the
-- decisions are applied by settle, fenced on the claim_version read here and on the
-- lease still being expired, so a heartbeat or an outcome that commits first wins.
SELECT j.id, j.effect, j.key, j.attempts, j.claim_version, j.ordering_key, j.max_attempts,
       j.first_attempted_at, j.claimed_by, j.group_key, j.priority, j.scheduled_for,
       j.cancel_version IS NOT DISTINCT FROM j.claim_version AS cancelled, now() AS now
FROM {schema}.jobs j
WHERE j.status = 'running' AND j.lease_until < now()
ORDER BY j.lease_until
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED;

-- name: rescued_payloads
-- The payloads of the rescued jobs whose on_failed hook runs (a Job carries its payload).
SELECT j.id, CAST(j.payload AS text) AS payload
FROM {schema}.jobs j
WHERE j.id = ANY(%(ids)s::bigint[]);

-- name: schema_version
-- The version the schema is migrated to, checked by a running dispatcher now and then:
-- a newer one than its code knows stops it (deploy the release that migrated it).
SELECT coalesce(max(version), 0) AS version FROM {schema}.schema_migrations;

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

-- name: has_due_work
-- Whether this dispatcher may still have work: a claimable job, or a running job of its
-- effects (another worker's, which may fail back to pending or be rescued if its lease
-- expires).
SELECT EXISTS (
    SELECT 1 FROM {schema}.jobs j
    WHERE {claimable} AND j.effect = ANY(%(effects)s::text[])
) OR EXISTS (
    SELECT 1 FROM {schema}.jobs j
    WHERE j.status = 'running' AND j.effect = ANY(%(effects)s::text[])
);

-- name: effect_claimable
-- Whether a job of %(effect)s is claimable now (fragment claimable): a claim of an effect
-- under a shared limit asks this before it takes tokens from the limits home, so that an
-- idle target never holds the shared budget.
SELECT EXISTS (
    SELECT 1 FROM {schema}.jobs j
    WHERE {claimable} AND j.effect = %(effect)s::text
) AS claimable;

-- name: target_due
-- Whether a dispatcher serving several targets should give this one a turn: a job of
-- %(effects)s claimable now (fragment claimable), or one whose lease expired (its worker
-- died: a turn rescues it). Running jobs held by live workers elsewhere are theirs.
SELECT EXISTS (
    SELECT 1 FROM {schema}.jobs j
    WHERE {claimable} AND j.effect = ANY(%(effects)s::text[])
) OR EXISTS (
    SELECT 1 FROM {schema}.jobs j
    WHERE j.status = 'running' AND j.lease_until < now()
      AND j.effect = ANY(%(effects)s::text[])
) AS due;

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

-- name: recent_failures
SELECT id, effect, key, status, attempts, last_error, updated_at
FROM {schema}.jobs
WHERE status IN ('failed', 'reconcile')
ORDER BY updated_at DESC, id DESC
LIMIT %(limit)s;

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

-- name: limit_states
-- The limit state of these effects, read by the claimer each round: which must be
-- claimed through their budget (gated) and which are paused, until when and why.
SELECT l.effect,
       (l.declared_at > now() - interval '60 seconds'
        AND (l.rate IS NOT NULL OR l.concurrency IS NOT NULL))
       OR (l.learned_rate IS NOT NULL AND l.throttled_at > now() - interval '60 seconds')
       OR l.group_declared_at > now() - interval '60 seconds'
       OR l.opened > 0
       OR l.paused_until > now() AS gated,
       CASE WHEN l.paused_until > now()
            THEN date_part('epoch', l.paused_until - now()) END AS pause_left,
       CASE WHEN l.paused_until > now() THEN l.pause_reason END AS pause_reason,
       l.failures + l.opened AS troubled
FROM {schema}.effect_limits l
WHERE l.effect = ANY(%(effects)s::text[]);

-- name: limit_claim
-- Claim up to %(limit)s jobs of one limited effect within its budget: the core claim
-- (fragments claimable and claim_taken) narrowed to the effect, limited to what
-- limit_budget allows and stamped with its clock, between the budget and limit_spend
-- (migration 0009), all in this statement's transaction. The budget is taken before
-- the candidates are scanned (their LIMIT needs it), and it locks the effect's row
-- until the commit. A limit per group (%(group_rate)s, %(group_burst)s,
-- %(group_concurrency)s; migration 0012) caps what the fair claim takes of each group
-- walked (capped, from limit_group_caps after the lock) and spends the groups' buckets;
-- with caps, no top-up passes them. Every row answered carries budget_wait: when a
-- budget (not the queue) stopped the claim, the seconds until it is worth asking again,
-- else NULL; and walked_to, the last group the claim looked at, where the next claim of
-- the effect starts (so groups at their cap do not hold the turn). When no job was
-- claimed, the one row answered holds those alone (its job columns NULL).
WITH RECURSIVE budget AS MATERIALIZED (
    SELECT {schema}.limit_budget(%(effect)s::text, %(limit)s::integer, %(rate)s::float8,
                                 %(burst)s::float8, %(concurrency)s::integer) AS b
), clock AS (
    SELECT (x.b).at AS at FROM budget x
), served AS (
    SELECT %(effect)s::text AS effect,
           coalesce(CAST(%(after)s AS jsonb) ->> %(effect)s::text, '') COLLATE "C" AS after
), allowance AS (
    SELECT (x.b).allowed AS n FROM budget x
), {fair_busy}, group_caps AS MATERIALIZED (
    SELECT gc.g, gc.cap, gc.wait
    FROM {schema}.limit_group_caps(%(effect)s::text,
                                   ARRAY(SELECT b.g FROM busy b WHERE b.n > 0),
                                   %(group_rate)s::float8, %(group_burst)s::float8,
                                   %(group_concurrency)s::integer,
                                   (SELECT at FROM clock)) gc
), capped AS (
    SELECT b.effect, b.g, gc.cap
    FROM busy b JOIN group_caps gc ON gc.g = b.g
    WHERE b.n > 0
), {fair_candidates}, claimed AS (
    {claim_taken}
), spent AS (
    SELECT {schema}.limit_spend(%(effect)s::text, x.b, %(limit)s::integer, %(lease)s::float8,
                                %(rate)s::float8, %(burst)s::float8, %(concurrency)s::integer,
                                (SELECT count(*)::integer FROM claimed),
                                (SELECT max(c.id) FROM claimed c)) AS wait,
           (SELECT min(gc.wait) FROM group_caps gc) AS group_wait,
           (SELECT count(*) FROM claimed) AS taken,
           -- the groups' buckets spent (an output column, so that it is computed)
           {schema}.limit_group_spend(%(effect)s::text,
               (SELECT jsonb_object_agg(t.g, t.n)
                FROM (SELECT coalesce(c.group_key, '') AS g, count(*) AS n
                      FROM claimed c GROUP BY 1) t),
               (SELECT at FROM clock)) AS groups_spent
    FROM budget x
)
SELECT c.*,
       CASE WHEN s.taken < %(limit)s::integer
            THEN least(s.wait, CASE WHEN s.group_wait IS NOT NULL
                                    THEN greatest(0.005, s.group_wait) END)
            ELSE s.wait END AS budget_wait,
       (SELECT b.g FROM busy b ORDER BY b.n DESC LIMIT 1) AS walked_to,
       s.groups_spent
FROM spent s LEFT JOIN claimed c ON true;

-- name: limit_ensure
-- The effect's limit row, made when it has none yet (the statements below update it).
INSERT INTO {schema}.effect_limits (effect, tokens) VALUES (%(effect)s::text, 1e9)
ON CONFLICT (effect) DO NOTHING;

-- name: limit_throttled
-- The provider refused %(count)s performs of the effect for load: pause it for every
-- dispatcher until %(after)s seconds from now (NULL: an adaptive pause growing with
-- throttles in a row), cut its rate factor (at most once a second, whatever the number
-- of refusals in flight), and learn a rate when none is declared: the provider's own
-- figure (%(hint)s) when it gave one, else what was completed in the last two seconds.
-- An operator's pause is kept as it is. The row exists (limit_ensure).
WITH current AS (
    SELECT l.effect,
           l.factor + 0.1 * coalesce(date_part('epoch',
               now() - greatest(l.throttled_at, l.paused_until)), 1e9) AS grown,
           l.throttled_at IS NULL OR l.throttled_at < now() - interval '1 second' AS cut,
           CASE WHEN l.throttled_at > now() - interval '10 seconds'
                THEN l.throttles ELSE 0 END AS in_a_row,
           coalesce(l.declared_at > now() - interval '60 seconds' AND l.rate IS NOT NULL,
                    false) AS declared,
           coalesce(l.learned_rate IS NOT NULL
                    AND l.throttled_at > now() - interval '60 seconds', false) AS learned,
           coalesce(l.pause_reason = 'operator' AND l.paused_until > now(), false)
               AS operator_paused,
           CASE WHEN l.paused_until > now() THEN l.paused_until END AS active_until
    FROM {schema}.effect_limits l WHERE l.effect = %(effect)s::text
    FOR UPDATE
)
UPDATE {schema}.effect_limits l
SET learned_rate = CASE
        WHEN c.declared THEN l.learned_rate
        WHEN %(hint)s::float8 IS NOT NULL THEN %(hint)s::float8
        WHEN NOT c.cut THEN l.learned_rate
        WHEN c.learned THEN greatest(0.5, l.learned_rate * c.grown)
        ELSE (SELECT greatest(0.5, count(*) / 2.0) FROM {schema}.effect_results r
              WHERE r.recorded_at > now() - interval '2 seconds'
                AND r.effect = %(effect)s::text) END,
    factor = CASE WHEN NOT c.cut THEN l.factor
                  WHEN c.declared THEN greatest(0.05, least(1.0, c.grown) * 0.7)
                  ELSE 0.7 END,
    throttled_at = CASE WHEN c.cut THEN now() ELSE l.throttled_at END,
    throttles = CASE WHEN c.cut THEN c.in_a_row + 1 ELSE l.throttles END,
    throttled_total = l.throttled_total + %(count)s::integer,
    tokens = 1e9,
    paused_until = CASE WHEN c.operator_paused THEN l.paused_until
        ELSE greatest(c.active_until, now() + coalesce(%(after)s::float8,
                 least(30.0, power(2.0, least(c.in_a_row, 5)))) * interval '1 second') END,
    pause_reason = CASE WHEN c.operator_paused THEN l.pause_reason ELSE 'throttled' END,
    paused_by = CASE WHEN c.operator_paused THEN l.paused_by END,
    updated_at = now()
FROM current c
WHERE l.effect = c.effect
RETURNING l.effect, date_part('epoch', l.paused_until - now()) AS pause_left, l.pause_reason;

-- name: limit_group_throttled
-- The provider account of one group (%(group)s, '' for no group) of an effect limited
-- per group refused %(count)s performs for load: pause that group only, for every
-- dispatcher, until %(after)s seconds from now (NULL: an adaptive pause growing with
-- throttles in a row, as an effect's), empty its bucket and cut its rate factor (at
-- most once a second); the effect's other groups go on (migration 0012).
INSERT INTO {schema}.group_limits AS gl
    (effect, group_key, tokens, refilled_at, factor, throttled_at, throttles,
     throttled_total, paused_until, updated_at)
VALUES (%(effect)s::text, %(group)s::text, 0, now(), 0.7, now(), 1, %(count)s::integer,
        now() + coalesce(%(after)s::float8, 1.0) * interval '1 second', now())
ON CONFLICT (effect, group_key) DO UPDATE
SET factor = CASE WHEN gl.throttled_at > now() - interval '1 second' THEN gl.factor
                  ELSE greatest(0.05, least(1.0, gl.factor + 0.1 * coalesce(date_part('epoch',
                           now() - greatest(gl.throttled_at, gl.paused_until)), 1e9)) * 0.7)
             END,
    throttles = CASE WHEN gl.throttled_at > now() - interval '1 second' THEN gl.throttles
                     WHEN gl.throttled_at > now() - interval '10 seconds' THEN gl.throttles + 1
                     ELSE 1 END,
    throttled_at = CASE WHEN gl.throttled_at > now() - interval '1 second' THEN gl.throttled_at
                        ELSE now() END,
    throttled_total = gl.throttled_total + %(count)s::integer,
    tokens = 0,
    refilled_at = now(),
    paused_until = greatest(CASE WHEN gl.paused_until > now() THEN gl.paused_until END,
        now() + coalesce(%(after)s::float8, least(30.0, power(2.0, least(
            CASE WHEN gl.throttled_at > now() - interval '10 seconds' THEN gl.throttles
                 ELSE 0 END, 5)))) * interval '1 second'),
    updated_at = now()
RETURNING gl.effect, gl.group_key, date_part('epoch', gl.paused_until - now()) AS pause_left;

-- name: limit_failed
-- %(count)s performs of the effect (jobs %(jobs)s) failed transiently (connection
-- errors, timeouts, 5xx): count them in a row; at %(threshold)s, or when the probe of
-- an open breaker is among them, open the breaker:
-- pause the effect for every dispatcher, the pause growing with each opening in a row
-- (%(pause)s seconds doubled each time, at most %(max_pause)s). While the breaker's
-- pause lasts, late failures of jobs started before it change nothing. The row exists
-- (limit_ensure).
WITH current AS (
    SELECT l.effect,
           coalesce(l.paused_until > now() AND l.pause_reason IN ('outage', 'operator'),
                    false) AS holding,
           l.failures + %(count)s::integer >= %(threshold)s::integer
               OR (l.opened > 0 AND NOT coalesce(l.paused_until > now(), false)
                   AND l.probe_job = ANY(CAST(%(jobs)s AS bigint[]))) AS opens
    FROM {schema}.effect_limits l WHERE l.effect = %(effect)s::text
    FOR UPDATE
)
UPDATE {schema}.effect_limits l
SET failures = CASE WHEN c.holding THEN l.failures
                    WHEN c.opens THEN 0 ELSE l.failures + %(count)s::integer END,
    opened = CASE WHEN c.opens AND NOT c.holding THEN l.opened + 1 ELSE l.opened END,
    paused_until = CASE WHEN c.holding OR NOT c.opens THEN l.paused_until
        ELSE greatest(CASE WHEN l.paused_until > now() THEN l.paused_until END,
                      now() + least(%(max_pause)s::float8,
                                    %(pause)s::float8 * power(2.0, least(l.opened, 20)))
                              * interval '1 second') END,
    pause_reason = CASE WHEN c.holding OR NOT c.opens THEN l.pause_reason ELSE 'outage' END,
    paused_by = CASE WHEN c.holding OR NOT c.opens THEN l.paused_by END,
    probe_until = CASE WHEN c.opens AND NOT c.holding THEN NULL ELSE l.probe_until END,
    probe_job = CASE WHEN c.opens AND NOT c.holding THEN NULL ELSE l.probe_job END,
    updated_at = now()
FROM current c
WHERE l.effect = c.effect
RETURNING l.effect, date_part('epoch', l.paused_until - now()) AS pause_left, l.pause_reason;

-- name: limit_succeeded
-- A perform of the effect succeeded: the failures in a row end, and an open breaker
-- closes (its pause ends, unless an operator's or a throttle's pause holds).
UPDATE {schema}.effect_limits l
SET failures = 0, opened = 0, probe_until = NULL, probe_job = NULL,
    paused_until = CASE WHEN l.pause_reason = 'outage' THEN NULL ELSE l.paused_until END,
    pause_reason = CASE WHEN l.pause_reason = 'outage' THEN NULL ELSE l.pause_reason END,
    updated_at = now()
WHERE l.effect = %(effect)s::text AND (l.failures > 0 OR l.opened > 0)
RETURNING l.effect;

-- name: limit_pause
-- An operator pauses the effect for every dispatcher, until %(seconds)s from now (NULL:
-- until resumed), and the action is audited in the same transaction.
WITH paused AS (
    INSERT INTO {schema}.effect_limits AS l (effect, tokens, paused_until, pause_reason, paused_by)
    VALUES (%(effect)s::text, 1e9,
            -- no end given: until resumed (a century stands for that: date arithmetic on
            -- 'infinity' fails before PostgreSQL 17)
            now() + coalesce(%(seconds)s::float8 * interval '1 second', interval '100 years'),
            'operator', %(actor)s::text)
    ON CONFLICT (effect) DO UPDATE
    SET paused_until = EXCLUDED.paused_until, pause_reason = 'operator',
        paused_by = EXCLUDED.paused_by, updated_at = now()
    RETURNING l.effect, l.paused_until
), audited AS (
    INSERT INTO {schema}.dashboard_audit (actor, action, detail, affected)
    SELECT %(actor)s::text, 'pause',
           jsonb_build_object('effect', p.effect, 'seconds', %(seconds)s::float8), 1
    FROM paused p
)
SELECT effect, paused_until FROM paused;

-- name: limit_resume
-- An operator resumes the effect: any pause ends (an open breaker's too; the next claim
-- is its probe), and the action is audited in the same transaction.
WITH resumed AS (
    UPDATE {schema}.effect_limits l
    SET paused_until = NULL, pause_reason = NULL, paused_by = NULL, updated_at = now()
    WHERE l.effect = %(effect)s::text AND l.paused_until > now()
    RETURNING l.effect
), audited AS (
    INSERT INTO {schema}.dashboard_audit (actor, action, detail, affected)
    VALUES (%(actor)s::text, 'resume', jsonb_build_object('effect', %(effect)s::text),
            (SELECT count(*) FROM resumed))
)
SELECT count(*) AS resumed FROM resumed, pg_notify(%(channel)s::text, '');

-- name: limits_overview
-- Per effect with a limit row: the declared limit, the effective rate now, what was
-- completed in the last minute, the pause (why, by whom, until when) and the counters.
SELECT l.effect, l.rate, l.burst, l.concurrency,
       l.declared_at > now() - interval '60 seconds' AS declared,
       -- a limit per group (migration 0012), and how many groups it holds paused now
       l.group_rate, l.group_burst, l.group_concurrency,
       coalesce(l.group_declared_at > now() - interval '60 seconds', false) AS per_group,
       (SELECT count(*) FROM {schema}.group_limits g
        WHERE g.effect = l.effect AND g.paused_until > now()) AS groups_throttled,
       CASE WHEN l.declared_at > now() - interval '60 seconds' AND l.rate IS NOT NULL
                THEN l.rate * least(1.0, l.factor + 0.1 * coalesce(date_part('epoch',
                     now() - greatest(l.throttled_at, l.paused_until)), 1e9))
            WHEN l.learned_rate IS NOT NULL AND l.throttled_at > now() - interval '60 seconds'
                THEN l.learned_rate * (l.factor + 0.1 * coalesce(date_part('epoch',
                     now() - greatest(l.throttled_at, l.paused_until)), 1e9))
       END AS effective_rate,
       (SELECT count(*) FROM {schema}.effect_results r
         WHERE r.effect = l.effect AND r.recorded_at > now() - interval '60 seconds') / 60.0
           AS completed_rate,
       l.paused_until > now() AS paused,
       CASE WHEN l.paused_until > now() THEN l.pause_reason END AS pause_reason,
       CASE WHEN l.paused_until > now() THEN l.paused_by END AS paused_by,
       CASE WHEN l.paused_until > now() AND NOT {until_resumed} THEN l.paused_until END
           AS paused_until,
       l.failures, l.opened, l.throttled_total, l.throttled_at
FROM {schema}.effect_limits l
ORDER BY l.effect;

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

-- fragment: until_resumed
-- Whether the pause of row l (effect_limits, group_pauses) lasts until an operator
-- resumes it. Such a pause is stored a century ahead (date arithmetic on 'infinity' fails
-- before PostgreSQL 17, and psycopg cannot load it); this is the one rule that reads it
-- back, for every reader (outbox status, the dashboard), which get NULL as its end.
coalesce(l.paused_until > now() + interval '50 years', false)

-- name: group_pause
-- An operator pauses one group of an effect for every dispatcher, until %(seconds)s from
-- now (NULL: until resumed, stored a century ahead), audited in the same transaction.
WITH paused AS (
    INSERT INTO {schema}.group_pauses AS p (effect, group_key, paused_until, paused_by)
    VALUES (%(effect)s::text, %(group_key)s::text,
            now() + coalesce(%(seconds)s::float8 * interval '1 second', interval '100 years'),
            %(actor)s::text)
    ON CONFLICT (effect, group_key) DO UPDATE
    SET paused_until = EXCLUDED.paused_until, paused_by = EXCLUDED.paused_by,
        paused_at = now()
    RETURNING p.effect
), audited AS (
    INSERT INTO {schema}.dashboard_audit (actor, action, detail, affected)
    SELECT %(actor)s::text, 'pause',
           jsonb_build_object('effect', p.effect, 'group', %(group_key)s::text,
                              'seconds', %(seconds)s::float8), 1
    FROM paused p
)
SELECT count(*) AS paused FROM paused;

-- name: group_resume
-- An operator resumes one group of an effect; audited, and the dispatchers are woken.
WITH resumed AS (
    DELETE FROM {schema}.group_pauses p
    WHERE p.effect = %(effect)s::text AND p.group_key = %(group_key)s::text
      AND p.paused_until > now()
    RETURNING p.effect
), audited AS (
    INSERT INTO {schema}.dashboard_audit (actor, action, detail, affected)
    VALUES (%(actor)s::text, 'resume',
            jsonb_build_object('effect', %(effect)s::text, 'group', %(group_key)s::text),
            (SELECT count(*) FROM resumed))
)
SELECT count(*) AS resumed FROM resumed, pg_notify(%(channel)s::text, '');

-- name: group_named
-- Whether the effect has unfinished jobs in the group (`outbox pause --group` asks first).
SELECT EXISTS (SELECT 1 FROM {schema}.jobs j
               WHERE j.status IN ('pending', 'running') AND j.effect = %(effect)s::text
                 AND j.group_key = %(group_key)s::text) AS named;

-- name: paused_groups
-- Groups paused now: by whom and until when (NULL: until resumed, the one rule of
-- until_resumed, which reads the pause as l).
SELECT l.effect, l.group_key AS "group", l.paused_by AS by,
       CASE WHEN NOT {until_resumed} THEN l.paused_until END AS until
FROM {schema}.group_pauses l
WHERE l.paused_until > now()
ORDER BY l.effect, l.group_key;

-- name: throttled_groups
-- Groups of effects limited per group whose provider account pushed back and that are
-- paused now for every dispatcher (migration 0012), the longest pause first, at most
-- %(limit)s: one row per group throttled lately, never a scan of the jobs.
SELECT g.effect, g.group_key AS "group", g.throttled_total,
       date_part('epoch', g.paused_until - now()) AS seconds_left
FROM {schema}.group_limits g
WHERE g.paused_until > now()
ORDER BY g.paused_until DESC, g.effect, g.group_key
LIMIT %(limit)s;

-- name: paused_effects
-- Effects paused now, for every dispatcher: why (throttled, outage, operator), by whom
-- and until when (NULL: until resumed).
SELECT l.effect, l.pause_reason AS reason, l.paused_by AS by,
       CASE WHEN NOT {until_resumed} THEN l.paused_until END AS until,
       CASE WHEN NOT {until_resumed} THEN date_part('epoch', l.paused_until - now()) END
           AS seconds_left
FROM {schema}.effect_limits l
WHERE l.paused_until > now()
ORDER BY l.effect;

-- Limits shared across targets (migration 0013), run in the limits home's schema, each
-- statement in its own short transaction on the home's connection.

-- name: shared_grant
-- Up to %(want)s tokens of the effect's shared bucket: how many were granted, and when
-- none was, the seconds until asking again is worth it.
SELECT g.granted, g.wait
FROM {schema}.shared_grant(%(effect)s::text, %(want)s::integer, %(rate)s::float8,
                           %(burst)s::float8) g;

-- name: shared_refund
-- Give back tokens granted and not used (the target had fewer jobs than it was granted).
UPDATE {schema}.shared_limits s
SET tokens = least(s.burst, s.tokens + %(count)s::integer),
    granted_total = s.granted_total - %(count)s::integer, updated_at = now()
WHERE s.effect = %(effect)s::text;

-- name: shared_pause
-- The provider throttled a job of the effect in some target: empty the shared bucket and
-- grant nothing for %(seconds)s seconds (a longer pause already set is kept).
UPDATE {schema}.shared_limits s
SET tokens = 0, refilled_at = clock_timestamp(),
    paused_until = greatest(s.paused_until,
                            clock_timestamp() + %(seconds)s::float8 * interval '1 second'),
    throttles = s.throttles + 1, updated_at = now()
WHERE s.effect = %(effect)s::text;

-- name: shared_overview
-- The shared buckets kept in this schema, for outbox status: the declared rate and burst,
-- the tokens as of the last grant, the pause left, and what was granted in all.
SELECT s.effect, s.rate, s.burst, s.tokens,
       CASE WHEN s.paused_until > now()
            THEN extract(epoch FROM s.paused_until - now())::float8 END AS pause_left,
       s.throttles, s.granted_total,
       extract(epoch FROM now() - s.declared_at)::float8 AS declared_seconds_ago
FROM {schema}.shared_limits s
ORDER BY s.effect;
