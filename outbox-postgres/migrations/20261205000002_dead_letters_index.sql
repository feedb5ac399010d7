-- Dead letters by insertion order: the statistics count them a bounded number at a time, in seq
-- order, without reading the rest of the outbox. Partial: holds dead letters only.
-- On a large outbox kept with its history, build it beforehand without blocking writers:
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_events_dead_idx ON outbox_events (seq)
--       WHERE dead_lettered_at IS NOT NULL AND processed_at IS NULL;
-- and this migration finds it in place.
CREATE INDEX IF NOT EXISTS outbox_events_dead_idx
    ON outbox_events (seq)
    WHERE dead_lettered_at IS NOT NULL AND processed_at IS NULL;
