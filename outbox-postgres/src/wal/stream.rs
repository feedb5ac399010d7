//! The slot's replication stream (see `replication`): a task of its own decodes whole transactions
//! and hands them to the reader over a bounded channel, and reports the confirmed position to the
//! server.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, Notify};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use txoutbox_core::Error;

use super::decode::{item_bytes, Decoder, Origin, Piece, WalTransaction};
use super::replication::Replication;
use super::shared::Inner;

/// The longest the reader waits to confirm settled transactions (see `confirm::confirm_settled`);
/// the stream sends the server its confirmed position within this too while data flows.
pub(super) const CONFIRM_EVERY: Duration = Duration::from_millis(50);

/// The replication stream of one reading spell: decoded transactions come over `rx`; `confirmed`
/// carries the confirmed position to the stream's task, which reports it to the server; `settled`
/// counts the transactions confirmed (the task reports its whole received position while every
/// transaction it delivered is).
pub(super) struct Stream {
    pub(super) rx: mpsc::Receiver<Result<WalTransaction, Error>>,
    pub(super) confirmed: Arc<AtomicU64>,
    /// Makes the stream's task send the confirmed position now.
    pub(super) feedback_now: Arc<Notify>,
    pub(super) settled: Arc<AtomicU64>,
    /// Payload bytes of the transactions in the channel (the task waits while they pass
    /// `wal.read_ahead_bytes`).
    pub(super) channel_bytes: Arc<AtomicU64>,
    /// Relation messages the stream's task decoded (see `Decoder::take_described`), and how many
    /// of them the reader has looked at.
    described: Arc<AtomicU64>,
    seen_described: AtomicU64,
    pub(super) cancel: CancellationToken,
    pub(super) task: JoinHandle<()>,
}

impl Stream {
    /// A transaction taken from the channel: its bytes leave the channel's count.
    pub(super) fn taken(&self, t: Result<WalTransaction, Error>) -> Result<WalTransaction, Error> {
        let t = t?;
        self.channel_bytes
            .fetch_sub(transaction_bytes(&t), Ordering::SeqCst);
        Ok(t)
    }

    /// Whether a relation was described since the last call (a transaction taken since may be the
    /// first after a change of the publication).
    pub(super) fn described_again(&self) -> bool {
        let now = self.described.load(Ordering::SeqCst);
        self.seen_described.swap(now, Ordering::SeqCst) != now
    }

    /// Everything before `lsn` is settled: the stream's task reports it to the server now.
    pub(super) fn confirm(&self, lsn: u64) {
        self.confirmed.fetch_max(lsn, Ordering::SeqCst);
        self.feedback_now.notify_one();
    }

    pub(super) async fn close(self) {
        self.cancel.cancel();
        // The task may be waiting to hand over a transaction or an error: no one takes them now.
        drop(self.rx);
        let _ = self.task.await;
    }
}

/// Transactions decoded ahead of the reader (the stream's task waits beyond: backpressure).
const STREAM_CHANNEL: usize = 64;

/// How often the stream's task sends the server its position while no data arrives, and reports
/// the whole received position when everything it delivered is confirmed (an idle outbox on a busy
/// database: the slot still moves on).
const STREAM_FEEDBACK: Duration = Duration::from_secs(1);

fn stream_error(what: &str, e: pg_walstream::ReplicationError) -> Error {
    // Retryable: the reader connects again (a walsender still holding the slot for a reader
    // that just died answers 55006 for a moment).
    Error::new(txoutbox_core::ErrorKind::Connection, format!("{what}: {e}"))
}

/// Opens the slot's replication stream from its confirmed position, with a task of its own that
/// decodes whole transactions and hands them over.
pub(super) async fn open_stream(inner: &Inner, origin: Origin) -> Result<Stream, Error> {
    let slot = inner.reader.slot();
    // Confirms reach the server within CONFIRM_EVERY while data flows: a new reader replays from
    // there.
    let replication = Replication::start(
        &inner.replication,
        slot.slot(),
        slot.publication(),
        CONFIRM_EVERY,
    )
    .map_err(|e| stream_error("wal stream start", e));
    let replication = match replication {
        Ok(r) => {
            inner.replication_health.opened();
            r
        }
        Err(e) => {
            inner.replication_health.failed(&e);
            return Err(e);
        }
    };
    let confirmed = Arc::new(AtomicU64::new(0));
    let settled = Arc::new(AtomicU64::new(0));
    let (tx, rx) = mpsc::channel(STREAM_CHANNEL);
    let cancel = CancellationToken::new();
    // A transaction larger than this comes in parts, which the reader hands to the held table.
    let decoder = Decoder::new(slot, origin)
        .with_part_limit(inner.settings.part_events(), inner.settings.part_bytes());
    let feedback_now = Arc::new(Notify::new());
    let channel_bytes = Arc::new(AtomicU64::new(0));
    let described = Arc::new(AtomicU64::new(0));
    let task = tokio::spawn(stream_task(
        replication,
        decoder,
        StreamShared {
            tx,
            confirmed: confirmed.clone(),
            feedback_now: feedback_now.clone(),
            settled: settled.clone(),
            channel_bytes: channel_bytes.clone(),
            max_bytes: inner.settings.read_ahead_bytes as u64,
            described: described.clone(),
        },
        cancel.clone(),
    ));
    Ok(Stream {
        rx,
        confirmed,
        feedback_now,
        settled,
        channel_bytes,
        described,
        seen_described: AtomicU64::new(0),
        cancel,
        task,
    })
}

