-- Limits per group (outbox.Limit(..., per_group=True)): the rate and the concurrency
-- apply to each group (tenant, provider account) of an effect on its own, counted here
-- and shared by every dispatcher on the schema, as an effect's limit is (0006, 0009).
--
-- The declaration lives on the effect's row (effect_limits), beside the effect-wide
-- one: a dispatcher that does not declare it honours it for a minute after any
-- dispatcher last claimed under it. Each group's token bucket, the throttle its provider
-- account answered and the pause that followed live in group_limits, a row per group
-- that was claimed under a rate or throttled lately: a group that is not busy has no
-- row (a missing row is a full bucket), and rows left idle for a minute are swept by
-- the claims themselves. A concurrency per group needs no row: it is counted from the
-- running jobs at each claim.
--
-- Claims of an effect with a per-group limit go through limit_claim, which locks the
-- effect's row first (limit_budget): those claims queue there across every dispatcher,
-- so a group's running count and bucket are read after the claim before them committed,
-- and two dispatchers never both take a group's last slot.
--
-- Only a new table, new columns with no default and new functions: no lock on the jobs
-- table, and the previous release's statements keep working during a rolling upgrade.

ALTER TABLE {schema}.effect_limits
    ADD COLUMN group_rate        float8 CHECK (group_rate > 0),
    ADD COLUMN group_burst       float8 CHECK (group_burst >= 1),
    ADD COLUMN group_concurrency integer CHECK (group_concurrency >= 1),
    ADD COLUMN group_declared_at timestamptz,
    -- when the claims last swept the effect's idle group rows
    ADD COLUMN groups_swept_at   timestamptz;

CREATE TABLE {schema}.group_limits (
    effect          text        NOT NULL CHECK (effect <> ''),
    -- '' stands for the jobs with no group, as in group_pauses
    group_key       text        COLLATE "C" NOT NULL CHECK (length(group_key) <= 255),
    -- The group's token bucket, refilled lazily at each claim.
    tokens          float8      NOT NULL,
    refilled_at     timestamptz NOT NULL,
    -- The group's provider account pushed back: its effective rate is the declared rate
    -- times factor, cut at each throttle and grown back by a tenth a second; no job of
    -- the group is claimed before paused_until.
    factor          float8      NOT NULL DEFAULT 1 CHECK (factor > 0 AND factor <= 1),
    throttled_at    timestamptz,
    throttles       integer     NOT NULL DEFAULT 0 CHECK (throttles >= 0),
    throttled_total bigint      NOT NULL DEFAULT 0 CHECK (throttled_total >= 0),
    paused_until    timestamptz,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (effect, group_key)
);

