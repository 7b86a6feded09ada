-- Reserved: another change takes version 18. Nothing to do.
SELECT 1;
