-- Reserved: this number belongs to a migration of its own, developed alongside 0017.
-- A placeholder (no change) keeps the numbering without a gap until it lands.
SELECT 1;
