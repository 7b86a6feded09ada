-- Cancelling a running job (`outbox cancel`, the dashboard's cancel): the claim an
-- operator asked to stop. A running job keeps its status; its dispatcher is told at once
-- by a notification, or at its next heartbeat, which returns whether its claim is the one
-- cancelled. The request names a claim_version, not a time: a later claim of the same job
-- (an operator's retry) is not touched by an old request, and nothing has to reset it on
-- the claim's hot path. While the cancelled claim is the job's current one, the job never
-- goes back to pending: the recorder's settle and the rescuer end it failed instead.
--
-- Nullable without a default: adding it rewrites nothing.
ALTER TABLE {schema}.jobs ADD COLUMN cancel_version bigint;
