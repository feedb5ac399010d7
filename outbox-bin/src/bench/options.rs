//! What a benchmark run measures and how much of it: the phases ([`Phase`]) and the sizes, rates
//! and durations ([`BenchOptions`]), checked before anything is created.

use std::time::Duration;

use serde::Serialize;

use txoutbox_core::{Error, RelayConfig};
use txoutbox_postgres::OutboxTable;

/// The parts of the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Business transactions per second with and without the outbox insert.
    Writer,
    /// Draining a pre-filled backlog: the yardstick (one `DELETE ... RETURNING` after another), then
    /// the target and the discard ceiling, with 1 and N relays.
    Drain,
    /// The classic relay (claim 100, publish one at a time, one `UPDATE` per row) on the target.
    Reference,
    /// Commit-to-acknowledgement latency at a steady offered rate, polling and with NOTIFY.
    Latency,
    /// Claim cost over an empty history, a large processed history and a large pending backlog.
    Claim,
    /// One transaction far larger than the WAL source's read-ahead (a backfill), drained by one
    /// polling relay and by one relay over the WAL source: drain time and peak memory of each.
    Transaction,
}

impl Phase {
    /// Every phase, in the order they run.
    pub const ALL: [Phase; 6] = [
        Phase::Writer,
        Phase::Drain,
        Phase::Reference,
        Phase::Latency,
        Phase::Claim,
        Phase::Transaction,
    ];

    /// Parses `writer`, `drain`, `reference`, `latency`, `claim` or `transaction`.
    ///
    /// # Errors
    /// A config error naming the accepted values.
    pub fn parse(s: &str) -> Result<Phase, Error> {
        match s.trim() {
            "writer" => Ok(Phase::Writer),
            "drain" => Ok(Phase::Drain),
            "reference" => Ok(Phase::Reference),
            "latency" => Ok(Phase::Latency),
            "claim" => Ok(Phase::Claim),
            "transaction" => Ok(Phase::Transaction),
            other => Err(Error::config(format!(
                "bench phase {other:?}: expected writer, drain, reference, latency, claim or transaction"
            ))),
        }
    }
}

/// One large transaction of the transaction phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LargeTransaction {
    /// Events in the transaction.
    pub events: u64,
    /// Size of each event's JSON payload, in bytes (at least 64).
    pub payload_bytes: usize,
    /// Distinct aggregates the events are spread over.
    pub aggregates: usize,
}

impl LargeTransaction {
    /// Parses `EVENTSxBYTESxAGGREGATES`, such as `500000x4096x100`.
    ///
    /// # Errors
    /// A config error naming the expected form.
    pub fn parse(s: &str) -> Result<LargeTransaction, Error> {
        let bad = || {
            Error::config(format!(
                "--transactions {s:?}: expected EVENTSxBYTESxAGGREGATES with positive numbers and at least 64 bytes, such as 500000x4096x100"
            ))
        };
        let parts: Vec<u64> = s
            .trim()
            .split('x')
            .map(|n| n.trim().replace('_', "").parse::<u64>())
            .collect::<Result<_, _>>()
            .map_err(|_| bad())?;
        match parts[..] {
            [events, bytes, aggregates] if events > 0 && bytes >= 64 && aggregates > 0 => {
                Ok(LargeTransaction {
                    events,
                    payload_bytes: usize::try_from(bytes).map_err(|_| bad())?,
                    aggregates: usize::try_from(aggregates).map_err(|_| bad())?,
                })
            }
            _ => Err(bad()),
        }
    }
}

/// The transactions of the transaction phase by default: 500,000 events of 4 KB over 100
/// aggregates, and 2,000,000 of 100 bytes over 1,000.
pub const DEFAULT_LARGE_TRANSACTIONS: [LargeTransaction; 2] = [
    LargeTransaction {
        events: 500_000,
        payload_bytes: 4_096,
        aggregates: 100,
    },
    LargeTransaction {
        events: 2_000_000,
        payload_bytes: 100,
        aggregates: 1_000,
    },
];

