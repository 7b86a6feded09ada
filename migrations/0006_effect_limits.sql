-- Provider limits, shared by every dispatcher on the schema: one row per effect that is
-- limited, throttled, broken or paused. A limit belongs to the provider account, so it
-- is counted here rather than in one process.
--
-- The row holds the declared limit (refreshed by the dispatchers that declare it), the
-- token bucket claims spend, the adaptive rate factor a throttle lowers, the pause (why,
-- by whom, until when) and the breaker's counters. Effects that are not limited and
-- never pushed back have no row, and their claims never read one.

CREATE TABLE {schema}.effect_limits (
    effect          text        PRIMARY KEY CHECK (effect <> ''),
    -- The declared limit (outbox.Limit), as last refreshed by a dispatcher declaring it;
    -- a declaration not refreshed for a minute is no longer applied.
    rate            float8      CHECK (rate > 0),
    burst           float8      CHECK (burst >= 1),
    concurrency     integer     CHECK (concurrency >= 1),
    declared_at     timestamptz,
    -- The token bucket, refilled lazily at each claim.
    tokens          float8      NOT NULL DEFAULT 0,
    refilled_at     timestamptz NOT NULL DEFAULT now(),
    -- Adaptive rate: the effective rate is (rate, else learned_rate) * factor, where the
    -- factor is cut at each throttle and grows back additively with time since it.
    learned_rate    float8      CHECK (learned_rate > 0),
    factor          float8      NOT NULL DEFAULT 1 CHECK (factor > 0 AND factor <= 1),
    throttled_at    timestamptz,
    throttles       integer     NOT NULL DEFAULT 0 CHECK (throttles >= 0),
    throttled_total bigint      NOT NULL DEFAULT 0 CHECK (throttled_total >= 0),
    -- The pause: no job of the effect is claimed before paused_until.
    paused_until    timestamptz,
    pause_reason    text        CHECK (pause_reason IN ('throttled', 'outage', 'operator')),
    paused_by       text,
    -- The breaker: transient failures in a row, how often it opened in a row (the pause
    -- grows with it), and the probe (its job and deadline) while one job tests recovery:
    -- only the probe's failure reopens the breaker at once, not a late failure of a job
    -- that was sent before it opened.
    failures        integer     NOT NULL DEFAULT 0 CHECK (failures >= 0),
    opened          integer     NOT NULL DEFAULT 0 CHECK (opened >= 0),
    probe_until     timestamptz,
    probe_job       bigint,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT effect_limits_pause_reason
        CHECK ((paused_until IS NULL) = (pause_reason IS NULL))
);

-- Serves a claim of one effect's jobs, and keeps a backlog of one effect from slowing
-- the claim of another.
CREATE INDEX jobs_claimable_effect ON {schema}.jobs (effect, available_at, id)
    WHERE status = 'pending';

-- Operators pause and resume effects and retry jobs from the command line too: those
-- actions are audited in the same table as the dashboard's.
ALTER TABLE {schema}.dashboard_audit DROP CONSTRAINT dashboard_audit_action_check;
ALTER TABLE {schema}.dashboard_audit ADD CONSTRAINT dashboard_audit_action_check
    CHECK (action IN ('retry', 'resolve_done', 'resolve_failed', 'cancel', 'bulk_retry',
                      'reconcile', 'pause', 'resume'));

