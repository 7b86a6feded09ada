-- The limited claim around the core claim. claim_limited (0006) claimed jobs inside
-- plpgsql with its own copy of the claimable predicate; it is replaced by the two parts
-- that must be in plpgsql, called by one statement (queries.sql, block limit_claim)
-- around the core claim's own predicate and update (fragments claimable and
-- claim_taken), so the rule of which job a claim takes is written once:
--
--   limit_budget  locks the effect's row (claims of one limited effect queue here,
--                 across every dispatcher), refills the token bucket, counts the running
--                 jobs with a snapshot taken after the lock, and says how many jobs the
--                 claim may take (allowed) and at what time (at: the clock after the
--                 lock, stamped on the claimed jobs);
--   limit_spend   writes back what the claim spent (tokens, the probe of an open
--                 breaker, the declared limit) and says when to ask again if the budget,
--                 not the queue, ended the claim.
--
-- Both run in the claim's statement and so in its transaction: the row stays locked
-- from the budget to the commit.

DROP FUNCTION {schema}.claim_limited(text, integer, float8, text, float8, float8, integer);

CREATE TYPE {schema}.effect_budget AS (
    allowed integer,       -- jobs the claim may take now (0: none)
    at      timestamptz,   -- the clock after the lock
    tokens  float8,        -- the bucket refilled to now (NULL: no rate applies)
    eff     float8,        -- the effective rate (NULL: no rate applies)
    probe   boolean,       -- the breaker is open: a claim is its one probe
    paused  boolean,       -- the effect is paused: the bucket is left as it is
    wait    float8         -- seconds until asking again is worth it (NULL: now)
);

CREATE FUNCTION {schema}.limit_budget(
    p_effect text, p_limit integer, p_rate float8, p_burst float8, p_concurrency integer
) RETURNS {schema}.effect_budget LANGUAGE plpgsql VOLATILE AS $fn$
#variable_conflict use_column
DECLARE
    lim      {schema}.effect_limits%ROWTYPE;
    v_rate   float8;
    v_burst  float8;
    v_conc   integer;
    v_factor float8;
    v_running integer;
    b        {schema}.effect_budget;
BEGIN
    INSERT INTO {schema}.effect_limits AS l (effect, tokens) VALUES (p_effect, 1e9)
    ON CONFLICT ON CONSTRAINT effect_limits_pkey DO NOTHING;
    SELECT * INTO lim FROM {schema}.effect_limits l WHERE l.effect = p_effect FOR UPDATE;
    -- The clock after the lock, not the transaction's start: a claim that waited for the
    -- one before it must not count the tokens of the time it waited twice.
    b.at := clock_timestamp();
    b.allowed := p_limit;
    b.probe := false;
    b.paused := coalesce(lim.paused_until > b.at, false);
    IF p_rate IS NOT NULL OR p_concurrency IS NOT NULL THEN
        v_rate := p_rate; v_burst := p_burst; v_conc := p_concurrency;
    ELSIF lim.declared_at > b.at - interval '60 seconds' THEN
        v_rate := lim.rate; v_burst := lim.burst; v_conc := lim.concurrency;
    END IF;
    -- The adaptive factor grows back by a tenth per second since the last throttle (to
    -- the declared rate at most; a learned rate may grow past what was learned), and a
    -- learned rate is forgotten after a minute without throttling.
    v_factor := lim.factor + 0.1 * coalesce(
        extract(epoch FROM b.at - greatest(lim.throttled_at, lim.paused_until))::float8, 1e9);
    IF v_rate IS NOT NULL THEN
        v_factor := least(1.0, v_factor);
    ELSIF lim.learned_rate IS NOT NULL AND lim.throttled_at > b.at - interval '60 seconds' THEN
        v_rate := lim.learned_rate;
    END IF;
    IF v_rate IS NOT NULL THEN
        b.eff := v_rate * v_factor;
        v_burst := greatest(1.0, coalesce(v_burst, v_rate / 2.0) * least(1.0, v_factor));
        b.tokens := least(v_burst, lim.tokens + b.eff * greatest(0.0, extract(epoch FROM
            b.at - greatest(lim.refilled_at, lim.paused_until))::float8));
        b.allowed := least(b.allowed, floor(b.tokens)::integer);
        IF b.allowed < 1 THEN
            b.wait := (1.0 - b.tokens) / b.eff;
        END IF;
    END IF;
    IF v_conc IS NOT NULL THEN
        SELECT count(*) INTO v_running FROM {schema}.jobs j
        WHERE j.status = 'running' AND j.effect = p_effect;
        IF v_conc - v_running < 1 THEN
            b.wait := greatest(b.wait, 0.1);
        END IF;
        b.allowed := least(b.allowed, v_conc - v_running);
    END IF;
    -- An open breaker whose pause ended lets one probe at a time test recovery.
    IF lim.opened > 0 THEN
        IF lim.probe_until > b.at THEN
            b.allowed := 0;
            b.wait := greatest(b.wait, extract(epoch FROM lim.probe_until - b.at)::float8);
        END IF;
        b.probe := true;
        b.allowed := least(b.allowed, 1);
    END IF;
    IF b.paused THEN
        b.allowed := 0;
        b.wait := extract(epoch FROM lim.paused_until - b.at)::float8;
    END IF;
    b.allowed := greatest(b.allowed, 0);
    RETURN b;
