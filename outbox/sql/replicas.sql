-- Waiting for the standbys (Dispatcher(wait_for_replicas=True)): where the primary's WAL
-- is, and what every streaming physical standby has flushed of it. No schema: these read
-- the server's replication state only.

-- name: replica_access
-- Whether this role can read the standbys' positions: pg_stat_replication shows them to
-- members of pg_read_all_stats (pg_monitor is one) and to superusers, NULL to others.
SELECT pg_has_role(current_user, 'pg_read_all_stats', 'USAGE')
       OR (SELECT r.rolsuper FROM pg_roles r WHERE r.rolname = current_user) AS allowed,
       current_user AS role;

-- name: replica_wal_position
-- The end of the WAL inserted so far: after the claim's commit, so past its commit
-- record and the enqueues' before it.
SELECT pg_current_wal_insert_lsn()::text AS lsn;

-- name: replicas_behind
-- The streaming physical standbys that have not flushed the WAL up to %(lsn)s (a
-- logical subscriber is not a standby: its slot's walsender is left out), and how many
-- stream at all; only those whose application_name is in %(names)s, unless NULL (every
-- one).
SELECT count(*) FILTER (WHERE r.flush_lsn IS NULL OR r.flush_lsn < CAST(%(lsn)s AS pg_lsn))
         AS behind,
       count(*) AS streaming,
       string_agg(r.application_name || ' (' || coalesce(host(r.client_addr), 'local')
                  || ')', ', ')
         FILTER (WHERE r.flush_lsn IS NULL OR r.flush_lsn < CAST(%(lsn)s AS pg_lsn))
         AS lagging
FROM pg_stat_replication r
WHERE r.state = 'streaming'
  AND (CAST(%(names)s AS text[]) IS NULL
       OR r.application_name = ANY (CAST(%(names)s AS text[])))
  AND r.pid NOT IN (SELECT s.active_pid FROM pg_replication_slots s
                    WHERE s.slot_type = 'logical' AND s.active_pid IS NOT NULL);
