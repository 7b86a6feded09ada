-- The effect ledger: one row per business effect that completed, written in the same
-- statement as the fenced running -> done update and never otherwise. It outlives the
-- job row (retention deletes done jobs sooner), so enqueue consults it to refuse to
-- perform a key twice.

CREATE TABLE {schema}.effect_results (
    key           text        PRIMARY KEY,
    effect        text        NOT NULL,
    job_id        bigint      NOT NULL,
    claim_version bigint      NOT NULL,
    result        jsonb,
    fingerprint   text        NOT NULL,
    recorded_at   timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX effect_results_recorded ON {schema}.effect_results (recorded_at);
