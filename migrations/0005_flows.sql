-- Flows and reconciliation.
--
-- performed_result: the provider's answer obtained by an attempt whose completion hook
-- (on_done) raised. The hook's writes rolled back, but the provider has acted: the next
-- claim reuses this answer instead of calling the provider again. Written only by the
-- fenced statement that sends the job back to pending after such a hook failure.
--
-- parent_key: the key of the job whose completion hook enqueued this one (a follow-up),
-- so a flow can be shown as a chain. A key, not an id: retention deletes done jobs
-- before their ledger rows, and the key outlives both.
--
-- reconcile_at / reconcile_checks / reconcile_version: when the reconciler asks the
-- provider next about a job in reconcile (pushed ahead while one dispatcher asks, so two
-- never ask about the same job at once; NULL once it gave up), how many passes had the
-- provider answer "still unknown" (passes where it could not be reached do not count
-- toward giving up), and the claim_version those two belong to: a job that comes back
-- to reconcile under a newer claim (after an operator's retry) is asked afresh.
--
-- All nullable or with a constant default: adding them rewrites nothing.
ALTER TABLE {schema}.jobs
    ADD COLUMN performed_result jsonb,
    ADD COLUMN parent_key text,
    ADD COLUMN reconcile_at timestamptz,
    ADD COLUMN reconcile_checks integer NOT NULL DEFAULT 0 CHECK (reconcile_checks >= 0),
    ADD COLUMN reconcile_version bigint;

-- Serves the dashboard's "follow-ups of this job".
CREATE INDEX jobs_parent ON {schema}.jobs (parent_key) WHERE parent_key IS NOT NULL;

-- Serves the reconciler: jobs in reconcile by their next ask.
CREATE INDEX jobs_reconcile ON {schema}.jobs (reconcile_at) WHERE status = 'reconcile';

-- The reconciler's decisions are audited like an operator's, as actor 'reconciler'.
ALTER TABLE {schema}.dashboard_audit
    DROP CONSTRAINT dashboard_audit_action_check,
    ADD CONSTRAINT dashboard_audit_action_check
        CHECK (action IN ('retry', 'resolve_done', 'resolve_failed', 'cancel', 'bulk_retry',
                          'reconcile'));
