-- Enqueue from any caller that speaks SQL: a trigger, psql, a Node or Go service, in its
-- own transaction. {schema}.enqueue does what tx.enqueue does (outbox/_enqueue.py with the
-- enqueue block of sql/queries.sql): the same validation, the same dedup against the jobs
-- and the ledger, the same fingerprint and the same wake-up of idle dispatchers.
--
-- Privileges: enqueue is SECURITY DEFINER with a pinned search_path (pg_catalog, then
-- pg_temp; every object of the schema is named with its schema), and PUBLIC may not
-- execute it. An application role that is granted USAGE on the schema and EXECUTE on
-- this one function may enqueue and do nothing else: it reads no payload, changes no
-- status and deletes no row (docs/how-to/other-languages.md). A trigger's function runs
-- as the role writing the business row, which therefore needs that EXECUTE.
--
-- Errors a caller can act on carry their own SQLSTATE, which outbox maps back to its
-- error tree (outbox/_callers.py): OB409 the key is already used for another effect or
-- payload (IdempotencyKeyConflict), OB422 the payload (InvalidPayload), OB400 the key or
-- ordering_key (InvalidKey), OB404 an effect the schema does not know (UnknownEffect),
-- 22023 any other argument (InvalidArgument). Each message names the argument.

-- The effects this schema accepts from SQL callers. Empty (as created): any effect name.
-- Once it holds a name, enqueue refuses every effect not in it, as tx.enqueue does after
-- outbox.register_effects.
CREATE TABLE {schema}.known_effects (
    effect text PRIMARY KEY CHECK (effect <> '')
);

-- The payload's canonical JSON text, the one definition the fingerprint is taken over
-- (outbox._enqueue.canonical_json makes the same text in Python, tested equal): keys in
-- code point order ("C" order of their UTF-8 bytes), no whitespace, strings escaped as
-- jsonb prints them (only quote, backslash and control characters), numbers as jsonb
-- prints them (1e+16 is 10000000000000000, -0.0 is 0.0).
CREATE FUNCTION {schema}.canonical_json(value jsonb) RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
AS $fn$
BEGIN
    CASE jsonb_typeof(value)
    WHEN 'object' THEN
        RETURN '{{' || coalesce((
            SELECT string_agg(to_jsonb(e.key)::text || ':' || {schema}.canonical_json(e.value),
                              ',' ORDER BY e.key COLLATE "C")
            FROM jsonb_each(value) AS e), '') || '}}';
    WHEN 'array' THEN
        RETURN '[' || coalesce((
            SELECT string_agg({schema}.canonical_json(a.value), ',' ORDER BY a.n)
            FROM jsonb_array_elements(value) WITH ORDINALITY AS a(value, n)), '') || ']';
    ELSE
        RETURN value::text;
    END CASE;
END
$fn$;

-- What identifies (effect, payload): a key reused with another request is a conflict.
-- sha256 of the effect, a newline and the canonical JSON (outbox._enqueue.fingerprint).
CREATE FUNCTION {schema}.fingerprint(effect text, payload jsonb) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $fn$
    SELECT encode(sha256(convert_to(effect || E'\n' || {schema}.canonical_json(payload), 'UTF8')),
                  'hex')
$fn$;

-- A key or ordering key as tx.enqueue takes it (outbox._enqueue.validate_key): 1 to 255
-- printable ASCII characters. Raises OB400 naming the argument.
CREATE FUNCTION {schema}.check_enqueue_key(what text, value text) RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $fn$
DECLARE
    bad text;
BEGIN
    IF value IS NULL OR value = '' THEN
        RAISE EXCEPTION USING ERRCODE = 'OB400', MESSAGE = what || ' must not be empty';
    END IF;
    IF length(value) > 255 THEN
        RAISE EXCEPTION USING ERRCODE = 'OB400', MESSAGE = what || ' is ' || length(value)
            || ' characters long; at most 255 are allowed (providers cap idempotency keys '
            || 'at 255)';
    END IF;
    bad := substring(value FROM '[^\x20-\x7e]');
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'OB400', MESSAGE = what || ' '
            || quote_literal(left(value, 40)) || ' has a character that is not printable '
            || 'ASCII (' || to_jsonb(bad)::text || ') at position ' || (strpos(value, bad) - 1);
    END IF;
END
$fn$;

