//! Judging a run: the verdict assertions, the kill loops and repeated faults under load, and
//! the summary lines the suite prints.

use std::time::Duration;

use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_postgres::OutboxTable;

use crate::Verdict;

use super::load::committed_in_db;
use super::relay::{duplicate_causes_logged, relay_log_dir, RelayProcess};
use super::scenario::{rng, soak_factor};
use super::sink::{Broker, Sink};

/// Asserts the verdict of relay processes over `table` that did not crash: [`assert_clean_verdict`],
/// unless their logs report a documented cause of duplicates ([`duplicate_causes_logged`]); then
/// duplicates stay within a batch per batch in flight for each.
pub fn assert_clean_run(v: &Verdict, table: &OutboxTable, batch_size: usize, batches: usize) {
    let causes = duplicate_causes_logged(table);
    if causes == 0 {
        assert_clean_verdict(v);
    } else {
        println!(
            "  the relays logged {causes} publish timeouts or shutdown cut-offs (logs in {})",
            relay_log_dir(table).display()
        );
        assert_crash_verdict(v, causes, batch_size, batches);
    }
}

/// Relays killed with SIGKILL the way a crash would hit them: each kill waits for progress (the
/// consumer received something since the previous kill), then a random moment, then up to 2 s for the
/// victim to hold a claim while it publishes the batch (its session `idle in transaction`), so that
/// kills land on work in flight rather than on a relay still starting.
pub struct Kills {
    /// SIGKILLs sent.
    pub count: usize,
    /// Kills that found the victim publishing a claimed batch a moment before.
    pub in_flight: usize,
    rng: fastrand::Rng,
}

impl Kills {
    pub fn new(what: &str) -> Kills {
        Kills {
            count: 0,
            in_flight: 0,
            rng: rng(what),
        }
    }

    /// Waits for progress past `received_before` (at most 120 s), then kills `relay` as described.
    pub async fn kill(
        &mut self,
        relay: RelayProcess,
        pg: &sqlx::PgPool,
        sink: &Sink,
        received_before: usize,
    ) {
        self.before_kill(sink, received_before).await;
        if relay.wait_in_transaction(pg, Duration::from_secs(2)).await {
            self.in_flight += 1;
        }
        relay.kill9();
        self.count += 1;
    }

    /// As [`Kills::kill`], without waiting for a claim held open: for relays of the WAL source,
    /// which publish without one (and of which a standby holds nothing).
    pub async fn kill_any(&mut self, relay: RelayProcess, sink: &Sink, received_before: usize) {
        self.before_kill(sink, received_before).await;
        relay.kill9();
        self.count += 1;
    }

    /// Waits for progress past `received_before` (at most 120 s), then a random moment.
    async fn before_kill(&mut self, sink: &Sink, received_before: usize) {
        sink.wait_past(
            received_before,
            Duration::from_secs(120),
            "no progress between two kills: nothing more was delivered",
        )
        .await;
        tokio::time::sleep(Duration::from_millis(self.rng.u64(0..300))).await;
    }

    /// Asserts that some kills hit work in flight (at least a quarter of them), and prints the counts.
    pub fn assert_some_hit_work(&self) {
        println!("kills={} in_flight={}", self.count, self.in_flight);
        assert!(
            self.in_flight * 4 >= self.count && self.in_flight > 0,
            "only {} of {} kills found the relay publishing a claimed batch: the scenario did not \
             crash relays mid-batch",
            self.in_flight,
            self.count
        );
    }
}

/// Asserts no loss, no order violation and nothing unexpected, and duplicates within what
/// `kills` crashes can explain (each leaves at most `batches_in_flight` batches of `batch_size`
/// events published and not yet marked).
pub fn assert_crash_verdict(
    v: &Verdict,
    kills: usize,
    batch_size: usize,
    batches_in_flight: usize,
) {
    assert_eq!((v.lost, v.order_violations, v.unexpected), (0, 0, 0), "{v}");
    let bound = kills * batch_size * batches_in_flight;
    assert!(
        v.duplicates <= bound,
        "{v}: more duplicates than {kills} kills x {batch_size} x {batches_in_flight} in flight can explain"
    );
}

/// Asserts the verdict of a run in which nothing crashed: no loss, no order violation, nothing
/// unexpected, and no duplicate at all.
pub fn assert_clean_verdict(v: &Verdict) {
    assert_eq!(
        (v.lost, v.order_violations, v.unexpected, v.duplicates),
        (0, 0, 0, 0),
        "{v}: nothing crashed, so nothing may be lost, reordered, unexpected or sent twice"
    );
}

/// A relay process publishing to `broker` under continuous writes while `fault` strikes `times`
/// times (times `OUTBOX_SOAK`), each after progress since the previous strike (the relay connected
/// again and published) and a random moment, so that strikes land on calls in flight; then every
/// committed event is waited for, the relay stopped cleanly, and the delivery judged and reported as
/// `scenario`. `fault` gets the loopback port of the sink's broker and returns what it hit
/// (connections closed, packets reset); returns the verdict and those counts, one per strike.
pub async fn faults_under_load<F, Fut>(
    broker: Broker,
    scenario: &str,
    times: usize,
    mut fault: F,
) -> (Verdict, Vec<u64>)
where
    F: FnMut(u16) -> Fut,
    Fut: std::future::Future<Output = u64>,
{
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let sink = Sink::new(broker).await;
    let port = sink.broker_port();
    let load = broker.load(&table).await;
    let relay = RelayProcess::start(&table, &sink, &[]);
    let mut rng = rng(scenario);
    let mut hits = Vec::new();
    let mut before = 0;
    for _ in 0..times * soak_factor() {
        sink.wait_past(
            before,
            Duration::from_secs(120),
            "the relay published nothing since the last fault: it did not connect again",
        )
        .await;
        tokio::time::sleep(Duration::from_millis(rng.u64(50..500))).await;
        hits.push(fault(port).await);
        before = sink.received_count().await;
    }
    let written = load.stop().await;
    let committed = committed_in_db(&pg, &table, &written).await;
    sink.wait_all(&committed, Duration::from_secs(180)).await;
    assert_eq!(relay.terminate(Duration::from_secs(60)), Some(0));
    let verdict = sink.judge(&committed).await;
    report(&format!("{scenario}-x{}", hits.len()), broker, &verdict);
    (verdict, hits)
}

/// Prints the scenario's summary line, and appends it to the file `$FAULT_SCENARIO_REPORT` when set
/// (`scripts/test.sh` sets it and prints the file at the end, since cargo hides a passing test's
/// output).
pub fn report(scenario: &str, broker: Broker, v: &Verdict) {
    report_with(scenario, broker, v, "");
}

/// [`report`], with `extra` figures (`name=value` pairs) at the end of the summary line.
pub fn report_with(scenario: &str, broker: Broker, v: &Verdict, extra: &str) {
    report_to(scenario, broker.name(), v, extra);
}

/// [`report_with`] for a scenario whose events go to `destination` (a broker's name, or `stdout`).
pub fn report_to(scenario: &str, destination: &str, v: &Verdict, extra: &str) {
    let line = format!("scenario={scenario} broker={destination} {v}{extra}");
    println!("{line}");
    if let Some(first) = v.consumer_errors.first() {
        println!(
            "  the consumer's reads failed {} times (first: {first})",
            v.consumer_errors.len()
        );
    }
    if let Some(path) = std::env::var_os("FAULT_SCENARIO_REPORT") {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            // One write of the whole line: tests in other processes append to the same file.
            let _ = f.write_all(format!("{line}\n").as_bytes());
        }
    }
}
