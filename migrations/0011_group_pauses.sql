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