-- The claim of one limited effect, as one call. A function because its statements need
-- fresh snapshots: the effect's row is locked first (claims of one limited effect queue
-- here, across every dispatcher), and only then are its running jobs counted and its
-- jobs claimed, so a claim that waited sees what the one before it took. The job claim
-- itself is the core claim (queries.sql, block claim) narrowed to one effect: the same
-- locking clause inside the CTE, the same repeated status guard, the same ordering rule.
-- When the budget (not the queue) stopped it, one more row comes back with a NULL id and,
-- in waited, the seconds until it is worth asking again.
CREATE FUNCTION {schema}.claim_limited(
    p_effect text, p_limit integer, p_lease float8, p_worker text,
    p_rate float8, p_burst float8, p_concurrency integer
) RETURNS TABLE (
    id bigint, effect text, key text, payload text, attempts integer,
    claim_version bigint, ordering_key text, max_attempts integer,
    first_attempted_at timestamptz, waited float8, trace_context jsonb,
    performed_result text
) LANGUAGE plpgsql VOLATILE AS $fn$
#variable_conflict use_column
DECLARE
    lim        {schema}.effect_limits%ROWTYPE;
    v_declares boolean := p_rate IS NOT NULL OR p_concurrency IS NOT NULL;
    v_rate     float8;
    v_burst    float8;
    v_conc     integer;
    v_factor   float8;
    v_eff      float8;
    v_tokens   float8;
    v_allowed  integer := p_limit;
    v_running  integer;
    v_claimed  integer := 0;
    v_probe    boolean := false;
    v_wait     float8;
    v_now      timestamptz;
