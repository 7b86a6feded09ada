-- The guards of a jobs row as one check, whose expressions are compiled once a session
-- instead of at every statement.
--
-- The twelve CHECK constraints of jobs (0001, 0005, 0010, 0015) each had its expression
-- read from the catalogue's text, planned and compiled again at the start of every
-- statement that wrote a row: about 30 µs of the server's CPU for a one-row enqueue,
-- whose plain INSERT costs about as much (docs/explanation/performance.md). A PL/pgSQL
-- function plans its expressions once a session, and the one CHECK that calls it is a
-- single function call to prepare. The guards are the same, on every row written by any
-- path (tx.enqueue, {schema}.enqueue, a raw INSERT, the dispatchers' updates, an
-- operator's SQL), and so is the failure: SQLSTATE 23514 (check_violation) naming the
-- constraint it replaces, with a detail saying what is wrong.
--
-- The test on the fast path is one expression; only a row it refuses is examined guard by
-- guard. A CHECK passes when its expression is NULL, and so did the old ones (a NULL
-- group_key or after_failed passes); every other column guarded is NOT NULL. Operators
-- and functions are schema-qualified: the body is planned with the writing session's
-- search_path, which must not be able to put other operators in its place.
--
-- Online: the new check is added NOT VALID (no scan: every existing row passed the old
-- checks, which say the same) and the old ones are dropped, catalogue changes under a
-- brief lock that the migration runner waits for at most lock_timeout.
CREATE FUNCTION {schema}.jobs_row_valid(
    p_effect text, p_key text, p_status text, p_attempts integer, p_max_attempts integer,
    p_claim_version bigint, p_lease_until timestamptz, p_claimed_by text,
    p_reconcile_checks integer, p_group_key text, p_priority integer,
    p_after_waiting integer, p_after_failed text
) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $fn$
DECLARE
    v_name   text;
    v_detail text;
BEGIN
    IF p_effect OPERATOR(pg_catalog.<>) ''
       AND pg_catalog.length(p_key) OPERATOR(pg_catalog.>=) 1
       AND pg_catalog.length(p_key) OPERATOR(pg_catalog.<=) 255
       AND p_attempts OPERATOR(pg_catalog.>=) 0
       AND p_max_attempts OPERATOR(pg_catalog.>=) 1
       AND p_claim_version OPERATOR(pg_catalog.>=) 0
       AND p_reconcile_checks OPERATOR(pg_catalog.>=) 0
       AND p_after_waiting OPERATOR(pg_catalog.>=) 0
       AND p_priority OPERATOR(pg_catalog.>=) -1000
       AND p_priority OPERATOR(pg_catalog.<=) 1000
       AND p_status OPERATOR(pg_catalog.=) ANY (ARRAY['pending', 'running', 'done', 'failed',
                                                      'reconcile'])
       AND (p_status OPERATOR(pg_catalog.=) 'running')
           OPERATOR(pg_catalog.=) (p_lease_until IS NOT NULL AND p_claimed_by IS NOT NULL)
       AND (p_group_key IS NULL
            OR (pg_catalog.length(p_group_key) OPERATOR(pg_catalog.>=) 1
                AND pg_catalog.length(p_group_key) OPERATOR(pg_catalog.<=) 255))
       AND (p_after_failed IS NULL
            OR p_after_failed OPERATOR(pg_catalog.=) ANY (ARRAY['fail', 'run']))
    THEN
        RETURN true;
    END IF;
    -- Refused (or a NULL in a NOT NULL column, which its own constraint reports first):
    -- which guard, under the name of the constraint it replaces. Each test is the old
    -- constraint's own expression, failing when it is false (not NULL).
    IF NOT (p_effect OPERATOR(pg_catalog.<>) '') THEN
        v_name := 'jobs_effect_check';
        v_detail := 'effect must not be empty';
    ELSIF NOT (pg_catalog.length(p_key) OPERATOR(pg_catalog.>=) 1
               AND pg_catalog.length(p_key) OPERATOR(pg_catalog.<=) 255) THEN
        v_name := 'jobs_key_check';
        v_detail := 'key is ' || pg_catalog.length(p_key)
            || ' characters long; it must be 1 to 255';
    ELSIF NOT (p_attempts OPERATOR(pg_catalog.>=) 0) THEN
        v_name := 'jobs_attempts_check';
        v_detail := 'attempts is ' || p_attempts || '; it must not be negative';
    ELSIF NOT (p_max_attempts OPERATOR(pg_catalog.>=) 1) THEN
        v_name := 'jobs_max_attempts_check';
        v_detail := 'max_attempts is ' || p_max_attempts || '; it must be at least 1';
    ELSIF NOT (p_claim_version OPERATOR(pg_catalog.>=) 0) THEN
        v_name := 'jobs_claim_version_check';
        v_detail := 'claim_version is ' || p_claim_version || '; it must not be negative';
    ELSIF NOT (p_status OPERATOR(pg_catalog.=) ANY (ARRAY['pending', 'running', 'done',
                                                          'failed', 'reconcile'])) THEN
        v_name := 'jobs_status_valid';
        v_detail := 'status is ' || pg_catalog.quote_literal(p_status)
            || '; it must be pending, running, done, failed or reconcile';
    ELSIF NOT ((p_status OPERATOR(pg_catalog.=) 'running')
               OPERATOR(pg_catalog.=) (p_lease_until IS NOT NULL
                                       AND p_claimed_by IS NOT NULL)) THEN
        v_name := 'jobs_lease_iff_running';
        v_detail := 'a running job has a lease_until and a claimed_by, and only a running '
            || 'one: status is ' || pg_catalog.quote_literal(p_status) || ', lease_until '
            || CASE WHEN p_lease_until IS NULL THEN 'NULL' ELSE 'set' END || ', claimed_by '
            || CASE WHEN p_claimed_by IS NULL THEN 'NULL' ELSE 'set' END;
    ELSIF NOT (p_reconcile_checks OPERATOR(pg_catalog.>=) 0) THEN
        v_name := 'jobs_reconcile_checks_check';
        v_detail := 'reconcile_checks is ' || p_reconcile_checks
            || '; it must not be negative';
    ELSIF NOT (pg_catalog.length(p_group_key) OPERATOR(pg_catalog.>=) 1
               AND pg_catalog.length(p_group_key) OPERATOR(pg_catalog.<=) 255) THEN
        v_name := 'jobs_group_key_length';
        v_detail := 'group_key is ' || pg_catalog.length(p_group_key)
            || ' characters long; it must be 1 to 255 (NULL: no group)';
    ELSIF NOT (p_priority OPERATOR(pg_catalog.>=) -1000
               AND p_priority OPERATOR(pg_catalog.<=) 1000) THEN
        v_name := 'jobs_priority_range';
        v_detail := 'priority is ' || p_priority || '; it must be between -1000 and 1000';
    ELSIF NOT (p_after_waiting OPERATOR(pg_catalog.>=) 0) THEN
        v_name := 'jobs_after_waiting';
        v_detail := 'after_waiting is ' || p_after_waiting || '; it must not be negative';
    ELSIF NOT (p_after_failed OPERATOR(pg_catalog.=) ANY (ARRAY['fail', 'run'])) THEN
        v_name := 'jobs_after_failed';
        v_detail := 'after_failed is ' || pg_catalog.quote_literal(p_after_failed)
            || '; it must be ''fail'' or ''run'' (NULL: the job has no parents)';
    ELSE
        RETURN NULL;  -- only NULLs in NOT NULL columns, which their constraints refuse
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'check_violation', CONSTRAINT = v_name, TABLE = 'jobs',
        MESSAGE = 'new row for relation "jobs" violates check constraint "' || v_name || '"',
        DETAIL = v_detail;
END
$fn$;

ALTER TABLE {schema}.jobs
    ADD CONSTRAINT jobs_row_valid CHECK ({schema}.jobs_row_valid(
        effect, key, status, attempts, max_attempts, claim_version, lease_until, claimed_by,
        reconcile_checks, group_key, priority, after_waiting, after_failed)) NOT VALID,
    DROP CONSTRAINT jobs_effect_check,
    DROP CONSTRAINT jobs_key_check,
    DROP CONSTRAINT jobs_attempts_check,
    DROP CONSTRAINT jobs_max_attempts_check,
    DROP CONSTRAINT jobs_claim_version_check,
    DROP CONSTRAINT jobs_status_valid,
    DROP CONSTRAINT jobs_lease_iff_running,
    DROP CONSTRAINT jobs_reconcile_checks_check,
    DROP CONSTRAINT jobs_group_key_length,
    DROP CONSTRAINT jobs_priority_range,
    DROP CONSTRAINT jobs_after_waiting,
    DROP CONSTRAINT jobs_after_failed;
