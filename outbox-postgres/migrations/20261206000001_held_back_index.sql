-- Held-back aggregates for the ordered claim: an event is taken only when no earlier unprocessed
-- event of its aggregate is dead-lettered or backing off, a point lookup on this index. Partial:
-- holds only events that failed at least once and are not yet published (and dead letters), so it
-- stays small however large the backlog.
-- On a large outbox, build it beforehand without blocking writers:
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_events_blocked_idx
--       ON outbox_events (aggregate_type, aggregate_id, seq)
--       WHERE processed_at IS NULL AND (dead_lettered_at IS NOT NULL OR retry_after IS NOT NULL);
-- and this migration finds it in place.
CREATE INDEX IF NOT EXISTS outbox_events_blocked_idx
    ON outbox_events (aggregate_type, aggregate_id, seq)
    WHERE processed_at IS NULL AND (dead_lettered_at IS NOT NULL OR retry_after IS NOT NULL);
