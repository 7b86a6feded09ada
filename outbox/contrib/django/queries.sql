-- The Django app's own statements. {schema} is the outbox schema, quoted.

-- name: version
-- The schema's applied outbox version; no row when outbox was never migrated there.
SELECT coalesce(max(version), 0) FROM {schema}.schema_migrations;

-- name: has_versions
-- Whether the schema holds outbox's migrations record at all.
SELECT to_regclass(%(versions)s) IS NOT NULL;

-- name: data_tables
-- Every table of the schema that holds data (all but the migrations record), for flush.
SELECT tablename FROM pg_catalog.pg_tables
WHERE schemaname = %(schema_name)s AND tablename <> 'schema_migrations'
ORDER BY tablename;

-- name: migrated_schemas
-- Those of the schemas %(schemas)s (text[]) that hold an outbox: its jobs table and its
-- migrations record, both made by the one transaction of its first migration.
SELECT s FROM unnest(CAST(%(schemas)s AS text[])) AS s
WHERE to_regclass(format('%%I.schema_migrations', s)) IS NOT NULL
  AND to_regclass(format('%%I.jobs', s)) IS NOT NULL;
