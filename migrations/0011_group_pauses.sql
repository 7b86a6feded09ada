-- An operator's pause of one group (tenant) of one effect: its jobs stay pending, no
-- attempt counted, while the effect's other groups go on. Read by the claimable rule
-- (one probe of the primary key per candidate; the table holds a row per paused group
-- only). group_key '' stands for the jobs with no group. A pause with no end is stored a
-- century ahead, as an effect's pause is (effect_limits.paused_until). Only a new table:
-- no lock on the jobs table.

CREATE TABLE {schema}.group_pauses (
    effect       text        NOT NULL CHECK (effect <> ''),
    group_key    text        COLLATE "C" NOT NULL CHECK (length(group_key) <= 255),
    paused_until timestamptz NOT NULL,
    paused_by    text,
    paused_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (effect, group_key)
);

-- The claim reads this table: every role that may read the jobs table (a dispatcher's
-- role granted table by table) may read it too, so a running deployment keeps claiming
-- once it is migrated. The names come from the catalogue, never from text: the tables
-- by their row types, the roles as regrole (quoted as identifiers).
DO $grant$
DECLARE
    jobs_table oid := (SELECT t.typrelid FROM pg_type t
                       WHERE t.oid = pg_typeof(NULL::{schema}.jobs));
    pauses regclass := (SELECT t.typrelid::regclass FROM pg_type t
                        WHERE t.oid = pg_typeof(NULL::{schema}.group_pauses));
    reader text;
BEGIN
    FOR reader IN
        SELECT DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC'
                             ELSE a.grantee::regrole::text END
        FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a
        WHERE c.oid = jobs_table AND a.privilege_type = 'SELECT'
          AND a.grantee <> c.relowner
    LOOP
        EXECUTE format('GRANT SELECT ON %s TO %s', pauses, reader);
    END LOOP;
END
$grant$;
