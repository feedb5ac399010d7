//! Sending one lane's entries in order, in `SendMessageBatch` requests of at most 10 entries and
//! 1 MiB for one queue, within half of `sqs.operation_timeout` from the call's start; per-entry
//! results give each event's outcome, and a failure holds back the rest of its aggregate.

use std::collections::{HashMap, HashSet};

use aws_sdk_sqs::types::SendMessageBatchRequestEntry;
use tracing::debug;

use txoutbox_core::publishers::Fence;
use txoutbox_core::{Error, ErrorKind, Event, PublishOutcome};

use super::entry::Prepared;
use super::SqsPublisher;
use crate::config::SQS_MAX_BYTES;
use crate::error::{self, map_entry_failure, map_sdk};

/// Most entries in one `SendMessageBatch` request.
pub const MAX_BATCH_ENTRIES: usize = 10;

impl SqsPublisher {
    /// Sends one lane's events in order, in requests of at most 10 entries and 1 MiB.
    pub(super) async fn send_lane(
        &self,
        lane: Vec<Prepared>,
        events: &[Event],
        started: tokio::time::Instant,
    ) -> Vec<(usize, PublishOutcome)> {
        let mut results = Vec::with_capacity(lane.len());
        let mut fenced: HashSet<(String, String)> = HashSet::new();
        let mut broken: Option<Error> = None;
        let mut rest = lane.into_iter().peekable();
        // Requests start only within half of sqs.operation_timeout from the start of the call
        // (`started`: queue resolution included), each bounded by all of it: a call lasts at most
        // 1.5 x sqs.operation_timeout (`call_limit`).
        while rest.peek().is_some() {
            if started.elapsed() >= self.config.operation_timeout / 2 {
                // Never sent: back-pressure, so no attempt is counted for it.
                let late = error::not_sent_in_time(self.config.operation_timeout);
                results.extend(rest.map(|p| (p.index, Err(late.clone()))));
                break;
            }
            // Next request: consecutive events for one queue.
            let mut chunk: Vec<Prepared> = Vec::new();
            let mut bytes = 0;
            while let Some(next) = rest.peek() {
                let same_queue = chunk.first().is_none_or(|c| c.queue_url == next.queue_url);
                if !same_queue
                    || chunk.len() == MAX_BATCH_ENTRIES
                    || bytes + next.size > SQS_MAX_BYTES
                {
                    break;
                }
                let Some(p) = rest.next() else { break };
                if let Some(e) = &broken {
                    results.push((p.index, Err(e.clone())));
                    continue;
                }
                if fenced.contains(&p.aggregate) {
                    results.push((p.index, Err(Fence::not_sent("sqs"))));
                    continue;
                }
                bytes += p.size;
                chunk.push(p);
            }
            if chunk.is_empty() {
                continue;
            }
            let queue_url = chunk[0].queue_url.clone();
            let entries: Vec<SendMessageBatchRequestEntry> =
                chunk.iter().map(|p| p.entry.clone()).collect();
            debug!(queue = %queue_url, entries = entries.len(), bytes, "SendMessageBatch");
            let sent = self
                .client
                .send_message_batch()
                .queue_url(&queue_url)
                .set_entries(Some(entries))
                .send()
                .await;
            match sent {
                Ok(out) => {
                    let ok: HashSet<&str> = out.successful().iter().map(|s| s.id()).collect();
                    let failed: HashMap<&str, _> =
                        out.failed().iter().map(|f| (f.id(), f)).collect();
                    for p in &chunk {
                        let id = p.index.to_string();
                        let outcome = if ok.contains(id.as_str()) {
                            Ok(())
                        } else if let Some(f) = failed.get(id.as_str()) {
                            Err(map_entry_failure(f))
                        } else {
                            Err(error::no_result())
                        };
                        if outcome.is_err() {
                            fenced.insert(p.aggregate.clone());
                        }
                        results.push((
                            p.index,
                            outcome.map_err(|e| e.with_context("event_id", events[p.index].id)),
                        ));
                    }
                }
                Err(err) => {
                    let e = map_sdk("SendMessageBatch", err).with_context("queue", &queue_url);
                    if e.kind() == ErrorKind::DestinationNotFound {
                        self.forget(&queue_url);
                    } else if matches!(e.kind(), ErrorKind::Connection | ErrorKind::Timeout) {
                        broken = Some(e.clone());
                    }
                    for p in &chunk {
                        fenced.insert(p.aggregate.clone());
                        results.push((
                            p.index,
                            Err(e.clone().with_context("event_id", events[p.index].id)),
                        ));
                    }
                }
            }
        }
        results
    }
}
