//! The report as a plain-text table ([`BenchReport::table`]): a section per phase that ran, with
//! the ratios and the relay's peak memory under the drains.

use super::report::{BenchReport, StageFigures};

fn mib(bytes: Option<u64>) -> String {
    bytes.map_or_else(
        || "n/a".into(),
        |b| format!("{:.1} MiB", b as f64 / 1048576.0),
    )
}

impl StageFigures {
    /// Claim, publish and settle, p50 / p99 ms each, in the table's columns.
    fn steps(&self) -> String {
        format!(
            "{:>7.1} /{:>6.1} {:>7.1} /{:>6.1} {:>7.1} /{:>6.1}",
            self.claim_p50_ms,
            self.claim_p99_ms,
            self.publish_p50_ms,
            self.publish_p99_ms,
            self.settle_p50_ms,
            self.settle_p99_ms
        )
    }
}

impl BenchReport {
    /// The figures as a plain-text table.
    pub fn table(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        for note in &self.notes {
            let _ = writeln!(s, "note: {note}");
        }
        let o = &self.options;
        let _ = writeln!(
            s,
            "outbox bench: target {}, batch_size {}, max_in_flight {}, payload {} B, {} aggregates",
            self.target, o.relay.batch_size, o.relay.max_in_flight, o.payload_bytes, o.aggregates
        );
        if !o.publish_delay.is_zero() {
            let _ = writeln!(
                s,
                "  every publisher call of the drains takes {} more (--publish-delay)",
                txoutbox_core::duration::format(o.publish_delay)
            );
        }
        if let Some(w) = &self.writer {
            let _ = writeln!(s, "\nwriter ({} concurrent writers)", w.writers);
            // (label, value, a percentage?, note)
            let rows: [(&str, f64, bool, &str); 11] = [
                (
                    "business tx/s without outbox",
                    w.without_outbox_tps,
                    false,
                    "",
                ),
                ("business tx/s with outbox", w.with_outbox_tps, false, ""),
                (
                    "business tx/s with SELECT 1",
                    w.with_noop_statement_tps,
                    false,
                    "one more round trip, no insert",
                ),
                ("overhead of the outbox insert", w.overhead, true, ""),
                (
                    "overhead of SELECT 1",
                    w.noop_statement_overhead,
                    true,
                    "the round trip alone",
                ),
                (
                    "business tx/s, no ordering",
                    w.with_outbox_without_ordering_tps,
                    false,
                    "outbox insert, writer-order trigger off",
                ),
                (
                    "overhead of the ordering rule",
                    w.ordering_rule_overhead,
                    true,
                    "of the tx/s with outbox",
                ),
                (
                    "business tx/s, table-less",
                    w.with_message_tps,
                    false,
                    "a pg_logical_emit_message event, the WAL source's",
                ),
                (
                    "overhead of a table-less event",
                    w.message_overhead,
                    true,
                    "",
                ),
                (
                    "business tx/s, in statement",
                    w.with_message_in_statement_tps,
                    false,
                    "the table-less event written by the business statement",
                ),
                (
                    "overhead, in statement",
                    w.message_in_statement_overhead,
                    true,
                    "",
                ),
            ];
            for (label, value, percent, note) in rows {
                let figure = if percent {
                    format!("{:>11.1}%", value * 100.0)
                } else {
                    format!("{value:>12.0}")
                };
                let note = if note.is_empty() {
                    String::new()
                } else {
                    format!("   ({note})")
                };
                let _ = writeln!(s, "  {label:<30} {figure}{note}");
            }
        }
        if !self.drain.is_empty() {
            let _ = writeln!(s, "\ndrain of a pre-filled backlog");
            let _ = writeln!(
                s,
                "  {:<10} {:<10} {:>6} {:>9} {:>8} {:>12} {:>12}",
                "relay", "publisher", "relays", "events", "seconds", "events/s", "peak RSS"
            );
            for d in &self.drain {
                let _ = writeln!(
                    s,
                    "  {:<10} {:<10} {:>6} {:>9} {:>8.2} {:>12.0} {:>12}",
                    d.relay,
                    d.publisher,
                    d.relays,
                    d.events,
                    d.seconds,
                    d.events_per_second,
                    mib(d.peak_rss_bytes)
                );
            }
            let _ = writeln!(s, "  relay steps of the drains (p50 / p99 ms)");
            let _ = writeln!(
                s,
                "  {:<10} {:>6} {:>8} {:>12} {:>15} {:>15} {:>15}",
                "publisher", "relays", "batches", "events/batch", "claim", "publish", "settle"
            );
            for d in &self.drain {
                if let Some(g) = &d.stages {
                    let _ = writeln!(
                        s,
                        "  {:<10} {:>6} {:>8} {:>12.1} {}",
                        d.publisher,
                        d.relays,
                        g.batches,
                        g.mean_batch_events,
                        g.steps()
                    );
                }
            }
            if let Some(p) = &self.publisher {
                let _ = writeln!(
                    s,
                    "  publisher alone (no database): {:.0} events/s in calls of {} ({} in flight); \
                     call p50 {:.1} ms, p99 {:.1} ms",
                    p.events_per_second, p.batch_size, p.in_flight, p.batch_p50_ms, p.batch_p99_ms
                );
            }
            let r = &self.ratios;
            let show = |v: Option<f64>| v.map_or_else(|| "n/a".into(), |v| format!("{v:.2}x"));
            let t = &self.target;
            let n = o.relays;
            let mut ratios = vec![(
                "discard ceiling / yardstick, 1 relay".to_string(),
                r.ceiling_vs_yardstick_1,
            )];
            if n != 1 {
                ratios.push((
                    format!("discard ceiling / yardstick, {n} relays"),
                    r.ceiling_vs_yardstick_n,
                ));
            }
            ratios.push((
                format!("{t} / discard ceiling, 1 relay"),
                r.target_vs_ceiling_1,
            ));
            if n != 1 {
                ratios.push((
                    format!("{t} / discard ceiling, {n} relays"),
                    r.target_vs_ceiling_n,
                ));
            }
            ratios.push((
                format!("{t} / publisher alone, 1 relay"),
                r.target_vs_publisher,
            ));
            ratios.push((format!("{t} / reference relay"), r.target_vs_reference));
            ratios.push((
                "WAL source / polling, discard, 1 relay".to_string(),
                r.wal_vs_polling_ceiling,
            ));
            if t != "discard" {
                ratios.push((
                    format!("WAL source / polling, {t}, 1 relay"),
                    r.wal_vs_polling_target,
                ));
            }
            for (label, value) in ratios {
                let _ = writeln!(s, "  {label:<38} {}", show(value));
            }
            let _ = writeln!(
                s,
                "  {:<38} {}",
                "relay peak RSS (1 relay)",
                mib(self.relay_peak_rss_bytes)
            );
        }
        if !self.latency.is_empty() {
            let _ = writeln!(s, "\ncommit-to-ack latency");
            let _ = writeln!(
                s,
                "  {:<8} {:>9} {:>10} {:>8} {:>8} {:>8} {:>8} {:>8}",
                "wake-up",
                "offered/s",
                "achieved/s",
                "events",
                "p50 ms",
                "p95 ms",
                "p99 ms",
                "max ms"
            );
            for l in &self.latency {
                let _ = writeln!(
                    s,
                    "  {:<8} {:>9} {:>10.0} {:>8} {:>8.2} {:>8.2} {:>8.2} {:>8.2}",
                    l.wakeup,
                    l.offered_rate,
                    l.achieved_rate,
                    l.events,
                    l.p50_ms,
                    l.p95_ms,
                    l.p99_ms,
                    l.max_ms
                );
            }
            let _ = writeln!(s, "\nrelay steps during the latency runs (p50 / p99 ms)");
            let _ = writeln!(
                s,
                "  {:<8} {:>12} {:>15} {:>15} {:>15}",
                "wake-up", "events/batch", "claim", "publish", "settle"
            );
            for l in &self.latency {
                let g = &l.stages;
                let _ = writeln!(
                    s,
                    "  {:<8} {:>12.1} {}",
                    l.wakeup,
                    g.mean_batch_events,
                    g.steps()
                );
            }
        }
        if !self.claim.is_empty() {
            let _ = writeln!(s, "\nclaim cost (batch of {})", o.relay.batch_size);
            let _ = writeln!(
                s,
                "  {:<34} {:>11} {:>11} {:>9} {:>9} {:>9} {:>9} {:>9}",
                "table state",
                "pending",
                "processed",
                "median ms",
                "p95 ms",
                "vs first",
                "stats ms",
                "count ms"
            );
            for c in &self.claim {
                let _ = writeln!(
                    s,
                    "  {:<34} {:>11} {:>11} {:>9.2} {:>9.2} {:>8.2}x {:>9.2} {:>9.2}",
                    c.state,
                    c.pending_rows,
                    c.processed_rows,
                    c.median_ms,
                    c.p95_ms,
                    c.vs_first,
                    c.stats_ms,
                    c.exact_count_ms
                );
            }
        }
        if !self.transactions.is_empty() {
            let _ = writeln!(
                s,
                "\none large transaction (a backfill), drained by one relay of each source"
            );
            let _ = writeln!(
                s,
                "  {:<8} {:>9} {:>9} {:>10} {:>8} {:>10} {:>12}",
                "source", "events", "bytes", "aggregates", "seconds", "events/s", "peak RSS"
            );
            for t in &self.transactions {
                for d in &t.drains {
                    let _ = writeln!(
                        s,
                        "  {:<8} {:>9} {:>9} {:>10} {:>8.2} {:>10.0} {:>12}",
                        if d.relay == "wal" { "wal" } else { "polling" },
                        t.transaction.events,
                        t.transaction.payload_bytes,
                        t.transaction.aggregates,
                        d.seconds,
                        d.events_per_second,
                        mib(d.peak_rss_bytes)
                    );
                }
            }
            let _ = writeln!(
                s,
                "  (peak RSS: the whole bench process during the drain, its earlier phases' memory included)"
            );
        }
        s
    }
}
