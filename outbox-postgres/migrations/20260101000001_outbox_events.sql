-- The outbox table. Keeps the classic columns (id, aggregate_type, aggregate_id, event_type, payload,
-- attempts, created_at, processed_at) so that a plain
--   INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES (...)
-- works from any language, and adds what the relay needs. Safe to apply over an existing classic table.
CREATE TABLE IF NOT EXISTS outbox_events (
    id             uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    attempts       integer     NOT NULL DEFAULT 0,
    created_at     timestamptz NOT NULL DEFAULT now(),
    processed_at   timestamptz
);

-- Insertion order: per-aggregate ordering follows it. Never used as a high-water mark.
ALTER TABLE outbox_events ADD COLUMN IF NOT EXISTS seq bigint GENERATED ALWAYS AS IDENTITY;
-- Opaque (non-JSON) payloads; `payload` then holds JSON null.
ALTER TABLE outbox_events ADD COLUMN IF NOT EXISTS payload_bytes bytea;
ALTER TABLE outbox_events ADD COLUMN IF NOT EXISTS content_type text NOT NULL DEFAULT 'application/json';
-- Extra headers, a JSON object of strings (W3C traceparent / tracestate among them).
ALTER TABLE outbox_events ADD COLUMN IF NOT EXISTS headers jsonb NOT NULL DEFAULT '{}'::jsonb;
-- Optional per-event topic / exchange / queue, overriding the publisher's routing.
ALTER TABLE outbox_events ADD COLUMN IF NOT EXISTS destination text;
-- Next attempt not before this time (exponential backoff with jitter).
ALTER TABLE outbox_events ADD COLUMN IF NOT EXISTS retry_after timestamptz;
ALTER TABLE outbox_events ADD COLUMN IF NOT EXISTS last_error text;
-- Set when the event is dead-lettered: never published again until an operator retries it.
ALTER TABLE outbox_events ADD COLUMN IF NOT EXISTS dead_lettered_at timestamptz;

-- Claim scan: pending, not dead, in insertion order. Partial: stays small however long the history.
CREATE INDEX IF NOT EXISTS outbox_events_pending_idx
    ON outbox_events (seq)
    WHERE processed_at IS NULL AND dead_lettered_at IS NULL;

-- Per-aggregate head check and runs: every unprocessed row (dead letters included) by aggregate.
CREATE INDEX IF NOT EXISTS outbox_events_aggregate_idx
    ON outbox_events (aggregate_type, aggregate_id, seq)
    WHERE processed_at IS NULL;

-- Retention cleanup of processed rows (only populated when processed rows are kept).
CREATE INDEX IF NOT EXISTS outbox_events_processed_idx
    ON outbox_events (processed_at)
    WHERE processed_at IS NOT NULL;

DROP VIEW IF EXISTS outbox_dead_letters;
CREATE VIEW outbox_dead_letters AS
    SELECT id, aggregate_type, aggregate_id, event_type, payload, attempts, last_error,
           created_at, dead_lettered_at, headers, destination
    FROM outbox_events
    WHERE dead_lettered_at IS NOT NULL AND processed_at IS NULL;
