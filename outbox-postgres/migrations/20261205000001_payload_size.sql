-- Payload sizes for the relay's byte budget (relay.max_batch_bytes).
--
-- The relay cuts a batch by the summed size of its payloads before it reads them, so that a backlog
-- of large events cannot make a batch larger than its memory. The size of a stored payload is not
-- known without reading it (a large JSON payload is kept compressed), so each row records the size
-- of its payload as written: the bytes of an opaque payload, the size of the JSON document otherwise.
-- Rows written before this migration have none; the relay then uses their stored size (smaller than
-- the payload when compressed), as it does for rows written with triggers disabled. The size is taken
-- at insert: a payload changed later by an UPDATE keeps the size it was written with.
ALTER TABLE outbox_events ADD COLUMN IF NOT EXISTS payload_size integer;

-- The writer-order trigger (see 20261204000001) now also records the size. A JSON payload's size is
-- the size of its document as given (cheap: no conversion), unless it arrives compressed (copied
-- from another row by INSERT ... SELECT), where only its text tells the true size. Before
-- PostgreSQL 14, which cannot tell a compressed value, the text is measured every time.
DO $migration$
DECLARE
    rel regclass := 'outbox_events'::regclass;
    nsp text;
    tab text;
    seq_name text;
    json_size text := CASE WHEN current_setting('server_version_num')::int >= 140000
        THEN 'CASE WHEN pg_column_compression(NEW.payload) IS NULL THEN pg_column_size(NEW.payload) ELSE octet_length(NEW.payload::text) END'
        ELSE 'octet_length(NEW.payload::text)' END;
BEGIN
    SELECT n.nspname, c.relname INTO nsp, tab
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE c.oid = rel;
    seq_name := pg_get_serial_sequence(format('%I.%I', nsp, tab), 'seq');
    EXECUTE format(
        $fn$CREATE OR REPLACE FUNCTION %I.%I() RETURNS trigger LANGUAGE plpgsql AS $body$
        BEGIN
            PERFORM pg_advisory_xact_lock(
                hashtextextended(NEW.aggregate_id, hashtextextended(NEW.aggregate_type, TG_RELID::bigint)));
            NEW.seq := nextval(%L::regclass);
            NEW.payload_size := COALESCE(octet_length(NEW.payload_bytes), %s);
            RETURN NEW;
        END
        $body$$fn$,
        nsp, tab || '_writer_order', seq_name, json_size);
END
$migration$;
