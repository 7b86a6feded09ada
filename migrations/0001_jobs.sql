-- The jobs table: one row per effect to perform. The state machine lives here as a CHECK
-- on text (not an ENUM: enum values cannot be dropped, nor used in the transaction that
-- adds them) and a second CHECK tying lease fields to the running state.
-- {schema} is substituted with a quoted identifier by the migrations runner.

CREATE TABLE {schema}.jobs (
    id                 bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    effect             text        NOT NULL CHECK (effect <> ''),
    key                text        NOT NULL CHECK (length(key) BETWEEN 1 AND 255),
    payload            jsonb       NOT NULL,
    fingerprint        text        NOT NULL,
    status             text        NOT NULL DEFAULT 'pending',
    attempts           integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    max_attempts       integer     NOT NULL DEFAULT 25 CHECK (max_attempts >= 1),
    claim_version      bigint      NOT NULL DEFAULT 0 CHECK (claim_version >= 0),
    available_at       timestamptz NOT NULL DEFAULT now(),
    lease_until        timestamptz,
    claimed_by         text,
    ordering_key       text,
    last_error         text,
    first_attempted_at timestamptz,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT jobs_key_unique UNIQUE (key),
    CONSTRAINT jobs_status_valid
        CHECK (status IN ('pending', 'running', 'done', 'failed', 'reconcile')),
    CONSTRAINT jobs_lease_iff_running
        CHECK ((status = 'running') = (lease_until IS NOT NULL AND claimed_by IS NOT NULL))
) WITH (
    -- Every job is inserted and updated several times: vacuum early and without
    -- throttling so dead tuples do not pile up under the claim index, and leave room on
    -- each page for HOT updates.
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);

-- Serves the claim: only pending rows, in preference order.
CREATE INDEX jobs_claimable ON {schema}.jobs (available_at, id) WHERE status = 'pending';

-- Serves the rescuer: running rows by lease deadline.
CREATE INDEX jobs_leases ON {schema}.jobs (lease_until) WHERE status = 'running';

-- Serves the ordering rule: the head of each ordering key among unfinished jobs.
CREATE INDEX jobs_ordering ON {schema}.jobs (ordering_key, id)
    WHERE ordering_key IS NOT NULL AND status IN ('pending', 'running');

-- Serves retention and the status command.
CREATE INDEX jobs_finished ON {schema}.jobs (status, updated_at)
    WHERE status IN ('done', 'failed', 'reconcile');