-- What one claim may take of each group walked (p_groups: the busy groups of the fair
-- claim's walk, fragment fair_busy) under the per-group limit: at most the group's
-- whole tokens and its concurrency less its running jobs, nothing while its provider
-- account's pause lasts. cap is NULL for every group when no per-group limit applies
-- (none given in p_rate/p_concurrency and none declared in the last minute), and wait
-- says, for a group given 0, the seconds until asking again is worth it. Buckets are
-- refilled to p_at and written back (spent by limit_group_spend). Called after
-- limit_budget locked the effect's row, so its counts are fresh: a VOLATILE function's
-- statements each take a new snapshot.
CREATE FUNCTION {schema}.limit_group_caps(
    p_effect text, p_groups text[], p_rate float8, p_burst float8, p_concurrency integer,
    p_at timestamptz
) RETURNS TABLE (g text, cap integer, wait float8) LANGUAGE plpgsql VOLATILE AS $fn$
#variable_conflict use_column
DECLARE
    lim     {schema}.effect_limits%ROWTYPE;
    v_rate  float8 := p_rate;
    v_burst float8 := p_burst;
    v_conc  integer := p_concurrency;
BEGIN
    IF p_rate IS NULL AND p_concurrency IS NULL THEN
        SELECT * INTO lim FROM {schema}.effect_limits l WHERE l.effect = p_effect;
        IF lim.group_declared_at > p_at - interval '60 seconds' THEN
            v_rate := lim.group_rate; v_burst := lim.group_burst; v_conc := lim.group_concurrency;
        END IF;
    ELSE
        UPDATE {schema}.effect_limits l
        SET group_rate = p_rate, group_burst = p_burst, group_concurrency = p_concurrency,
            group_declared_at = p_at
        WHERE l.effect = p_effect;
    END IF;
    IF v_rate IS NULL AND v_conc IS NULL THEN
        RETURN QUERY SELECT x.g, NULL::integer, NULL::float8 FROM unnest(p_groups) AS x(g);
        RETURN;
    END IF;
    -- Idle rows go, at most every ten seconds: a row untouched for a minute holds a full
    -- bucket and a factor grown back to 1, exactly what a missing row stands for.
    UPDATE {schema}.effect_limits l SET groups_swept_at = p_at
    WHERE l.effect = p_effect
      AND (l.groups_swept_at IS NULL OR l.groups_swept_at < p_at - interval '10 seconds');
    IF FOUND THEN
        DELETE FROM {schema}.group_limits gl
        WHERE gl.effect = p_effect AND gl.updated_at < p_at - interval '60 seconds'
          AND (gl.paused_until IS NULL OR gl.paused_until < p_at);
    END IF;
    IF v_rate IS NOT NULL THEN
        -- Refill the walked groups' buckets to p_at (a new group starts full).
        INSERT INTO {schema}.group_limits AS gl (effect, group_key, tokens, refilled_at, updated_at)
        SELECT p_effect, x.g, greatest(1.0, coalesce(v_burst, v_rate / 2.0)), p_at, p_at
        FROM unnest(p_groups) AS x(g)
        ON CONFLICT (effect, group_key) DO UPDATE
        SET tokens = least(
                greatest(1.0, coalesce(v_burst, v_rate / 2.0) * least(1.0, gl.factor
                    + 0.1 * coalesce(date_part('epoch',
                        p_at - greatest(gl.throttled_at, gl.paused_until)), 1e9))),
                gl.tokens + v_rate * least(1.0, gl.factor + 0.1 * coalesce(date_part('epoch',
                        p_at - greatest(gl.throttled_at, gl.paused_until)), 1e9))
                    * greatest(0.0, date_part('epoch',
                        p_at - greatest(gl.refilled_at, gl.paused_until)))),
            refilled_at = p_at, updated_at = p_at;
    END IF;
    RETURN QUERY
    WITH running AS (
        SELECT coalesce(j.group_key, '') AS g, count(*)::integer AS n
        FROM {schema}.jobs j
        WHERE j.status = 'running' AND j.effect = p_effect AND v_conc IS NOT NULL
        GROUP BY 1
    ), caps AS (
        SELECT x.g,
               CASE WHEN gl.paused_until > p_at THEN 0
                    ELSE greatest(0, least(
                        CASE WHEN v_rate IS NOT NULL THEN floor(gl.tokens)::integer END,
                        v_conc - coalesce(r.n, 0))) END AS cap,
               gl.paused_until, gl.tokens, gl.factor, gl.throttled_at,
               r.n AS running
        FROM unnest(p_groups) AS x(g)
        LEFT JOIN {schema}.group_limits gl ON gl.effect = p_effect AND gl.group_key = x.g
        LEFT JOIN running r ON r.g = x.g
    )
    SELECT c.g, c.cap,
           CASE WHEN c.cap > 0 THEN NULL
                WHEN c.paused_until > p_at THEN date_part('epoch', c.paused_until - p_at)
                WHEN v_rate IS NOT NULL AND c.tokens < 1.0
                    THEN (1.0 - c.tokens) / (v_rate * least(1.0, c.factor + 0.1 * coalesce(
                        date_part('epoch', p_at - c.throttled_at), 1e9)))
                ELSE 0.1 END
    FROM caps c;
END
$fn$;

-- What a claim took of each group (p_taken: a JSON object group -> jobs; NULL: none),
-- spent from the groups' buckets that limit_group_caps refilled in the same statement
-- (a group claimed under a concurrency alone has no row: nothing to spend). Returns the
-- number of buckets spent.
CREATE FUNCTION {schema}.limit_group_spend(p_effect text, p_taken jsonb, p_at timestamptz)
RETURNS integer LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    v_spent integer;
BEGIN
    IF p_taken IS NULL THEN
        RETURN 0;
    END IF;
    UPDATE {schema}.group_limits gl
    SET tokens = gl.tokens - t.value::float8, updated_at = p_at
    FROM jsonb_each_text(p_taken) AS t
    WHERE gl.effect = p_effect AND gl.group_key = t.key;
    GET DIAGNOSTICS v_spent = ROW_COUNT;
    RETURN v_spent;
END
$fn$;

-- Every role that may write the effects' limit state (a dispatcher's role granted table
-- by table) may write the groups' too, so a running deployment keeps claiming once it is
-- migrated. The names come from the catalogue, never from text (as in 0011).
DO $grant$
DECLARE
    limits_table oid := (SELECT t.typrelid FROM pg_type t
                         WHERE t.oid = pg_typeof(NULL::{schema}.effect_limits));
    groups regclass := (SELECT t.typrelid::regclass FROM pg_type t
                        WHERE t.oid = pg_typeof(NULL::{schema}.group_limits));
    writer text;
BEGIN
    FOR writer IN
        SELECT DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC'
                             ELSE a.grantee::regrole::text END
        FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a
        WHERE c.oid = limits_table AND a.privilege_type = 'UPDATE'
          AND a.grantee <> c.relowner
    LOOP
        EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON %s TO %s', groups, writer);
    END LOOP;
END
$grant$;
