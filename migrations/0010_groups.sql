-- Tenants: a job's group (a tenant, customer, store or account; NULL is a group of its
-- own) and its priority (higher first). Both columns are added without rewriting the
-- table: a nullable column and a column with a constant default are catalogue changes.
-- The checks are NOT VALID: every existing row holds NULL and 0, which pass them, and
-- new rows are checked all the same, so no scan of the table is needed.
--
-- group_key compares in "C" (byte) order: the claim walks the busy groups of an effect
-- in that order, and the dispatcher remembers where it stopped by the group's name.

ALTER TABLE {schema}.jobs
    ADD COLUMN group_key text COLLATE "C",
    ADD COLUMN priority integer NOT NULL DEFAULT 0;

ALTER TABLE {schema}.jobs
    ADD CONSTRAINT jobs_group_key_length CHECK (length(group_key) BETWEEN 1 AND 255) NOT VALID,
    ADD CONSTRAINT jobs_priority_range CHECK (priority BETWEEN -1000 AND 1000) NOT VALID;

-- The order in which a group's due jobs are claimed: by when they became due, a job of
-- priority p counting as due p x 10 seconds earlier. A higher priority overtakes a
-- backlog of lower ones, and a lower job is never passed by higher ones that became due
-- more than (difference of priorities) x 10 seconds after it: ageing is built in, no job
-- waits forever. Declared IMMUTABLE (the epoch of a timestamptz does not depend on the
-- time zone), so the claim's index can hold it.
CREATE FUNCTION {schema}.claim_rank(available_at timestamptz, priority integer)
RETURNS float8 LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$ SELECT date_part('epoch', available_at) - priority * 10.0 $fn$;

-- Serves the fair claim: per effect, the busy groups (one probe each, walked in order)
-- and the head of each group's pending jobs. Built concurrently after the run commits:
-- building it reads the whole table, done history included, and a plain CREATE INDEX
-- would block every enqueue and claim for as long.
-- outbox: built concurrently, after commit
CREATE INDEX IF NOT EXISTS jobs_fair ON {schema}.jobs
    (effect, (coalesce(group_key, '')), {schema}.claim_rank(available_at, priority), id)
    WHERE status = 'pending';
