-- Provider limits (outbox/_dispatch/budget.py, shared.py) and the operators' pauses
-- (outbox cli)
--
-- Named blocks, loaded by outbox/_sql.py (the core's files, CORE_FILES, bound as one set
-- of names: queries(schema).<name>). {schema} is replaced by the quoted schema identifier
-- when a block is loaded (psycopg.sql.Identifier); values are always bound parameters, by
-- name. A write about a claimed job is conditional on status = 'running' AND
-- claim_version = the claim's version, so a stale worker's write changes 0 rows. A
-- `-- fragment: X` block is no statement: its text is bound into every block of the core
-- files and the dashboard's that names {X}, so a rule used by several is written once.

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
