-- Fan-in (outbox._after, migration 0015): jobs that wait for other jobs. A child names
-- its parents by key at enqueue (after_link); it is pending but not due (its available_at
-- is after_never) while after_waiting > 0. Whatever settles a parent for good (done,
-- or failed) resolves the parent's edges and releases or fails its children in the same
-- statement (fragment after_released, bound into complete, complete_delete, settle,
-- rescue, the hooks' and the reconciler's fenced writes, and the operator's cancel and
-- resolve). The dispatchers' sweep (after_sweep) finds what those could not see: a child
-- whose transaction was still open when its parent's settlement committed.
-- Same rules as the core's other files (outbox/_sql.py CORE_FILES): {schema} is the quoted schema identifier, values are bound
-- by name; SQLAlchemy's text() reads "::" badly, so enqueue-side parameters use CAST.

-- fragment: after_never
-- The available_at of a child waiting on its parents: never due (the claimable rule
-- wants available_at <= now()). A fixed date, not 'infinity': psycopg cannot load that,
-- and every reader of the jobs table (the test kit's, a user's SELECT *) would fail.
timestamptz '9999-01-01 00:00:00+00'

-- fragment: after_released
-- The parents settled for good in this statement, as a CTE parents(key, outcome, error)
-- before it (outcome 'done' or 'failed'; error: the parent's last_error), resolve their
-- unresolved edges (resolved_edges) and count their children down (woken), one set-based
-- statement however many children, each as outbox._lifecycle.parent_settled decides
-- (its rule, rendered here): a child whose last parent this was becomes due now; a
-- child of a failed parent fails (never performed, last_error naming the parent's key)
-- unless it was enqueued with after_failed='run', which counts the failed parent as
-- resolved. An edge is resolved once: its row lock orders two statements resolving it at
-- once (a settlement and the sweep), and the second finds outcome set and skips it. The
-- children's counts change under their row locks, so two parents of one child settling
-- at once count down one after the other. No child is locked by a business transaction
-- that the settlement can see (a child's enqueue commits before its edges are visible),
-- so a settlement never waits on one.
resolved_edges AS (
    UPDATE {schema}.after_edges e
    SET outcome = p.outcome
    FROM parents p
    WHERE e.parent_key = p.key AND e.outcome IS NULL
      -- Uncorrelated: evaluated once, and while no job waits on any parent (after=[...]
      -- unused) the join is not run at all, so the statement costs what it did before.
      AND {after_in_use}
    RETURNING e.child_id, e.parent_key, e.outcome
), woken AS (
    UPDATE {schema}.jobs j
    SET after_waiting = greatest(0, j.after_waiting - c.n),
        -- What outbox._lifecycle.parent_settled decides, applied: its rule's cases
        -- (PARENT_SETTLED) rendered as CASE expressions when this file is loaded
        -- (outbox._rule_sql), over the facts as this statement reads them: mode
        -- j.after_failed, waiting j.after_waiting, settled c.n, failed c.failed, and
        -- failed_error that parent's error in parents (read only where it is written).
        status = {parent_status},
        last_error = {parent_error},
        available_at = {parent_available_at},
        updated_at = now()
    FROM (SELECT r.child_id, count(*) AS n,
                 min(r.parent_key) FILTER (WHERE r.outcome = 'failed') AS failed
          FROM resolved_edges r GROUP BY r.child_id) c
    -- The ids also through an array, so the children are found by the primary key (as
    -- the claim finds its candidates) rather than by a walk of every pending job.
    WHERE j.id = ANY (ARRAY(SELECT r.child_id FROM resolved_edges r))
      AND j.id = c.child_id AND j.status = 'pending' AND j.after_waiting > 0
    RETURNING j.id, j.status, j.after_waiting
)

-- fragment: after_in_use
-- Whether any job waits on a parent now: the first entry of the index of unresolved
-- edges (in its order, so that no plan reads the resolved history to find none). An
-- uncorrelated condition, so a statement evaluates it once (an initplan), and a join
-- gated by it is not run at all while nothing waits.
((SELECT w.child_id FROM {schema}.after_edges w WHERE w.outcome IS NULL
  ORDER BY w.child_id, w.parent_key LIMIT 1) IS NOT NULL)

-- fragment: after_parent_state
-- What a parent key pk.key (a column of the enclosing query) says about a child waiting
-- on it: its job's status when it is 'done' or 'failed' (a job failed with its ledger
-- row, after its on_done hook kept raising, is failed: so its settlement said), NULL
-- while it is to come (pending, running, in reconcile); and 'done' when the key has no
-- job row any more: only a done job is deleted (by retention, or by its completion with
-- retention 0; its ledger row stays), and enqueue refuses a key that never was a job.
(SELECT CASE WHEN pj.id IS NULL THEN 'done'
             WHEN pj.status IN ('done', 'failed') THEN pj.status END
 FROM (SELECT 1) AS one LEFT JOIN {schema}.jobs pj ON pj.key = pk.key)

-- name: after_unknown
-- Which of %(keys)s name no job and no ledger row (as this transaction sees them): a
-- child may wait only on parents that exist, so none is ever waited for in vain, and no
-- cycle can be built (a parent exists before any child names it).
SELECT k.key
FROM unnest(CAST(%(keys)s AS text[])) AS k(key)
WHERE NOT EXISTS (SELECT 1 FROM {schema}.jobs j WHERE j.key = k.key)
  AND NOT EXISTS (SELECT 1 FROM {schema}.effect_results r WHERE r.key = k.key);

-- name: after_states
-- What the parents of the children just created (%(links)s: a JSON array of {id, after:
-- [keys]}) say about them, per (child, parent key): 'done' or 'failed' when the parent
-- is settled for good (fragment after_parent_state), NULL while it is to come, and the
-- parent's last_error (shortened). Parents enqueued in this very transaction are seen
-- (pending: waited for). What outbox._lifecycle.parent_settled decides each child with.
SELECT w.child_id, w.key,
       (SELECT {after_parent_state} FROM (SELECT w.key AS key) pk) AS outcome,
       (SELECT left(pj.last_error, 200) FROM {schema}.jobs pj WHERE pj.key = w.key)
           AS error
FROM (SELECT CAST(l ->> 'id' AS bigint) AS child_id, p.key
      FROM jsonb_array_elements(CAST(%(links)s AS jsonb)) AS l
      CROSS JOIN LATERAL jsonb_array_elements_text(l -> 'after') AS p(key)) w
ORDER BY w.child_id, w.key;

-- name: after_link
-- The children just created (%(links)s: a JSON array of {id, mode, edges: [[key,
-- outcome]], status, error, waiting, waits}) get their edges (with the outcomes
-- after_states read), and each what outbox._lifecycle.parent_settled decided for it:
-- its status (failed: a parent failed for good and its mode is 'fail'), error, the
-- parents still to come (after_waiting), and, while it waits (waits), the available_at
-- of a job that is never due (after_never). One statement for any number of children
-- and parents; the child rows are this transaction's own, so nothing waits.
WITH links AS (
    SELECT CAST(l ->> 'id' AS bigint) AS child_id, l ->> 'mode' AS mode,
           l ->> 'status' AS status, l ->> 'error' AS error,
           CAST(l ->> 'waiting' AS integer) AS waiting, CAST(l ->> 'waits' AS boolean) AS waits,
           l -> 'edges' AS edges
    FROM jsonb_array_elements(CAST(%(links)s AS jsonb)) AS l
), edges AS (
    INSERT INTO {schema}.after_edges (child_id, parent_key, outcome)
    SELECT k.child_id, e ->> 0, e ->> 1
    FROM links k CROSS JOIN LATERAL jsonb_array_elements(k.edges) AS e
    ON CONFLICT (child_id, parent_key) DO NOTHING
)
UPDATE {schema}.jobs j
SET after_failed = k.mode,
    after_waiting = k.waiting,
    status = k.status,
    last_error = k.error,
    available_at = CASE WHEN k.waits THEN {after_never} ELSE j.available_at END
FROM links k
WHERE j.id = k.child_id
RETURNING j.id, j.status, j.after_waiting;

-- name: after_results
-- What the claimed children %(ids)s see of their parents: per edge, the parent's
-- outcome and its ledger result as text (NULL for a failed parent).
SELECT e.child_id, e.parent_key, e.outcome, CAST(r.result AS text) AS result,
       (SELECT left(pj.last_error, 300) FROM {schema}.jobs pj
        WHERE pj.key = e.parent_key AND e.outcome = 'failed') AS error
FROM {schema}.after_edges e
LEFT JOIN {schema}.effect_results r ON r.key = e.parent_key
WHERE e.child_id = ANY(CAST(%(ids)s AS bigint[]))
ORDER BY e.child_id, e.parent_key;

-- name: after_sweep
-- The dispatchers' sweep: up to %(limit)s unresolved edges after the edge (%(child)s,
-- %(parent)s), in (child, parent key) order, whose parents are settled for good already:
-- a parent whose settlement committed while the child's transaction was still open
-- (neither saw the other under READ COMMITTED). Those parents' edges are resolved and
-- their children released or failed, as the settlement would have (fragment
-- after_released). Answers the last edge looked at (NULLs: the walk reached the end;
-- start again from the first) and how many children it woke. Bounded: one range of the
-- index of unresolved edges a call, whatever their number, even for one child with
-- more parents than a batch.
WITH batch AS (
    SELECT e.child_id, e.parent_key
    FROM {schema}.after_edges e
    WHERE e.outcome IS NULL
      AND (e.child_id, e.parent_key) > (%(child)s::bigint, %(parent)s::text)
    ORDER BY e.child_id, e.parent_key
    LIMIT %(limit)s::integer
), parents AS (
    SELECT s.key, s.outcome,
           (SELECT pj.last_error FROM {schema}.jobs pj WHERE pj.key = s.key) AS error
    FROM (SELECT pk.key, {after_parent_state} AS outcome
          FROM (SELECT DISTINCT b.parent_key AS key FROM batch b) pk) s
    WHERE s.outcome IS NOT NULL
), {after_released}
SELECT w.child_id AS walked_child, w.parent_key AS walked_parent,
       (SELECT count(*) FROM woken) AS woken
FROM (SELECT 1) AS one
LEFT JOIN (SELECT b.child_id, b.parent_key FROM batch b
           WHERE (SELECT count(*) FROM batch) >= %(limit)s::integer
           ORDER BY b.child_id DESC, b.parent_key DESC LIMIT 1) w ON true;
