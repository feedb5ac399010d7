-- The writer-order lock (20261204000001_writers_in_commit_order.sql) can be switched off for one
-- transaction: `SET LOCAL outbox.writer_order = 'off'`. The function is otherwise as in
-- 20261205000001_payload_size.sql.
--
-- The lock is per aggregate and held to commit, so a transaction writing rows of very many
-- aggregates takes as many locks, and the server's lock table (max_locks_per_transaction x
-- max_connections entries, shared by every session) runs out: SQLSTATE 53200 for every session.
-- The WAL source's reader is the only writer of its held table and hands over tens of thousands
-- of events at once (a large transaction, undecodable messages): it switches the lock off for its
-- own inserts. A backfill may do the same when no other transaction writes its aggregates at the
-- same time (their order against it is then not guaranteed).
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
            IF current_setting('outbox.writer_order', true) IS DISTINCT FROM 'off' THEN
                PERFORM pg_advisory_xact_lock(
                    hashtextextended(NEW.aggregate_id, hashtextextended(NEW.aggregate_type, TG_RELID::bigint)));
            END IF;
            NEW.seq := nextval(%L::regclass);
            NEW.payload_size := COALESCE(octet_length(NEW.payload_bytes), %s);
            RETURN NEW;
        END
        $body$$fn$,
        nsp, tab || '_writer_order', seq_name, json_size);
END
$migration$;