CREATE FUNCTION {schema}.enqueue(
    effect text, key text, payload jsonb, run_at timestamptz DEFAULT NULL,
    group_key text DEFAULT NULL, priority integer DEFAULT 0, ordering_key text DEFAULT NULL,
    max_attempts integer DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    v_canonical   text;
    v_fingerprint text;
    v_id          bigint;
    v_known       record;
    v_effects     text;
BEGIN
    IF enqueue.effect IS NULL OR btrim(enqueue.effect) = '' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'effect must be a non-empty string '
            || '(an effect''s name, e.g. ''email.send''), got ' || coalesce(
                quote_literal(enqueue.effect), 'NULL');
    END IF;
    IF EXISTS (SELECT 1 FROM {schema}.known_effects) AND NOT EXISTS (
            SELECT 1 FROM {schema}.known_effects k WHERE k.effect = enqueue.effect) THEN
        SELECT string_agg(k.effect, ', ' ORDER BY k.effect) INTO v_effects
        FROM {schema}.known_effects k;
        RAISE EXCEPTION USING ERRCODE = 'OB404', MESSAGE = 'effect '
            || quote_literal(enqueue.effect) || ' is not registered (registered: '
            || v_effects || ')';
    END IF;
    PERFORM {schema}.check_enqueue_key('key', enqueue.key);
    IF enqueue.ordering_key IS NOT NULL THEN
        PERFORM {schema}.check_enqueue_key('ordering_key', enqueue.ordering_key);
    END IF;
    IF enqueue.max_attempts IS NOT NULL AND enqueue.max_attempts < 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'max_attempts must be a positive '
            || 'integer, got ' || enqueue.max_attempts;
    END IF;
    IF enqueue.group_key = '' OR length(enqueue.group_key) > 255 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'group_key must be 1 to 255 '
            || 'characters (NULL means no group), got ' || length(enqueue.group_key)
            || ' characters';
    END IF;
    IF enqueue.priority IS NULL OR enqueue.priority NOT BETWEEN -1000 AND 1000 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'priority is '
            || coalesce(enqueue.priority::text, 'NULL')
            || '; it must be between -1000 and 1000 (higher first, default 0)';
    END IF;
    IF enqueue.payload IS NULL OR jsonb_typeof(enqueue.payload) <> 'object' THEN
        RAISE EXCEPTION USING ERRCODE = 'OB422', MESSAGE = 'payload must be a JSON object, got '
            || coalesce('a JSON ' || jsonb_typeof(enqueue.payload), 'NULL');
    END IF;
    v_canonical := {schema}.canonical_json(enqueue.payload);
    IF octet_length(v_canonical) > 1000000 THEN
        RAISE EXCEPTION USING ERRCODE = 'OB422', MESSAGE = 'payload is '
            || octet_length(v_canonical) || ' bytes as JSON; at most 1000000 are allowed '
            || '(store large data in your own tables and pass its id)';
    END IF;
    v_fingerprint := encode(sha256(convert_to(enqueue.effect || E'\n' || v_canonical, 'UTF8')),
                            'hex');

    -- As the enqueue block: a key the ledger holds is never a new job.
    IF NOT EXISTS (SELECT 1 FROM {schema}.effect_results r WHERE r.key = enqueue.key) THEN
        INSERT INTO {schema}.jobs AS j (effect, key, payload, fingerprint, available_at,
                                        ordering_key, max_attempts, group_key, priority)
        VALUES (enqueue.effect, enqueue.key, enqueue.payload, v_fingerprint,
                coalesce(enqueue.run_at, now()), enqueue.ordering_key,
                coalesce(enqueue.max_attempts, 25), enqueue.group_key, enqueue.priority)
        ON CONFLICT ON CONSTRAINT jobs_key_unique DO NOTHING
        RETURNING j.id INTO v_id;
        IF v_id IS NOT NULL THEN
            -- Wakes idle dispatchers when the caller's transaction commits.
            PERFORM pg_notify({channel}, '');
            RETURN v_id;
        END IF;
    END IF;

    -- The key is known. A statement of its own, so under READ COMMITTED it sees a row a
    -- concurrent transaction committed while the insert waited for it.
    SELECT j.id, coalesce(j.effect, r.effect) AS effect,
           coalesce(j.fingerprint, r.fingerprint) AS fingerprint
    INTO v_known
    FROM (SELECT enqueue.key AS key) AS k
    LEFT JOIN {schema}.jobs j ON j.key = k.key
    LEFT JOIN {schema}.effect_results r ON r.key = k.key;
    IF v_known.effect IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '40001', MESSAGE = 'key ' || quote_literal(enqueue.key)
            || ' was enqueued by a concurrent transaction this snapshot cannot see: retry the '
            || 'transaction';
    END IF;
    IF v_known.effect <> enqueue.effect THEN
        RAISE EXCEPTION USING ERRCODE = 'OB409', DETAIL = 'key: ' || enqueue.key,
            MESSAGE = 'idempotency key ' || quote_literal(enqueue.key) || ' is already used '
                || 'for effect ' || quote_literal(v_known.effect) || ', not '
                || quote_literal(enqueue.effect);
    END IF;
    IF v_known.fingerprint <> v_fingerprint THEN
        RAISE EXCEPTION USING ERRCODE = 'OB409', DETAIL = 'key: ' || enqueue.key,
            MESSAGE = 'idempotency key ' || quote_literal(enqueue.key) || ' is already used '
                || 'for ' || quote_literal(v_known.effect) || ' with a different payload';
    END IF;
    -- The existing job, or NULL when only the ledger remembers the key (the job was done
    -- and retention removed its row): either way nothing new was enqueued.
    RETURN v_known.id;
END
$fn$;

REVOKE ALL ON FUNCTION {schema}.enqueue(text, text, jsonb, timestamptz, text, integer, text,
                                        integer) FROM PUBLIC;
