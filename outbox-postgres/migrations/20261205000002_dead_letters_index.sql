-- Dead letters by insertion order: the statistics count them (up to a bound, then estimate from the
-- seq range) without reading the rest of the outbox. Partial: holds dead letters only.
CREATE INDEX IF NOT EXISTS outbox_events_dead_idx
    ON outbox_events (seq)
    WHERE dead_lettered_at IS NOT NULL AND processed_at IS NULL;
