//! A store that fails claims and settles: nothing is lost, each aggregate's order holds, and only
//! batches whose settle failed are sent again.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;
use uuid::Uuid;

use super::{config, fill, spawn};
use crate::testkit::{MemoryStore, ScriptedPublisher};
use crate::{Error, ErrorKind, Relay};

/// A store that fails on purpose: every `claim_every`-th claim fails (connection error), and every
/// `settle_every`-th settle fails after the publish succeeded, the way a settle fails when the
/// database session is lost: nothing of the batch is recorded, its events become claimable again.
struct FailingStore {
    inner: MemoryStore,
    claims: AtomicUsize,
    settles: Arc<AtomicUsize>,
    claim_every: usize,
    settle_every: usize,
    /// Ids of the batches whose settle failed.
    failed_settles: Arc<std::sync::Mutex<Vec<Uuid>>>,
}

struct FailingLease {
    inner: Box<dyn crate::Lease>,
    ids: Vec<Uuid>,
    settles: Arc<AtomicUsize>,
    settle_every: usize,
    failed_settles: Arc<std::sync::Mutex<Vec<Uuid>>>,
}

#[async_trait]
impl crate::Lease for FailingLease {
    async fn settle(self: Box<Self>, settlements: Vec<crate::Settlement>) -> Result<(), Error> {
        let n = self.settles.fetch_add(1, Ordering::SeqCst) + 1;
        if n.is_multiple_of(self.settle_every) {
            self.failed_settles.lock().unwrap().extend(&self.ids);
            // The session is gone: the claim ends unrecorded (the inner lease releases on drop).
            return Err(Error::new(
                ErrorKind::Connection,
                "injected settle failure: connection reset",
            ));
        }
        self.inner.settle(settlements).await
    }

    async fn release(self: Box<Self>) -> Result<(), Error> {
        self.inner.release().await
    }
}

#[async_trait]
impl crate::Store for FailingStore {
    async fn claim(&self, r: crate::ClaimRequest) -> Result<crate::Batch, Error> {
        let n = self.claims.fetch_add(1, Ordering::SeqCst) + 1;
        if n.is_multiple_of(self.claim_every) {
            return Err(Error::new(
                ErrorKind::Connection,
                "injected claim failure: connection refused",
            ));
        }
        let batch = self.inner.claim(r).await?;
        let ids = batch.events.iter().map(|e| e.id).collect();
        Ok(crate::Batch {
            events: batch.events,
            lease: Box::new(FailingLease {
                inner: batch.lease,
                ids,
                settles: self.settles.clone(),
                settle_every: self.settle_every,
                failed_settles: self.failed_settles.clone(),
            }),
        })
    }

    async fn stats(&self) -> Result<crate::StoreStats, Error> {
        self.inner.stats().await
    }

    async fn check(&self) -> Result<(), Error> {
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn a_store_that_fails_claims_and_settles_loses_nothing_and_keeps_order() {
    let memory = MemoryStore::new();
    let written = fill(&memory, 6, 12);
    let failed_settles = Arc::new(std::sync::Mutex::new(Vec::new()));
    let store = FailingStore {
        inner: memory.clone(),
        claims: AtomicUsize::new(0),
        settles: Arc::default(),
        claim_every: 3,
        settle_every: 2,
        failed_settles: failed_settles.clone(),
    };
    let publisher = ScriptedPublisher::new();
    let relay = Relay::new(Arc::new(store), publisher.clone(), config()).unwrap();
    let (task, shutdown) = spawn(relay);
    let deadline = Instant::now() + Duration::from_secs(600);
    while memory.pending() > 0 {
        assert!(
            Instant::now() < deadline,
            "{} events never settled",
            memory.pending()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    let summary = task.await.unwrap();

    let delivered = publisher.delivered();
    let failed = failed_settles.lock().unwrap().clone();
    assert!(
        summary.settle_failures > 0 && !failed.is_empty(),
        "no settle failed: the test proved nothing"
    );
    // Every event arrives; the first delivery of each follows its aggregate's order.
    let pos: HashMap<Uuid, usize> = written.iter().enumerate().map(|(i, id)| (*id, i)).collect();
    let mut first_seen: HashMap<Uuid, ()> = HashMap::new();
    let mut high: HashMap<&str, usize> = HashMap::new();
    for e in &delivered {
        if first_seen.insert(e.id, ()).is_some() {
            continue;
        }
        let i = pos[&e.id];
        let h = high.entry(e.aggregate_id.as_str()).or_insert(0);
        assert!(
            i >= *h,
            "aggregate {}: event #{i} first delivered after #{h}",
            e.aggregate_id
        );
        *h = i;
    }
    assert_eq!(first_seen.len(), written.len(), "every event delivered");
    // Duplicates come only from batches whose settle failed: published, not recorded, sent again.
    let duplicates = delivered.len() - written.len();
    assert!(duplicates > 0, "a failed settle sends its batch again");
    assert!(
        duplicates <= failed.len(),
        "{duplicates} duplicates, but only {} events were in batches whose settle failed",
        failed.len()
    );
    for e in &delivered {
        let sent = delivered.iter().filter(|d| d.id == e.id).count();
        assert!(
            sent == 1 || failed.contains(&e.id),
            "event {} sent {sent} times though its settle never failed",
            e.id
        );
    }
}