/// What the stream's task shares with the reader.
struct StreamShared {
    pub(super) tx: mpsc::Sender<Result<WalTransaction, Error>>,
    pub(super) confirmed: Arc<AtomicU64>,
    pub(super) feedback_now: Arc<Notify>,
    pub(super) settled: Arc<AtomicU64>,
    pub(super) channel_bytes: Arc<AtomicU64>,
    pub(super) max_bytes: u64,
    pub(super) described: Arc<AtomicU64>,
}

/// The payload bytes of a transaction's events.
fn transaction_bytes(t: &WalTransaction) -> u64 {
    t.items.iter().map(|item| item_bytes(item) as u64).sum()
}

async fn stream_task(
    mut stream: Replication,
    mut decoder: Decoder,
    shared: StreamShared,
    cancel: CancellationToken,
) {
    let StreamShared {
        tx,
        confirmed,
        feedback_now,
        settled,
        channel_bytes,
        max_bytes,
        described,
    } = shared;
    let mut delivered = 0u64;
    let mut last_answer = Instant::now();
    let mut period = cancel.child_token();
    let mut period_timer = spawn_period(period.clone(), feedback_now.clone());
    loop {
        stream.confirm(confirmed.load(Ordering::SeqCst));
        let raw = match stream.next(&period).await {
            Ok(raw) => raw,
            Err(e) if e.is_cancelled() => {
                if cancel.is_cancelled() {
                    period_timer.abort();
                    stream.confirm(confirmed.load(Ordering::SeqCst));
                    let _ = stream.report().await;
                    return;
                }
                // A quiet second: report the whole received position (keepalives included:
                // everything committed below it was sent before) when all delivered is settled.
                if settled.load(Ordering::SeqCst) == delivered && !decoder.in_transaction() {
                    stream.confirm(stream.received());
                }
                let _ = stream.report().await;
                period = cancel.child_token();
                period_timer = spawn_period(period.clone(), feedback_now.clone());
                continue;
            }
            Err(e) => {
                hand_over_error(&tx, &cancel, stream_error("wal stream", e)).await;
                return;
            }
        };
        let decoded = decoder.feed(raw.wal_start, &raw.data);
        if decoder.take_described() {
            // Counted before the transaction it describes a relation for is handed over.
            described.fetch_add(1, Ordering::SeqCst);
        }
        let transaction = match decoded {
            Ok(Some(t)) => t,
            Ok(None) => continue,
            Err(e) => {
                hand_over_error(&tx, &cancel, e).await;
                return;
            }
        };
        if !matches!(transaction.piece, Piece::Part { .. }) {
            delivered += 1;
        }
        let sent = send_when_room(
            &mut stream,
            transaction,
            &tx,
            Room {
                confirmed: &confirmed,
                channel_bytes: &channel_bytes,
                max_bytes,
            },
            &cancel,
            &mut last_answer,
        )
        .await;
        if !sent {
            return;
        }
    }
}

/// What the stream task checks before it hands a transaction over.
struct Room<'a> {
    confirmed: &'a AtomicU64,
    channel_bytes: &'a AtomicU64,
    max_bytes: u64,
}

/// Hands `transaction` over once there is room (a place in the channel, and its bytes under the
/// read-ahead unless the channel is empty), answering the server meanwhile (it ends a silent
/// connection). False when the stream task is to stop (cancelled, or the reader gone).
async fn send_when_room(
    stream: &mut Replication,
    transaction: WalTransaction,
    tx: &mpsc::Sender<Result<WalTransaction, Error>>,
    room: Room<'_>,
    cancel: &CancellationToken,
    last_answer: &mut Instant,
) -> bool {
    let bytes = transaction_bytes(&transaction);
    let mut transaction = Some(transaction);
    while let Some(t) = transaction.take() {
        let full = room.channel_bytes.load(Ordering::SeqCst) > 0
            && room.channel_bytes.load(Ordering::SeqCst) + bytes > room.max_bytes;
        if full {
            transaction = Some(t);
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(5)) => {}
                _ = cancel.cancelled() => {
                    stream.confirm(room.confirmed.load(Ordering::SeqCst));
                    let _ = stream.report().await;
                    return false;
                }
            }
            if last_answer.elapsed() >= Duration::from_secs(10) {
                *last_answer = Instant::now();
                stream.confirm(room.confirmed.load(Ordering::SeqCst));
                let _ = stream.report().await;
            }
            continue;
        }
        tokio::select! {
            permit = tx.reserve() => match permit {
                Ok(p) => {
                    room.channel_bytes.fetch_add(bytes, Ordering::SeqCst);
                    p.send(Ok(t));
                }
                Err(_) => return false,
            },
            _ = tokio::time::sleep(Duration::from_secs(10)) => {
                transaction = Some(t);
                stream.confirm(room.confirmed.load(Ordering::SeqCst));
                let _ = stream.report().await;
            }
            _ = cancel.cancelled() => {
                stream.confirm(room.confirmed.load(Ordering::SeqCst));
                let _ = stream.report().await;
                return false;
            }
        }
    }
    true
}

/// Gives the reader the stream's error, unless it stops first.
async fn hand_over_error(
    tx: &mpsc::Sender<Result<WalTransaction, Error>>,
    cancel: &CancellationToken,
    e: Error,
) {
    tokio::select! {
        _ = tx.send(Err(e)) => {}
        _ = cancel.cancelled() => {}
    }
}

/// Ends the stream task's wait for data after [`STREAM_FEEDBACK`], or at once when the reader
/// confirmed something (so that a new reader replays as little as can be).
fn spawn_period(token: CancellationToken, now: Arc<Notify>) -> JoinHandle<()> {
    tokio::spawn(async move {
        tokio::select! {
            _ = tokio::time::sleep(STREAM_FEEDBACK) => {}
            _ = now.notified() => {}
            _ = token.cancelled() => {}
        }
        token.cancel();
    })
}
