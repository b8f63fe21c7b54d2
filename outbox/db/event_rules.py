"""The rules of a valid event, in one place for every way to publish.

``publish()`` / ``publish_many()`` check an event in Python before anything is sent; the SQL
functions ``outbox_publish`` and ``outbox_publish_many`` (installed by migration 0010) check
it in the database, for triggers, psql and services in other languages. Both take their
limits and their words from this module: the SQL functions' text is rendered from the
constants and problem templates below (``%s`` placeholders, which Python's ``%`` and SQL's
``format()`` both fill), so a limit changed here changes both paths, and a differential
test sends the same inputs through both and expects the same event or the same error.

The rules, in the order they are checked (the first problem is the one named):

1. ``topic``: required; a string of 1..255 characters, not only whitespace (Python's
   ``str.isspace``: ``WHITESPACE``).
2. ``key``: optional; a string of 1..1,024 characters, not only whitespace.
3. ``headers``: optional; a JSON object (a mapping), JSON ``null`` meaning none.
4. ``payload``: any JSON value (``null`` included) nested at most 64 levels, with no integer
   of more than 1,000 digits, of at most ``max_payload_bytes`` bytes as compact JSON (no
   space after ``,`` and ``:``, numbers as ``jsonb`` prints them: ``publish()`` writes
   floats in that form, see :mod:`outbox.publish`). Default 1 MiB: ``publish``'s
   ``max_payload_bytes`` argument; the SQL functions read the setting
   ``outbox.max_payload_bytes`` (``ALTER DATABASE ... SET outbox.max_payload_bytes = ...``),
   else the default.
5. ``headers`` again: the rules of the payload, at most 64 KiB.
6. ``run_at`` (an aware time, years 1 to 9999 in UTC: what Python's ``datetime`` holds) and
   ``delay`` (seconds, 0..100 years after the transaction's start), at most one of them.
7. ``dedup_key``: a string of 1..255 characters, not only whitespace.
8. ``priority``: an integer in -1000..1000.

What only one path can meet: Python objects that are not JSON (sets, NaN, naive datetimes,
NUL characters and unpaired surrogates, which PostgreSQL's ``text`` and ``jsonb`` cannot hold
at all, so a SQL caller gets PostgreSQL's own error before the function runs). Where a
payload has two problems, which is named may differ: ``jsonb`` orders an object's keys by
length, Python by insertion, and the SQL functions name the field (``payload``), not the
place inside it (``payload['items'][3]``).

An error from the SQL functions has SQLSTATE 22023 (``invalid_parameter_value``), the
message ``<field>: <problem>`` as :class:`~outbox.errors.InvalidEventError` prints it, and
the field in the error's column name (psycopg: ``exc.diag.column_name``).
"""

from __future__ import annotations

#: Longest topic or consumer name, in characters.
MAX_NAME_LENGTH = 255
#: Longest event key, in characters.
MAX_KEY_LENGTH = 1024
#: Deepest nesting of objects and arrays accepted in a payload or headers.
MAX_DEPTH = 64
#: Largest payload accepted by default: 1 MiB of compact JSON.
DEFAULT_MAX_PAYLOAD_BYTES = 1_048_576
#: Largest encoded headers object, bytes.
MAX_HEADERS_BYTES = 65_536
#: Longest integer accepted in a payload, in decimal digits (Python refuses to print ints
#: past 4,300 digits by default; no JSON consumer needs more).
MAX_INT_DIGITS = 1000
#: Longest ``dedup_key``, in characters: with a topic of ``MAX_NAME_LENGTH`` it stays below
#: the 2,704-byte limit of a B-tree entry of ``ix_outbox_events_dedup`` (4 bytes a character).
MAX_DEDUP_KEY_LENGTH = 255
#: Largest ``priority`` of an event (and ``-MAX_EVENT_PRIORITY`` the smallest).
MAX_EVENT_PRIORITY = 1000
#: Longest ``delay``, seconds (100 years of 365.25 days).
MAX_DELAY_SECONDS = 3_155_760_000

