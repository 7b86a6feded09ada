-- Fan-in (tx.enqueue(..., after=[key, ...]), outbox.after): a job may wait for other
-- jobs, its parents, named by their keys. Such a child is an ordinary pending job that is
-- not due: its available_at stands a long way ahead (a century, as a pause with no end
-- is stored: psycopg cannot load 'infinity'), so no claim, no "due" count and no metric
-- ever takes it for due work, and after_waiting counts its parents not resolved yet.
-- The statement that settles a parent (done, or failed for good) resolves its edges and
-- releases, in the same transaction, the children whose last parent it was.
--
-- after_waiting: parents of this job not yet done or failed (0: none; the job has no
-- parents, or they are all resolved). Changed under the child's row lock only, so two
-- parents settling at once count down one after the other.
-- after_failed: what a parent failing for good does to this job: 'fail' (it fails too,
-- never performed, its last_error naming the parent) or 'run' (it runs anyway and sees
-- which parents failed). NULL: the job has no parents (a claim asks for the parents'
-- results only for jobs where it is set).
--
-- Both columns are catalogue changes (nullable, or a constant default); the checks are
-- NOT VALID (every existing row holds 0 and NULL, which pass them; new rows are checked).
ALTER TABLE {schema}.jobs
    ADD COLUMN after_waiting integer NOT NULL DEFAULT 0,
    ADD COLUMN after_failed text;

ALTER TABLE {schema}.jobs
    ADD CONSTRAINT jobs_after_waiting CHECK (after_waiting >= 0) NOT VALID,
    ADD CONSTRAINT jobs_after_failed CHECK (after_failed IN ('fail', 'run')) NOT VALID;

-- One row per (child, parent): the child's id (a child is always a job: it is created
-- by the enqueue that names its parents) and the parent's key (a key, not an id: the
-- parent may be only a ledger row, and the key outlives the job). outcome: NULL while the
-- parent is unresolved, then 'done' or 'failed', written once by whichever statement
-- resolves the edge first (the parent's settlement, or the dispatchers' sweep), under the
-- edge's row lock. Rows stay after they are resolved: the dashboard shows a job's
-- parents and children from them; they go with the child (retention, or the completion
-- that deletes it with retention 0).
CREATE TABLE {schema}.after_edges (
    child_id   bigint NOT NULL,
    parent_key text   NOT NULL CHECK (length(parent_key) BETWEEN 1 AND 255),
    outcome    text   CHECK (outcome IN ('done', 'failed')),
    PRIMARY KEY (child_id, parent_key)
);

-- The dashboard finds a job's children here.
CREATE INDEX after_edges_parent ON {schema}.after_edges (parent_key);

-- A parent's settlement finds the children still waiting on it here: only unresolved
-- edges, so the index stays as small as what waits now, whatever the history.
CREATE INDEX after_edges_waiting_parent ON {schema}.after_edges (parent_key)
    WHERE outcome IS NULL;

-- The sweep walks the unresolved edges in child order, a batch at a time.
CREATE INDEX after_edges_waiting ON {schema}.after_edges (child_id, parent_key)
    WHERE outcome IS NULL;

-- Every role that may read, insert into or update the jobs table (a dispatcher's role,
-- an application's role granted table by table) may do the same here, so a running
-- deployment keeps enqueueing and settling once it is migrated. The names come from the
-- catalogue, never from text.
DO $grant$
DECLARE
    jobs_table oid := (SELECT t.typrelid FROM pg_type t
                       WHERE t.oid = pg_typeof(NULL::{schema}.jobs));
    edges regclass := (SELECT t.typrelid::regclass FROM pg_type t
                       WHERE t.oid = pg_typeof(NULL::{schema}.after_edges));
    granted record;
BEGIN
    FOR granted IN
        SELECT DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC'
                             ELSE a.grantee::regrole::text END AS role,
               a.privilege_type AS privilege
        FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a
        WHERE c.oid = jobs_table AND a.grantee <> c.relowner
          AND a.privilege_type IN ('SELECT', 'INSERT', 'UPDATE', 'DELETE')
    LOOP
        EXECUTE format('GRANT %s ON %s TO %s', granted.privilege, edges, granted.role);
    END LOOP;
END
$grant$;