BEGIN
    INSERT INTO {schema}.effect_limits AS l (effect, tokens) VALUES (p_effect, 1e9)
    ON CONFLICT ON CONSTRAINT effect_limits_pkey DO NOTHING;
    SELECT * INTO lim FROM {schema}.effect_limits l WHERE l.effect = p_effect FOR UPDATE;
    -- The clock after the lock, not the transaction's start: a claim that waited for the
    -- one before it must not count the tokens of the time it waited twice.
    v_now := clock_timestamp();
    IF v_declares THEN
        v_rate := p_rate; v_burst := p_burst; v_conc := p_concurrency;
    ELSIF lim.declared_at > v_now - interval '60 seconds' THEN
        v_rate := lim.rate; v_burst := lim.burst; v_conc := lim.concurrency;
    END IF;
    -- The adaptive factor grows back by a tenth per second since the last throttle (to
    -- the declared rate at most; a learned rate may grow past what was learned), and a
    -- learned rate is forgotten after a minute without throttling.
    v_factor := lim.factor + 0.1 * coalesce(
        extract(epoch FROM v_now - greatest(lim.throttled_at, lim.paused_until))::float8, 1e9);
    IF v_rate IS NOT NULL THEN
        v_factor := least(1.0, v_factor);
    ELSIF lim.learned_rate IS NOT NULL AND lim.throttled_at > v_now - interval '60 seconds' THEN
        v_rate := lim.learned_rate;
    END IF;
    IF v_rate IS NOT NULL THEN
        v_eff := v_rate * v_factor;
        v_burst := greatest(1.0, coalesce(v_burst, v_rate / 2.0) * least(1.0, v_factor));
        v_tokens := least(v_burst, lim.tokens + v_eff * greatest(0.0, extract(epoch FROM
            v_now - greatest(lim.refilled_at, lim.paused_until))::float8));
        v_allowed := least(v_allowed, floor(v_tokens)::integer);
        IF v_allowed < 1 THEN
            v_wait := (1.0 - v_tokens) / v_eff;
        END IF;
    END IF;
    IF v_conc IS NOT NULL THEN
        SELECT count(*) INTO v_running FROM {schema}.jobs j
        WHERE j.status = 'running' AND j.effect = p_effect;
        IF v_conc - v_running < 1 THEN
            v_wait := greatest(v_wait, 0.1);
        END IF;
        v_allowed := least(v_allowed, v_conc - v_running);
    END IF;
    -- An open breaker whose pause ended lets one probe at a time test recovery.
    IF lim.opened > 0 THEN
        IF lim.probe_until > v_now THEN
            v_allowed := 0;
            v_wait := greatest(v_wait, extract(epoch FROM lim.probe_until - v_now)::float8);
        END IF;
        v_probe := true;
        v_allowed := least(v_allowed, 1);
    END IF;
    IF lim.paused_until > v_now THEN
        v_allowed := 0;
        v_wait := extract(epoch FROM lim.paused_until - v_now)::float8;
    END IF;
    IF v_allowed > 0 THEN
        RETURN QUERY
        WITH candidates AS (
            SELECT c.id
            FROM {schema}.jobs c
            WHERE c.status = 'pending'
              AND c.available_at <= v_now
              AND c.effect = p_effect
              AND (c.ordering_key IS NULL OR NOT EXISTS (
                    SELECT 1 FROM {schema}.jobs o
                    WHERE o.ordering_key = c.ordering_key
                      AND o.id <> c.id
                      AND (o.status = 'running' OR (o.status = 'pending' AND o.id < c.id))))
            ORDER BY c.available_at, c.id
            LIMIT v_allowed
            FOR UPDATE SKIP LOCKED
        )
        UPDATE {schema}.jobs j
        SET status = 'running',
            attempts = j.attempts + 1,
            claim_version = j.claim_version + 1,
            lease_until = v_now + p_lease * interval '1 second',
            claimed_by = p_worker,
            first_attempted_at = coalesce(j.first_attempted_at, v_now),
            updated_at = v_now
        WHERE j.id = ANY (ARRAY(SELECT c.id FROM candidates c)) AND j.status = 'pending'
        RETURNING j.id, j.effect, j.key, j.payload::text, j.attempts, j.claim_version,
                  j.ordering_key, j.max_attempts, j.first_attempted_at,
                  greatest(date_part('epoch', v_now - j.available_at), 0)::float8,
                  j.trace_context, CAST(j.performed_result AS text);
        GET DIAGNOSTICS v_claimed = ROW_COUNT;
        IF v_claimed = v_allowed AND v_allowed < p_limit AND v_wait IS NULL THEN
            -- the budget, not the queue, ended this claim
            v_wait := CASE WHEN v_rate IS NOT NULL
                           THEN greatest(0.0, 1.0 - (v_tokens - v_claimed)) / v_eff
                           ELSE 0.1 END;
        END IF;
    END IF;
    UPDATE {schema}.effect_limits l
    SET rate = CASE WHEN v_declares THEN p_rate ELSE l.rate END,
        burst = CASE WHEN v_declares THEN p_burst ELSE l.burst END,
        concurrency = CASE WHEN v_declares THEN p_concurrency ELSE l.concurrency END,
        declared_at = CASE WHEN v_declares THEN v_now ELSE l.declared_at END,
        tokens = CASE WHEN v_rate IS NULL OR lim.paused_until > v_now
                      THEN l.tokens ELSE v_tokens - v_claimed END,
        refilled_at = CASE WHEN v_rate IS NULL OR lim.paused_until > v_now
                           THEN l.refilled_at ELSE v_now END,
        probe_until = CASE WHEN v_probe AND v_claimed > 0
                           THEN v_now + p_lease * interval '1 second' ELSE l.probe_until END,
        probe_job = CASE WHEN v_probe AND v_claimed > 0 THEN (
                        SELECT max(j.id) FROM {schema}.jobs j
                        WHERE j.effect = p_effect AND j.status = 'running'
                          AND j.claimed_by = p_worker AND j.updated_at = v_now)
                    ELSE l.probe_job END,
        updated_at = v_now
    WHERE l.effect = p_effect;
    -- Say when to ask again only when jobs are waiting for the budget.
    IF v_wait IS NOT NULL AND v_claimed < p_limit AND EXISTS (
            SELECT 1 FROM {schema}.jobs w
            WHERE w.status = 'pending' AND w.available_at <= v_now AND w.effect = p_effect) THEN
        RETURN QUERY SELECT NULL::bigint, p_effect, NULL::text, NULL::text, NULL::integer,
            NULL::bigint, NULL::text, NULL::integer, NULL::timestamptz,
            greatest(0.005, v_wait), NULL::jsonb, NULL::text;
    END IF;
END
$fn$;
