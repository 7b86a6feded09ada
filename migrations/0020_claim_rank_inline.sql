-- claim_rank (0010) the planner can inline. Its body called date_part on a timestamptz,
-- which PostgreSQL marks STABLE (some fields depend on the session's time zone), inside a
-- function declared IMMUTABLE: a body less immutable than its function is never inlined,
-- so every job the fair claim read went through the SQL-function executor, for the rank
-- it orders by and returns (about 1.1 µs of the server's CPU a job of the drain, measured
-- with 2,000 jobs a claim), and so did every insert into jobs_fair (each enqueue).
--
-- The same value, from immutable functions only: a timestamptz at time zone 'UTC' is the
-- timestamp of the same instant in UTC, whose epoch date_part computes with the same
-- arithmetic as the timestamptz's, bit for bit, whatever the session's time zone (and
-- infinity stays infinity). So the entries jobs_fair holds already stay true: nothing is
-- rebuilt, and dispatchers of earlier releases, which call the function the same way,
-- read the same order.
CREATE OR REPLACE FUNCTION {schema}.claim_rank(available_at timestamptz, priority integer)
RETURNS float8 LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$ SELECT date_part('epoch', available_at AT TIME ZONE 'UTC') - priority * 10.0 $fn$;

-- Every session caches an index's expressions as it planned them: one that read jobs_fair
-- before this commit holds the call, which a claim planned now (the body inlined) no
-- longer matches, and would sort a whole group's backlog per claim instead of walking the
-- index. A change to the index's pg_class row (this one changes nothing else) makes every
-- session read the index afresh at its next transaction. The index is missing while a
-- run from before 0010 has yet to build it (after commit): it is then built with this body.
ALTER INDEX IF EXISTS {schema}.jobs_fair RESET (fillfactor);