END
$fn$;

CREATE FUNCTION {schema}.limit_spend(
    p_effect text, b {schema}.effect_budget, p_limit integer, p_lease float8,
    p_rate float8, p_burst float8, p_concurrency integer,
    p_claimed integer, p_probe_job bigint
) RETURNS float8 LANGUAGE plpgsql VOLATILE AS $fn$
#variable_conflict use_column
DECLARE
    v_declares boolean := p_rate IS NOT NULL OR p_concurrency IS NOT NULL;
    v_wait     float8 := b.wait;
BEGIN
    IF b.allowed > 0 AND p_claimed = b.allowed AND b.allowed < p_limit AND v_wait IS NULL THEN
        -- the budget, not the queue, ended this claim
        v_wait := CASE WHEN b.eff IS NOT NULL
                       THEN greatest(0.0, 1.0 - (b.tokens - p_claimed)) / b.eff
                       ELSE 0.1 END;
    END IF;
    UPDATE {schema}.effect_limits l
    SET rate = CASE WHEN v_declares THEN p_rate ELSE l.rate END,
        burst = CASE WHEN v_declares THEN p_burst ELSE l.burst END,
        concurrency = CASE WHEN v_declares THEN p_concurrency ELSE l.concurrency END,
        declared_at = CASE WHEN v_declares THEN b.at ELSE l.declared_at END,
        tokens = CASE WHEN b.eff IS NULL OR b.paused
                      THEN l.tokens ELSE b.tokens - p_claimed END,
        refilled_at = CASE WHEN b.eff IS NULL OR b.paused
                           THEN l.refilled_at ELSE b.at END,
        probe_until = CASE WHEN b.probe AND p_claimed > 0
                           THEN b.at + p_lease * interval '1 second' ELSE l.probe_until END,
        probe_job = CASE WHEN b.probe AND p_claimed > 0 THEN p_probe_job ELSE l.probe_job END,
        updated_at = b.at
    WHERE l.effect = p_effect;
    -- Say when to ask again only when jobs are waiting for the budget.
    IF v_wait IS NOT NULL AND p_claimed < p_limit AND EXISTS (
            SELECT 1 FROM {schema}.jobs w
            WHERE w.status = 'pending' AND w.available_at <= b.at AND w.effect = p_effect) THEN
        RETURN greatest(0.005, v_wait);
    END IF;
    RETURN NULL;
END
$fn$;
