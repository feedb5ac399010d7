-- The consumer-side inbox: one row per (consumer, event id) already handled. A handler runs only when
-- its row could be inserted, in the same transaction as the handler's own writes.
CREATE TABLE IF NOT EXISTS processed_events (
    consumer     text        NOT NULL DEFAULT 'default',
    event_id     uuid        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

-- Retention cleanup.
CREATE INDEX IF NOT EXISTS processed_events_processed_at_idx ON processed_events (processed_at);
