-- The claimer's (outbox/_dispatch/claimer.py): which jobs a claim takes, fairly across
-- groups, and whether work is due
--
-- Named blocks, loaded by outbox/_sql.py (the core's files, CORE_FILES, bound as one set
-- of names: queries(schema).<name>). {schema} is replaced by the quoted schema identifier
-- when a block is loaded (psycopg.sql.Identifier); values are always bound parameters, by
-- name. A write about a claimed job is conditional on status = 'running' AND
-- claim_version = the claim's version, so a stale worker's write changes 0 rows. A
-- `-- fragment: X` block is no statement: its text is bound into every block of the core
-- files and the dashboard's that names {X}, so a rule used by several is written once.

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

-- name: schema_version
-- The version the schema is migrated to, checked by a running dispatcher now and then:
-- a newer one than its code knows stops it (deploy the release that migrated it).
SELECT coalesce(max(version), 0) AS version FROM {schema}.schema_migrations;

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

-- fragment: target_is_due
-- Whether a dispatcher serving several targets should give this one a turn: a job of
-- %(effects)s claimable now (fragment claimable), or one whose lease expired (its worker
-- died: a turn rescues it). Running jobs held by live workers elsewhere are theirs.
EXISTS (
    SELECT 1 FROM {schema}.jobs j
    WHERE {claimable} AND j.effect = ANY(%(effects)s::text[])
) OR EXISTS (
    SELECT 1 FROM {schema}.jobs j
    WHERE j.status = 'running' AND j.lease_until < now()
      AND j.effect = ANY(%(effects)s::text[])
)

-- name: target_due
-- Whether a target is due (fragment target_is_due): a listening look-out's check.
SELECT {target_is_due} AS due;

-- name: target_due_next
-- target_due, and next_in: the seconds until it could be due with nothing written
-- meanwhile (the earliest of a pending job's future available_at, one effect at a time
-- down jobs_claimable_effect, a running job's lease_until, a group pause's end); NULL
-- when nothing is pending, running or paused. Anything else that makes a job claimable
-- is a write (an enqueue, a completion freeing an ordering key, an operator's retry),
-- which the database's statistics show (database_counters). The polling look-out's
-- look: it skips the database until then while nothing is written there.
SELECT {target_is_due} AS due,
date_part('epoch', {target_next_at} - now()) AS next_in;

-- fragment: target_next_at
-- When a target could next be due with nothing written meanwhile (target_due_next):
-- the earliest of a pending job's future available_at (one effect at a time down
-- jobs_claimable_effect), a running job's lease_until, a group pause's end; NULL when
-- nothing is pending, running or paused.
least(
    (SELECT min(n.at) FROM unnest(%(effects)s::text[]) AS e(effect)
     CROSS JOIN LATERAL (SELECT j.available_at AS at FROM {schema}.jobs j
                         WHERE j.status = 'pending' AND j.effect = e.effect
                           AND j.available_at > now()
                         ORDER BY j.available_at LIMIT 1) n),
    (SELECT min(j.lease_until) FROM {schema}.jobs j
     WHERE j.status = 'running' AND j.effect = ANY(%(effects)s::text[])),
    (SELECT min(gp.paused_until) FROM {schema}.group_pauses gp WHERE gp.paused_until > now())
)

-- name: target_due_quiet
-- target_due_next for a listening look-out, which asks a schema again only when
-- something may have changed there (outbox/_dispatch/looks.py, must_ask): next_in also
-- counts the end of the latest live awake mark of %(effects)s (presence.sql, awake_mark),
-- until which an enqueue of those effects may commit without a NOTIFY.
SELECT {target_is_due} AS due,
date_part('epoch', least(
    {target_next_at},
    (SELECT max(a.until) FROM {schema}.awake a
     WHERE a.effect = ANY(%(effects)s::text[]) AND a.until > now())
) - now()) AS next_in;

-- name: database_counters
-- Every database's write counters on this server (pg_stat_database, readable by any
-- role), and the server's start time, which with datid says which database a row is:
-- a fleet's polling look-out skips a database whose counters stand still since its
-- last look (outbox/_dispatch/looks.py). The counters lag (a backend flushes its own at
-- most once a second, holding them up to 10 s when it flushed less than a second
-- before); changed_at does not: the latest state change of the database's client
-- backends other than dispatchers' (pg_stat_activity, live; NULL for the backends of
-- roles this one may not see), which a commit moves at once. Read in autocommit: each
-- statement a fresh snapshot (stats_fetch_consistency caches one per transaction).
SELECT date_part('epoch', pg_postmaster_start_time()) AS server, d.datid,
       d.xact_commit, d.tup_inserted, d.tup_updated, d.tup_deleted,
       date_part('epoch', d.stats_reset) AS stats_reset,
       date_part('epoch', statement_timestamp()) AS read_at,
       date_part('epoch', a.changed_at) AS changed_at
FROM pg_stat_database d
LEFT JOIN (
    SELECT s.datid, max(s.state_change) AS changed_at
    FROM pg_stat_activity s
    WHERE s.backend_type = 'client backend' AND s.pid <> pg_backend_pid()
      AND NOT starts_with(s.application_name, 'outbox ')
    GROUP BY s.datid
) a ON a.datid = d.datid
WHERE d.datid <> 0;

-- name: database_identity
-- Which database of which server a connection reached (matched against
-- database_counters' rows): the server's start time and the database's oid.
SELECT date_part('epoch', pg_postmaster_start_time()) AS server, d.oid AS datid
FROM pg_database d
WHERE d.datname = current_database();
