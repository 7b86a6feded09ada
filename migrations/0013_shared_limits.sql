-- Limits shared across targets (outbox.Limit(..., shared=True) with a dispatcher's
-- limits_home): one provider account used by many tenant databases or schemas is held
-- to one rate, counted here, in the outbox schema chosen as the home, by every
-- dispatcher and every target that names this home.
--
-- A claim of a shared-limited effect in any target first takes tokens from the effect's
-- bucket here (shared_grant: one statement in its own short transaction, so the row is
-- locked for microseconds, never across the target's claim), claims at most that many
-- jobs in its target, and gives back what it did not use (shared_refund). A provider's
-- throttle seen in any target empties the bucket and pauses it (shared_pause), so every
-- target backs off at once. A concurrency is not shared: it is counted in each target.
--
-- Only a new table and new functions: nothing of the previous release changes.

CREATE TABLE {schema}.shared_limits (
    effect        text        PRIMARY KEY CHECK (effect <> ''),
    -- The rate and burst of the last claim's declaration (dispatchers should agree).
    rate          float8      NOT NULL CHECK (rate > 0),
    burst         float8      NOT NULL CHECK (burst >= 1),
    -- The token bucket, refilled lazily at each grant.
    tokens        float8      NOT NULL,
    refilled_at   timestamptz NOT NULL,
    -- A throttle seen in any target: no grant before this.
    paused_until  timestamptz,
    throttles     bigint      NOT NULL DEFAULT 0 CHECK (throttles >= 0),
    granted_total bigint      NOT NULL DEFAULT 0,
    declared_at   timestamptz NOT NULL,
    updated_at    timestamptz NOT NULL DEFAULT now()
);

-- Take up to p_want tokens of p_effect's shared bucket (made full on first use): granted
-- is how many (0 while paused or empty), wait the seconds until a token is worth asking
-- for when none was granted (else NULL). The bucket holds at most p_burst tokens and
-- refills at p_rate a second, from the end of a pause at the earliest.
CREATE FUNCTION {schema}.shared_grant(
    p_effect text, p_want integer, p_rate float8, p_burst float8,
    OUT granted integer, OUT wait float8
) LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    lim      {schema}.shared_limits%ROWTYPE;
    v_at     timestamptz;
    v_tokens float8;
BEGIN
    INSERT INTO {schema}.shared_limits AS s
        (effect, rate, burst, tokens, refilled_at, declared_at)
    VALUES (p_effect, p_rate, p_burst, p_burst, clock_timestamp(), clock_timestamp())
    ON CONFLICT (effect) DO NOTHING;
    SELECT * INTO lim FROM {schema}.shared_limits s WHERE s.effect = p_effect FOR UPDATE;
    -- The clock after the lock: a grant that waited for another must not count the
    -- tokens of the time it waited twice.
    v_at := clock_timestamp();
    IF lim.paused_until > v_at THEN
        granted := 0;
        wait := extract(epoch FROM lim.paused_until - v_at)::float8;
        v_tokens := lim.tokens;
    ELSE
        v_tokens := least(p_burst, lim.tokens + p_rate * greatest(0.0, extract(epoch FROM
            v_at - greatest(lim.refilled_at, coalesce(lim.paused_until, lim.refilled_at)))::float8));
        granted := greatest(0, least(p_want, floor(v_tokens)::integer));
        IF granted < 1 THEN
            wait := (1.0 - v_tokens) / p_rate;
        END IF;
    END IF;
    UPDATE {schema}.shared_limits s
    SET tokens = v_tokens - granted, refilled_at = greatest(v_at, lim.refilled_at),
        rate = p_rate, burst = p_burst, declared_at = v_at,
        granted_total = s.granted_total + granted, updated_at = v_at
    WHERE s.effect = p_effect;
END
$fn$;

-- Every role that may write the effects' limit state may write the shared buckets too.
-- The names come from the catalogue, never from text (as in 0011, 0012).
DO $grant$
DECLARE
    limits_table oid := (SELECT t.typrelid FROM pg_type t
                         WHERE t.oid = pg_typeof(NULL::{schema}.effect_limits));
    shared regclass := (SELECT t.typrelid::regclass FROM pg_type t
                        WHERE t.oid = pg_typeof(NULL::{schema}.shared_limits));
    writer text;
BEGIN
    FOR writer IN
        SELECT DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC'
                             ELSE a.grantee::regrole::text END
        FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a
        WHERE c.oid = limits_table AND a.privilege_type = 'UPDATE'
          AND a.grantee <> c.relowner
    LOOP
        EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON %s TO %s', shared, writer);
    END LOOP;
END
$grant$;
