-- Per-aggregate order with concurrent writers: seq order is commit order, for every writer.
--
-- The relay publishes each aggregate in `seq` order, but a row takes its `seq` at insert and becomes
-- visible at commit. Without this trigger, transaction A could insert an event of aggregate X (seq 1)
-- and hold, B insert one of X (seq 2) and commit, A commit later: the relay would see seq 2 as X's
-- oldest event and publish it first (and a later claim, seeing seq 1 appear, could publish the run
-- again).
--
-- The trigger serialises the writers of each aggregate. Before a row is stored it takes a
-- transaction-scoped advisory lock on its aggregate (held until the writing transaction commits or
-- rolls back), and only then takes its `seq`. A second transaction writing the same aggregate waits
-- at its insert until the first has ended, so its `seq` is larger and its commit later. Hence: a row
-- the relay can see has no earlier row of its aggregate still to appear, and `seq` order equals the
-- commit order of the transactions, whether the rows come from the writer API, plain SQL or COPY.
--
-- Lock key: a 64-bit hash of (table, aggregate_type, aggregate_id); a hash collision between two
-- aggregates only makes their writers wait for each other. Transactions that write several aggregates
-- in separate statements should write them in a consistent order, as with row locks (a deadlock
-- between two of them is detected by PostgreSQL and one fails with SQLSTATE 40P01, to be retried).
DO $migration$
DECLARE
    rel regclass := 'outbox_events'::regclass;
    nsp text;
    tab text;
    seq_name text;
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
            RETURN NEW;
        END
        $body$$fn$,
        nsp, tab || '_writer_order', seq_name);
    EXECUTE format('DROP TRIGGER IF EXISTS %I ON %s', tab || '_writer_order', rel);
    EXECUTE format(
        'CREATE TRIGGER %I BEFORE INSERT ON %s FOR EACH ROW EXECUTE FUNCTION %I.%I()',
        tab || '_writer_order', rel, nsp, tab || '_writer_order');
END
$migration$;