#: The characters ``str.isspace`` accepts (Python 3.12, Unicode 15): a name made only of
#: these is empty. The SQL functions test names against the same set.
WHITESPACE = ("\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
              "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")

# Problems: what follows the field's name in an error. ``%s`` marks a value.
REQUIRED = "is required"
NOT_A_STR = "must be a str, got %s"
EMPTY = "must not be empty"
TOO_LONG = "is %s characters long, the limit is %s"
NOT_A_MAPPING = "must be a mapping, got %s"
TOO_DEEP = f"nests deeper than {MAX_DEPTH} levels"
INT_TOO_LONG = f"is an integer of more than {MAX_INT_DIGITS} digits"
TOO_LARGE = "is %s bytes encoded, the limit is %s bytes"
NOT_A_DATETIME = "must be a datetime, got %s"
NAIVE_DATETIME = ("is a naive datetime; pass an aware one, such as "
                  "datetime.now(timezone.utc) + timedelta(minutes=5)")
DELAY_WITH_RUN_AT = "cannot be given with run_at; pass one of them"
RUN_AT_RANGE = "is out of range in UTC (years 1 to 9999)"
#: The times Python's ``datetime`` holds, in UTC: a ``run_at`` outside them could not be read
#: by a relay (psycopg refuses to load it), so the table's CHECK refuses it from every writer
#: (migration 0011) and the SQL functions name it first.
RUN_AT_FIRST = "0001-01-01 00:00:00+00"
RUN_AT_END = "10000-01-01 00:00:00+00"
RUN_AT_CHECK = f"run_at >= '{RUN_AT_FIRST}' AND run_at < '{RUN_AT_END}'"
NOT_SECONDS = "must be a number of seconds, got %s"
DELAY_RANGE = f"must be seconds in 0..{MAX_DELAY_SECONDS}"
NOT_AN_INT = "must be an int, got %s"
PRIORITY_RANGE = f"must be in {-MAX_EVENT_PRIORITY}..{MAX_EVENT_PRIORITY}, got %s"
#: What a ``publish_many`` item (and an element of ``outbox_publish_many``'s array) may be.
ITEM_SHAPE = ("an item is a mapping with topic and payload, and optionally key, headers, run_at, delay, "
              "dedup_key and priority, or a tuple (topic, payload[, key[, headers]])")

#: Names of the SQL functions (schema objects of outbox, like its tables).
PUBLISH_FUNCTION = "outbox_publish"
PUBLISH_MANY_FUNCTION = "outbox_publish_many"
#: The helpers they share, in dependency order (created first, dropped last).
HELPER_FUNCTIONS = ("outbox_json_type_name", "outbox_name_problem", "outbox_json_problem",
                    "outbox_event_problem", "outbox_insert_event")


def _sql(text: str) -> str:
    """``text`` as a SQL string literal (standard_conforming_strings: only quotes double)."""
    return "'" + text.replace("'", "''") + "'"


def _regex_class(characters: str) -> str:
    """A regular expression bracket expression of ``characters`` in ARE escapes."""
    return "[" + "".join(f"\\u{ord(c):04x}" for c in characters) + "]"


_BLANK = _sql("^" + _regex_class(WHITESPACE) + "*$")
#: jsonpath: an item nested deeper than MAX_DEPTH (the root is level 0).
_TOO_DEEP_PATH = _sql(f"strict $.**{{{MAX_DEPTH + 1}}}")
_LONG_INT_PATH = _sql(f'strict $.** ? (@.type() == "number" && (@ >= 1e{MAX_INT_DIGITS} '
                      f'|| @ <= -1e{MAX_INT_DIGITS}))')
#: Matches a whole JSON string (kept) or the space after a separator outside strings.
_SEPARATOR_SPACE = _sql(r'("(?:[^"\\]|\\.)*")|([,:]) ')
_ORDER_LOCK = "CAST(CAST(CAST('outbox_events' AS regclass) AS oid) AS int)"

