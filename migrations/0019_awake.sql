-- The wake-up of idle dispatchers without a NOTIFY per business transaction.
--
-- A transaction that notified takes one lock for the whole server at its commit and holds
-- it through the commit's flush: every enqueue notifying made the business's commits
-- queue behind each other. Now an enqueue notifies only when no dispatcher serving its
-- effect is awake. A dispatcher in run() that keeps claiming marks itself awake here,
-- one row per effect it serves, valid until `until` (it refreshes the row while busy);
-- before it sleeps it takes its rows away through fall_asleep, which also waits for
-- every enqueue that read the rows before (see there), and then claims once more.
--
-- Dispatchers that never write here (a release before this one, a fleet's turns,
-- run_until_idle) are never awake as far as an enqueue knows: they are notified as before.
CREATE TABLE {schema}.awake (
    effect     text NOT NULL,
    dispatcher text NOT NULL,
    until      timestamptz NOT NULL,
    PRIMARY KEY (effect, dispatcher)
);

-- A dispatcher going to sleep: its rows away, then the fence. Every enqueue statement
-- reads this table, so it holds an ACCESS SHARE lock on it from before its snapshot was
-- taken (PostgreSQL locks a statement's relations first) until its transaction ends.
-- ACCESS EXCLUSIVE waits for each of them: an enqueue that saw this dispatcher awake
-- (and so did not notify) has committed or rolled back before this returns, and the
-- claim the dispatcher makes next sees its job. An enqueue that comes later waits behind
-- the lock, takes its snapshot after this commits, sees no row, and notifies. So the
-- wait is short for enqueuers: lock_timeout bounds it. True when the fence held; false
-- when it timed out (a business transaction that read the rows is still open): the rows
-- are gone all the same, and that transaction's job waits at most a poll interval.
-- The lock is asked for before the rows are deleted, holding nothing on the table while
-- it waits: two dispatchers falling asleep at once, each holding the DELETE's lock and
-- asking for ACCESS EXCLUSIVE, would wait for each other (a deadlock the detector may
-- find before lock_timeout on a loaded server).
CREATE FUNCTION {schema}.fall_asleep(p_dispatcher text, p_timeout text DEFAULT '50ms')
RETURNS boolean
LANGUAGE plpgsql VOLATILE
AS $fn$
BEGIN
    BEGIN
        PERFORM set_config('lock_timeout', p_timeout, true);
        LOCK TABLE {schema}.awake IN ACCESS EXCLUSIVE MODE;
        DELETE FROM {schema}.awake
        WHERE dispatcher = p_dispatcher OR until < now() - interval '1 hour';
        RETURN true;
    EXCEPTION WHEN lock_not_available THEN
        NULL;  -- the block's lock and lock_timeout are undone with it
    END;
    DELETE FROM {schema}.awake
    WHERE dispatcher = p_dispatcher OR until < now() - interval '1 hour';
    RETURN false;
END
$fn$;

-- Roles that may read the jobs table (an application enqueuing, a dispatcher) may read
-- this one; those that may change jobs (a dispatcher) may change this one, so a running
-- deployment keeps enqueueing and dispatching once migrated. Names from the catalogue.
DO $grant$
DECLARE
    jobs_table oid := (SELECT t.typrelid FROM pg_type t
                       WHERE t.oid = pg_typeof(NULL::{schema}.jobs));
    awake_table regclass := (SELECT t.typrelid::regclass FROM pg_type t
                             WHERE t.oid = pg_typeof(NULL::{schema}.awake));
    granted record;
BEGIN
    FOR granted IN
        SELECT DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC'
                             ELSE a.grantee::regrole::text END AS role,
               CASE WHEN a.privilege_type = 'INSERT' THEN 'SELECT'
                    ELSE a.privilege_type END AS privilege
        FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a
        WHERE c.oid = jobs_table AND a.grantee <> c.relowner
          AND a.privilege_type IN ('SELECT', 'INSERT', 'UPDATE', 'DELETE')
    LOOP
        EXECUTE format('GRANT %s ON %s TO %s', granted.privilege, awake_table, granted.role);
    END LOOP;
END
$grant$;
