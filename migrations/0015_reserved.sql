-- This number is taken by another change of the same release; this file holds its place
-- so that the versions stay without a gap. It changes nothing.
SELECT 1;
