-- The dashboard's audit trail, and the trace context a job carries from its enqueue to
-- its attempts.
--
-- Every dashboard action (retry, resolve, cancel, bulk retry) writes one row here in the
-- same transaction as the fenced update it describes, including actions that changed
-- nothing because the job had moved on (affected = 0): the operator's intent is worth
-- keeping either way.

CREATE TABLE {schema}.dashboard_audit (
    id        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at        timestamptz NOT NULL DEFAULT now(),
    actor     text        NOT NULL CHECK (actor <> ''),
    action    text        NOT NULL
        CHECK (action IN ('retry', 'resolve_done', 'resolve_failed', 'cancel', 'bulk_retry')),
    job_id    bigint,
    -- For a bulk action, the filter it was given; for a resolve, the operator's note.
    detail    jsonb       NOT NULL DEFAULT jsonb_build_object(),
    affected  integer     NOT NULL CHECK (affected >= 0)
);

CREATE INDEX dashboard_audit_job ON {schema}.dashboard_audit (job_id, at) WHERE job_id IS NOT NULL;

-- W3C trace context (traceparent, tracestate) of the span that enqueued the job, so each
-- attempt's span can link to it. Kept out of the payload, which belongs to the effect.
-- Nullable without a default: adding it rewrites nothing.
ALTER TABLE {schema}.jobs ADD COLUMN trace_context jsonb;