/// Sizes, rates and durations of a benchmark run. Every field has a documented default.
#[derive(Debug, Clone, Serialize)]
pub struct BenchOptions {
    /// The schema the benchmark creates and drops; must start with `outbox_bench`. Default `outbox_bench`.
    pub schema: String,
    /// The phases to run. Default: all of them.
    pub phases: Vec<Phase>,
    /// Concurrent writers in the writer phase. Default 8.
    pub writers: usize,
    /// Length of each writer run (two without the outbox insert, two with it, two with `SELECT 1`
    /// instead, alternating). Default 5 s.
    #[serde(with = "txoutbox_core::duration::serde_str")]
    pub writer_duration: Duration,
    /// Events in the pre-filled backlog of each drain run. Default 200,000.
    pub backlog: usize,
    /// N, the number of relays of the multi-relay drain runs. Default 4.
    pub relays: usize,
    /// Distinct aggregates the events are spread over. Default 1,000.
    pub aggregates: usize,
    /// Size of the padding in each event's JSON payload, in bytes. Default 256.
    pub payload_bytes: usize,
    /// Events drained by the reference relay (it is slow; its rate is what counts). Default 20,000.
    pub reference_events: usize,
    /// Offered rate of the latency runs, events per second. Default 2,000.
    pub rate: u32,
    /// Length of each latency run. Default 10 s.
    #[serde(with = "txoutbox_core::duration::serde_str")]
    pub latency_duration: Duration,
    /// Processed rows kept in the table for the claim-cost phase. Default 10,000,000.
    pub claim_processed_rows: u64,
    /// Pending rows for the claim-cost phase's large backlog. Default 1,000,000.
    pub claim_pending_rows: u64,
    /// Claims timed per state in the claim-cost phase. Default 200.
    pub claim_samples: usize,
    /// Time each publisher call of the drain runs (and of the publisher alone) takes on top of the
    /// target's own: a slow broker, against which relays must scale out. Default 0.
    #[serde(with = "txoutbox_core::duration::serde_str")]
    pub publish_delay: Duration,
    /// The transactions of the transaction phase. Default: [`DEFAULT_LARGE_TRANSACTIONS`].
    pub transactions: Vec<LargeTransaction>,
    /// The relay settings of the drain and latency runs. Default: the relay's defaults.
    pub relay: RelayConfig,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            schema: "outbox_bench".into(),
            phases: Phase::ALL.to_vec(),
            writers: 8,
            writer_duration: Duration::from_secs(5),
            backlog: 200_000,
            relays: 4,
            aggregates: 1_000,
            payload_bytes: 256,
            reference_events: 20_000,
            rate: 2_000,
            latency_duration: Duration::from_secs(10),
            claim_processed_rows: 10_000_000,
            claim_pending_rows: 1_000_000,
            claim_samples: 200,
            publish_delay: Duration::ZERO,
            transactions: DEFAULT_LARGE_TRANSACTIONS.to_vec(),
            relay: RelayConfig::default(),
        }
    }
}

impl BenchOptions {
    /// Checks the values.
    ///
    /// # Errors
    /// A config error naming the option, the value and what is expected.
    pub fn validate(&self) -> Result<(), Error> {
        if !self.schema.starts_with("outbox_bench") {
            return Err(Error::config(format!(
                "bench schema {:?}: expected a name starting with outbox_bench (the benchmark drops and recreates it)",
                self.schema
            )));
        }
        OutboxTable::new(&self.schema, "outbox_events")?;
        let positive = [
            ("--writers", self.writers as u64),
            ("--backlog", self.backlog as u64),
            ("--relays", self.relays as u64),
            ("--aggregates", self.aggregates as u64),
            ("--reference-events", self.reference_events as u64),
            ("--rate", u64::from(self.rate)),
            ("--claim-samples", self.claim_samples as u64),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(Error::config(format!(
                    "{name} = 0: expected a positive number"
                )));
            }
        }
        if self.writer_duration.is_zero() || self.latency_duration <= Duration::from_secs(1) {
            return Err(Error::config(
                "--writer-duration must be positive and --latency-duration longer than 1s (the first second is warm-up)",
            ));
        }
        self.relay.validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_refuse_a_schema_the_bench_would_drop_by_mistake() {
        let o = BenchOptions {
            schema: "public".into(),
            ..BenchOptions::default()
        };
        let e = o.validate().unwrap_err();
        assert!(e.to_string().contains("outbox_bench"), "{e}");
        assert!(BenchOptions::default().validate().is_ok());
        assert!(Phase::parse("drain").is_ok());
        assert!(Phase::parse("drains").is_err());
        assert_eq!(
            LargeTransaction::parse("500_000x4096x100").unwrap(),
            DEFAULT_LARGE_TRANSACTIONS[0]
        );
        for bad in ["500000x4096", "0x4096x1", "10x8x1", "ax1x1"] {
            let e = LargeTransaction::parse(bad).unwrap_err();
            assert!(
                e.to_string().contains("EVENTSxBYTESxAGGREGATES"),
                "{bad}: {e}"
            );
        }
    }
}