#: The functions that write events: PostgreSQL lets every role (PUBLIC) execute a new
#: function; these are taken back, and ``outbox-relay grants --publisher`` gives them to the
#: publisher role (they run with the caller's privileges: its column grants still apply).
WRITING_FUNCTIONS = (
    f"{PUBLISH_FUNCTION}(text, jsonb, text, jsonb, timestamptz, double precision, integer, text)",
    f"{PUBLISH_MANY_FUNCTION}(jsonb)",
    "outbox_insert_event(text, jsonb, text, jsonb, timestamptz, double precision, integer, text)",
)

#: CREATE statements of the SQL functions (migration 0010 and ``metadata.create_all``).
#: Each function resolves outbox's tables in the schema it was created in (``SET search_path
#: FROM CURRENT`` on those that read tables, after the first statement set it to outbox's
#: schema and ``pg_temp``), so a caller's own search path, temporary tables included, does
#: not matter.
PUBLISH_FUNCTIONS_DDL: tuple[str, ...] = (
    # The search path the functions keep: outbox's schema, then pg_temp. Listed last, pg_temp
    # cannot put a caller's temporary table named outbox_events in front of outbox's (unlisted,
    # PostgreSQL searches it first). Transaction-local: the migration's transaction only.
    "SELECT set_config('search_path', quote_ident(current_schema()) || ', pg_temp', true)",
    """
    CREATE OR REPLACE FUNCTION outbox_json_type_name(value jsonb) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
        SELECT CASE jsonb_typeof(value)
            WHEN 'object' THEN 'dict' WHEN 'array' THEN 'list' WHEN 'string' THEN 'str'
            WHEN 'boolean' THEN 'bool' WHEN 'null' THEN 'NoneType'
            ELSE CASE WHEN value::text LIKE '%.%' THEN 'float' ELSE 'int' END
        END
    $$
    """,
    f"""
    CREATE OR REPLACE FUNCTION outbox_name_problem(value text, max_length integer) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
        SELECT CASE
            WHEN value ~ {_BLANK} THEN {_sql(EMPTY)}
            WHEN char_length(value) > max_length THEN format({_sql(TOO_LONG)}, char_length(value), max_length)
        END
    $$
    """,
    f"""
    CREATE OR REPLACE FUNCTION outbox_json_problem(value jsonb, max_bytes integer) RETURNS text
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
    DECLARE
        size integer;
    BEGIN
        IF jsonb_path_exists(value, {_TOO_DEEP_PATH}) THEN
            RETURN {_sql(TOO_DEEP)};
        END IF;
        IF jsonb_path_exists(value, {_LONG_INT_PATH}) THEN
            RETURN {_sql(INT_TOO_LONG)};
        END IF;
        size := octet_length(value::text);
        IF size > max_bytes THEN  -- jsonb prints a space after each separator: measure without them
            size := octet_length(regexp_replace(value::text, {_SEPARATOR_SPACE}, '\\1\\2', 'g'));
            IF size > max_bytes THEN
                RETURN format({_sql(TOO_LARGE)}, size, max_bytes);
            END IF;
        END IF;
        RETURN NULL;
    END $$
    """,
    # types: a JSON object of problems found while reading a batch item's fields (field ->
    # problem), reported in the order of the rules; NULL from outbox_publish, whose
    # arguments are typed.
    f"""
    CREATE OR REPLACE FUNCTION outbox_event_problem(
        topic text, payload jsonb, key text, headers jsonb, run_at timestamptz, delay double precision,
        priority integer, dedup_key text, types jsonb DEFAULT NULL) RETURNS text[]
    LANGUAGE plpgsql STABLE AS $$
    DECLARE
        problem text;
        setting text := nullif(current_setting('outbox.max_payload_bytes', true), '');
        max_payload_bytes integer := {DEFAULT_MAX_PAYLOAD_BYTES};
    BEGIN
        IF setting IS NOT NULL THEN
            IF setting !~ '^[0-9]{{1,9}}$' OR CAST(setting AS integer) < 1 THEN
                RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
                    MESSAGE = format('the setting outbox.max_payload_bytes must be a number of bytes in '
                                     '1..999999999, got %s', quote_literal(left(setting, 40)));
            END IF;
            max_payload_bytes := CAST(setting AS integer);
        END IF;
        IF types ? 'topic' THEN RETURN ARRAY['topic', types ->> 'topic']; END IF;
        IF topic IS NULL THEN RETURN ARRAY['topic', {_sql(REQUIRED)}]; END IF;
        problem := outbox_name_problem(topic, {MAX_NAME_LENGTH});
        IF problem IS NOT NULL THEN RETURN ARRAY['topic', problem]; END IF;
        IF types ? 'key' THEN RETURN ARRAY['key', types ->> 'key']; END IF;
        problem := outbox_name_problem(key, {MAX_KEY_LENGTH});
        IF problem IS NOT NULL THEN RETURN ARRAY['key', problem]; END IF;
        IF jsonb_typeof(headers) NOT IN ('object', 'null') THEN
            RETURN ARRAY['headers', format({_sql(NOT_A_MAPPING)}, outbox_json_type_name(headers))];
        END IF;
        problem := outbox_json_problem(coalesce(payload, 'null'), max_payload_bytes);
        IF problem IS NOT NULL THEN RETURN ARRAY['payload', problem]; END IF;
        IF jsonb_typeof(headers) = 'object' THEN
            problem := outbox_json_problem(headers, {MAX_HEADERS_BYTES});
            IF problem IS NOT NULL THEN RETURN ARRAY['headers', problem]; END IF;
        END IF;
        IF types ? 'run_at' THEN RETURN ARRAY['run_at', types ->> 'run_at']; END IF;
        IF NOT ({RUN_AT_CHECK}) THEN  -- infinities too
            RETURN ARRAY['run_at', {_sql(RUN_AT_RANGE)}];
        END IF;
        IF run_at IS NOT NULL AND (delay IS NOT NULL OR types ? 'delay') THEN
            RETURN ARRAY['delay', {_sql(DELAY_WITH_RUN_AT)}];
        END IF;
        IF types ? 'delay' THEN RETURN ARRAY['delay', types ->> 'delay']; END IF;
        IF NOT (delay >= 0 AND delay <= {MAX_DELAY_SECONDS}) THEN  -- NaN is above every number
            RETURN ARRAY['delay', {_sql(DELAY_RANGE)}];
        END IF;
        IF types ? 'dedup_key' THEN RETURN ARRAY['dedup_key', types ->> 'dedup_key']; END IF;
        problem := outbox_name_problem(dedup_key, {MAX_DEDUP_KEY_LENGTH});
        IF problem IS NOT NULL THEN RETURN ARRAY['dedup_key', problem]; END IF;
        IF types ? 'priority' THEN RETURN ARRAY['priority', types ->> 'priority']; END IF;
        IF priority NOT BETWEEN {-MAX_EVENT_PRIORITY} AND {MAX_EVENT_PRIORITY} THEN
            RETURN ARRAY['priority', format({_sql(PRIORITY_RANGE)}, priority)];
        END IF;
        RETURN NULL;
    END $$
    """,
    # One valid event written, as publish() writes it: the key's publish lock first when a
    # subscription of the topic is ordered, ON CONFLICT on (topic, dedup_key), then the
    # look-up of the event holding the key (three tries, as publish()).
    f"""
    CREATE OR REPLACE FUNCTION outbox_insert_event(
        event_topic text, event_payload jsonb, event_key text, event_headers jsonb, event_run_at timestamptz,
        event_delay double precision, event_priority integer, event_dedup_key text) RETURNS bigint
    LANGUAGE plpgsql VOLATILE SET search_path FROM CURRENT AS $$
    DECLARE
        event_id bigint;
    BEGIN
        IF event_key IS NOT NULL
           AND EXISTS (SELECT 1 FROM outbox_subscriptions s WHERE s.topic = event_topic AND s.ordered) THEN
            PERFORM pg_advisory_xact_lock({_ORDER_LOCK}, hashtext(event_key));
        END IF;
        FOR attempt IN 1..3 LOOP
            INSERT INTO outbox_events (topic, key, payload, headers, run_at, priority, dedup_key)
            VALUES (event_topic, event_key, coalesce(event_payload, 'null'),
                    CASE WHEN jsonb_typeof(event_headers) = 'object' THEN event_headers ELSE '{{}}' END,
                    coalesce(event_run_at, now() + make_interval(secs => event_delay)),
                    event_priority, event_dedup_key)
            ON CONFLICT (topic, dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING
            RETURNING id INTO event_id;
            IF event_id IS NOT NULL THEN
                RETURN event_id;
            END IF;
            SELECT e.id INTO event_id FROM outbox_events e
            WHERE e.topic = event_topic AND e.dedup_key = event_dedup_key;
            IF event_id IS NOT NULL THEN
                RETURN event_id;
            END IF;
        END LOOP;
        RAISE EXCEPTION 'publish with dedup_key %: the event holding the key was deleted between the insert '
                        'and its lookup 3 times in a row', quote_literal(event_dedup_key)
            USING ERRCODE = 'serialization_failure';
    END $$
    """,
    f"""
    CREATE OR REPLACE FUNCTION {PUBLISH_FUNCTION}(
        topic text, payload jsonb, key text DEFAULT NULL, headers jsonb DEFAULT NULL,
        run_at timestamptz DEFAULT NULL, delay double precision DEFAULT NULL, priority integer DEFAULT NULL,
        dedup_key text DEFAULT NULL) RETURNS bigint
    LANGUAGE plpgsql VOLATILE SET search_path FROM CURRENT AS $$
    DECLARE
        problem text[] := outbox_event_problem(topic, payload, key, headers, run_at, delay, priority, dedup_key);
    BEGIN
        IF problem IS NOT NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = problem[1] || ': ' || problem[2],
                                  COLUMN = problem[1];
        END IF;
        RETURN outbox_insert_event(topic, payload, key, headers, run_at, delay, priority, dedup_key);
    END $$
    """,
    # Reads every item first (its fields' JSON types, then the rules), so a bad item raises
    # before any event is written; then takes the ordered keys' publish locks in ascending
    # order of their hash (as publish_many: two batches never deadlock each other); then
    # writes the events in array order: in one statement when no item has a dedup_key, else
    # one by one (each insert's conflict and look-up as outbox_publish's).
    f"""
    CREATE OR REPLACE FUNCTION {PUBLISH_MANY_FUNCTION}(events jsonb) RETURNS bigint[]
    LANGUAGE plpgsql VOLATILE SET search_path FROM CURRENT AS $$
    DECLARE
        item jsonb;
        item_index integer := 0;
        types jsonb;
        problem text[];
        value jsonb;
        topics text[] := '{{}}'; payloads jsonb[] := '{{}}'; keys text[] := '{{}}'; headers jsonb[] := '{{}}';
        run_ats timestamptz[] := '{{}}'; delays double precision[] := '{{}}'; priorities integer[] := '{{}}';
        dedup_keys text[] := '{{}}';
        f_topic text; f_key text; f_run_at timestamptz; f_delay double precision; f_priority integer;
        f_dedup_key text;
        ids bigint[] := '{{}}';
    BEGIN
        IF jsonb_typeof(events) IS DISTINCT FROM 'array' THEN
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', COLUMN = 'events',
                MESSAGE = 'events: must be a JSON array of events, got ' || coalesce(jsonb_typeof(events), 'NULL');
        END IF;
        FOR item IN SELECT e FROM jsonb_array_elements(events) AS batch(e) LOOP
            IF jsonb_typeof(item) = 'array' AND jsonb_array_length(item) BETWEEN 2 AND 4 THEN
                item := jsonb_build_object('topic', item -> 0, 'payload', item -> 1, 'key', item -> 2,
                                           'headers', item -> 3);
            ELSIF jsonb_typeof(item) = 'array' THEN
                RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', COLUMN = format('events[%s]', item_index),
                    MESSAGE = format('events[%s]: is a list of %s items; %s (use a mapping for the options)',
                                     item_index, jsonb_array_length(item), {_sql(ITEM_SHAPE)});
            ELSIF jsonb_typeof(item) <> 'object' THEN
                RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', COLUMN = format('events[%s]', item_index),
                    MESSAGE = format('events[%s]: is a %s; %s', item_index, outbox_json_type_name(item),
                                     {_sql(ITEM_SHAPE)});
            ELSIF EXISTS (SELECT 1 FROM jsonb_object_keys(item) k WHERE k NOT IN
                          ('topic', 'payload', 'key', 'headers', 'run_at', 'delay', 'dedup_key', 'priority')) THEN
                RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', COLUMN = format('events[%s]', item_index),
                    MESSAGE = format('events[%s]: has unknown keys %s; %s', item_index,
                                     (SELECT string_agg(quote_literal(k), ', ') FROM jsonb_object_keys(item) k
                                      WHERE k NOT IN ('topic', 'payload', 'key', 'headers', 'run_at', 'delay',
                                                      'dedup_key', 'priority')),
                                     {_sql(ITEM_SHAPE)});
            ELSIF NOT (item ? 'topic' AND item ? 'payload') THEN
                RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', COLUMN = format('events[%s]', item_index),
                    MESSAGE = format('events[%s]: has no %s; %s', item_index,
                                     concat_ws(' and ', CASE WHEN NOT item ? 'topic' THEN 'topic' END,
                                               CASE WHEN NOT item ? 'payload' THEN 'payload' END),
                                     {_sql(ITEM_SHAPE)});
            END IF;
            types := '{{}}';
            f_topic := NULL; f_key := NULL; f_run_at := NULL; f_delay := NULL; f_priority := NULL;
            f_dedup_key := NULL;
            value := item -> 'topic';
            IF jsonb_typeof(value) = 'string' THEN f_topic := value ->> 0;
            ELSIF jsonb_typeof(value) <> 'null' THEN
                types := types || jsonb_build_object('topic', format({_sql(NOT_A_STR)}, outbox_json_type_name(value)));
            END IF;
            value := item -> 'key';
            IF jsonb_typeof(value) = 'string' THEN f_key := value ->> 0;
            ELSIF jsonb_typeof(value) <> 'null' THEN
                types := types || jsonb_build_object('key', format({_sql(NOT_A_STR)}, outbox_json_type_name(value)));
            END IF;
            value := item -> 'run_at';
            IF jsonb_typeof(value) = 'string' THEN
                IF (value ->> 0) !~ '(Z|z|[+-][0-9]{{2}}(:?[0-9]{{2}}){{0,2}})$' THEN
                    types := types || jsonb_build_object('run_at', {_sql(NAIVE_DATETIME)});
                ELSE
                    BEGIN
                        f_run_at := CAST(value ->> 0 AS timestamptz);
                    EXCEPTION WHEN data_exception THEN  -- not a time, a field or an offset out of range
                        types := types || jsonb_build_object('run_at',
                            'is not an ISO 8601 date and time: ' || quote_literal(left(value ->> 0, 40)));
                    END;
                END IF;
            ELSIF jsonb_typeof(value) <> 'null' THEN
                types := types || jsonb_build_object('run_at',
                                                     format({_sql(NOT_A_DATETIME)}, outbox_json_type_name(value)));
            END IF;
            value := item -> 'delay';
            IF jsonb_typeof(value) = 'number' THEN
                IF abs(CAST(value AS numeric)) > {MAX_DELAY_SECONDS} THEN
                    types := types || jsonb_build_object('delay', {_sql(DELAY_RANGE)});
                ELSE
                    BEGIN
                        f_delay := CAST(value AS double precision);
                    EXCEPTION WHEN numeric_value_out_of_range THEN
                        f_delay := 0;  -- below the smallest double (1e-400): 0, as a JSON parser reads it
                    END;
                END IF;
            ELSIF jsonb_typeof(value) <> 'null' THEN
                types := types || jsonb_build_object('delay', format({_sql(NOT_SECONDS)}, outbox_json_type_name(value)));
            END IF;
            value := item -> 'dedup_key';
            IF jsonb_typeof(value) = 'string' THEN f_dedup_key := value ->> 0;
            ELSIF jsonb_typeof(value) <> 'null' THEN
                types := types || jsonb_build_object('dedup_key',
                                                     format({_sql(NOT_A_STR)}, outbox_json_type_name(value)));
            END IF;
            value := item -> 'priority';
            IF jsonb_typeof(value) = 'number' AND outbox_json_type_name(value) = 'int' THEN
                IF abs(CAST(value AS numeric)) > {MAX_EVENT_PRIORITY} THEN
                    types := types || jsonb_build_object('priority', format({_sql(PRIORITY_RANGE)}, value));
                ELSE
                    f_priority := CAST(value AS integer);
                END IF;
            ELSIF jsonb_typeof(value) <> 'null' THEN
                types := types || jsonb_build_object('priority', format({_sql(NOT_AN_INT)}, outbox_json_type_name(value)));
            END IF;
            problem := outbox_event_problem(f_topic, item -> 'payload', f_key, item -> 'headers', f_run_at, f_delay,
                                            f_priority, f_dedup_key, types);
            IF problem IS NOT NULL THEN
                RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
                    COLUMN = format('events[%s].%s', item_index, problem[1]),
                    MESSAGE = format('events[%s].%s: %s', item_index, problem[1], problem[2]);
            END IF;
            topics := topics || f_topic; payloads := payloads || (item -> 'payload'); keys := keys || f_key;
            headers := headers || (item -> 'headers'); run_ats := run_ats || f_run_at; delays := delays || f_delay;
            priorities := priorities || f_priority; dedup_keys := dedup_keys || f_dedup_key;
            item_index := item_index + 1;
        END LOOP;
        PERFORM pg_advisory_xact_lock({_ORDER_LOCK}, h)
        FROM (SELECT DISTINCT hashtext(k.key) AS h
              FROM unnest(topics, keys) AS k(topic, key)
              WHERE k.key IS NOT NULL
                AND k.topic IN (SELECT s.topic FROM outbox_subscriptions s WHERE s.ordered)
              ORDER BY 1) ordered_keys;
        IF NOT EXISTS (SELECT 1 FROM unnest(dedup_keys) AS d(k) WHERE d.k IS NOT NULL) THEN
            -- No dedup key: one statement; ids are drawn in array order (ORDER BY the position).
            WITH written AS (
                INSERT INTO outbox_events (topic, key, payload, headers, run_at, priority)
                SELECT e.t, e.k, coalesce(e.p, 'null'), CASE WHEN jsonb_typeof(e.h) = 'object' THEN e.h ELSE '{{}}' END,
                       coalesce(e.r, now() + make_interval(secs => e.d)), e.pr
                FROM unnest(topics, keys, payloads, headers, run_ats, delays, priorities)
                     WITH ORDINALITY AS e(t, k, p, h, r, d, pr, n)
                ORDER BY e.n
                RETURNING id)
            SELECT coalesce(array_agg(w.id ORDER BY w.id), '{{}}') INTO ids FROM written w;
            RETURN ids;
        END IF;
        FOR i IN 1..item_index LOOP
            ids := ids || outbox_insert_event(topics[i], payloads[i], keys[i], headers[i], run_ats[i], delays[i],
                                              priorities[i], dedup_keys[i]);
        END LOOP;
        RETURN ids;
    END $$
    """,
    *(f"REVOKE EXECUTE ON FUNCTION {signature} FROM PUBLIC" for signature in WRITING_FUNCTIONS),
)

#: DROP statements of the SQL functions, dependents first (the downgrade of migration 0010).
PUBLISH_FUNCTIONS_DROP_DDL: tuple[str, ...] = (
    *(f"DROP FUNCTION IF EXISTS {signature}" for signature in WRITING_FUNCTIONS),
    "DROP FUNCTION IF EXISTS outbox_event_problem(text, jsonb, text, jsonb, timestamptz, double precision, "
    "integer, text, jsonb)",
    "DROP FUNCTION IF EXISTS outbox_json_problem(jsonb, integer)",
    "DROP FUNCTION IF EXISTS outbox_name_problem(text, integer)",
    "DROP FUNCTION IF EXISTS outbox_json_type_name(jsonb)",
)

#: Every function the SQL publishing adds to outbox's schema.
FUNCTION_NAMES = frozenset({*HELPER_FUNCTIONS, PUBLISH_FUNCTION, PUBLISH_MANY_FUNCTION})
