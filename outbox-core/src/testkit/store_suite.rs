//! The Store conformance suite. [`run_all`] runs every check; each check is public too.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use uuid::Uuid;

use super::{sample_event, EventStatus, StoreFixture, TestStore};
use crate::event::{NewEvent, JSON_CONTENT_TYPE};
use crate::policy::OrderingPolicy;
use crate::ports::{Action, Batch, ClaimRequest, Settlement};

fn strict(limit: usize) -> ClaimRequest {
    ClaimRequest::new(limit, OrderingPolicy::PerAggregate)
}

fn unordered(limit: usize) -> ClaimRequest {
    ClaimRequest::new(limit, OrderingPolicy::Unordered)
}

fn ids(batch: &Batch) -> Vec<Uuid> {
    batch.events.iter().map(|e| e.id).collect()
}

async fn insert(store: &Arc<dyn TestStore>, events: Vec<NewEvent>) -> Vec<Uuid> {
    let ids = events.iter().map(|e| e.id).collect();
    store.insert(events).await.expect("insert events");
    ids
}

/// Settles every event of `batch` with `action`.
///
/// # Panics
/// When the settlement fails.
pub async fn settle_all(batch: Batch, action: Action) {
    let s = batch
        .events
        .iter()
        .map(|e| Settlement {
            id: e.id,
            action: action.clone(),
        })
        .collect();
    batch.lease.settle(s).await.expect("settle");
}

async fn is_done(store: &Arc<dyn TestStore>, id: Uuid) -> bool {
    match store.state(id).await.expect("state") {
        None => true,
        Some(s) => s.status == EventStatus::Processed,
    }
}

/// Runs every check of the suite, each against a fresh store.
pub async fn run_all(fx: &dyn StoreFixture) {
    empty_outbox_claims_nothing(fx).await;
    claim_returns_every_field(fx).await;
    claim_respects_limit_and_insertion_order(fx).await;
    claim_respects_the_byte_budget(fx).await;
    published_events_are_not_claimed_again(fx).await;
    released_and_dropped_leases_give_events_back(fx).await;
    retry_records_attempts_error_and_delay(fx).await;
    dead_letters_hold_back_their_aggregate_only(fx).await;
    live_lease_excludes_its_aggregates(fx).await;
    runs_of_one_aggregate_come_in_order(fx).await;
    unordered_claims_past_the_head(fx).await;
    missing_settlement_releases(fx).await;
    stats_count_pending_and_dead(fx).await;
    concurrent_claims_never_overlap(fx).await;
}

/// An empty outbox yields an empty batch, not an error.
pub async fn empty_outbox_claims_nothing(fx: &dyn StoreFixture) {
    let store = fx.store().await;
    let b = store
        .claim(strict(10))
        .await
        .expect("claim on empty outbox");
    assert!(b.events.is_empty(), "an empty outbox must claim nothing");
    b.lease.release().await.expect("release empty lease");
    let stats = store.stats().await.expect("stats");
    assert_eq!(stats.pending, 0);
    assert_eq!(stats.dead_letters, 0);
    store.check().await.expect("check");
}

/// Every field written comes back intact.
pub async fn claim_returns_every_field(fx: &dyn StoreFixture) {
    let store = fx.store().await;
    let json = NewEvent::new(
        "order",
        "o-1",
        "order.created",
        serde_json::json!({"total": 12.5, "items": ["a", "é"]}),
    )
    .with_header(
        "traceparent",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    )
    .with_header("x-tenant", "acme")
    .with_destination("orders.special");
    let binary = NewEvent::binary(
        "blob",
        "b-1",
        "blob.stored",
        "application/octet-stream",
        vec![0u8, 159, 146, 150, 255],
    );
    insert(&store, vec![json.clone(), binary.clone()]).await;
    let b = store.claim(unordered(10)).await.expect("claim");
    assert_eq!(b.events.len(), 2, "both events must be claimed");
    let e = &b.events[0];
    assert_eq!(e.id, json.id);
    assert_eq!(e.aggregate_type, "order");
    assert_eq!(e.aggregate_id, "o-1");
    assert_eq!(e.event_type, "order.created");
    assert_eq!(e.content_type, JSON_CONTENT_TYPE);
    let v: serde_json::Value =
        serde_json::from_slice(&e.payload).expect("JSON payload must come back as JSON bytes");
    assert_eq!(v, serde_json::json!({"total": 12.5, "items": ["a", "é"]}));
    assert_eq!(e.headers, json.headers);
    assert_eq!(e.destination.as_deref(), Some("orders.special"));
    assert_eq!(e.attempts, 0);
    let age = chrono::Utc::now() - e.created_at;
    assert!(
        age.num_seconds().abs() < 60,
        "created_at must be the write time, got {}",
        e.created_at
    );
    let bin = &b.events[1];
    assert_eq!(bin.id, binary.id);
    assert_eq!(bin.payload, vec![0u8, 159, 146, 150, 255]);
    assert_eq!(bin.content_type, "application/octet-stream");
    assert_eq!(bin.destination, None);
    b.lease.release().await.expect("release");
}

/// The limit is honoured and the oldest events come first.
pub async fn claim_respects_limit_and_insertion_order(fx: &dyn StoreFixture) {
    let store = fx.store().await;
    let written = insert(
        &store,
        (0..7)
            .map(|i| sample_event(&format!("agg-{i}"), 0))
            .collect(),
    )
    .await;
    let b = store.claim(strict(3)).await.expect("claim");
    assert_eq!(
        ids(&b),
        written[..3].to_vec(),
        "claim must return the 3 oldest events, oldest first"
    );
    b.lease.release().await.expect("release");
}

fn sized(aggregate: &str, bytes: usize) -> NewEvent {
    NewEvent::binary(
        "order",
        aggregate,
        "order.sized",
        "application/octet-stream",
        vec![b'x'; bytes],
    )
}

/// The byte budget cuts a batch before the event that would exceed it, keeps every aggregate's
/// events a prefix of its run, and still hands out a first event larger than the budget, alone.
pub async fn claim_respects_the_byte_budget(fx: &dyn StoreFixture) {
    let store = fx.store().await;
    let big = insert(&store, vec![sized("big", 5_000)]).await;
    let run = insert(
        &store,
        (0..3).map(|_| sized("run", 1_000)).collect::<Vec<_>>(),
    )
    .await;
    let other = insert(&store, vec![sized("other", 1_000)]).await;
    let b = store
        .claim(strict(10).with_max_bytes(2_500))
        .await
        .expect("claim");
    assert_eq!(
        ids(&b),
        big,
        "an event larger than the budget comes alone, and nothing joins it"
    );
    let beside = store
        .claim(strict(10).with_max_bytes(2_500))
        .await
        .expect("claim beside the lease");
    assert_eq!(
        beside.events.len(),
        2,
        "what the budget left out of a batch is not held by its lease"
    );
    beside.lease.release().await.expect("release");
    settle_all(b, Action::Published).await;
    let b = store
        .claim(strict(10).with_max_bytes(2_500))
        .await
        .expect("claim");
    let got = ids(&b);
    assert_eq!(
        got.len(),
        2,
        "2 x 1000 bytes fit a 2500-byte budget, 3 do not"
    );
    assert!(
        got.iter().all(|id| run.contains(id) || other.contains(id)),
        "{got:?}"
    );
    let from_run: Vec<Uuid> = run.iter().copied().filter(|id| got.contains(id)).collect();
    assert_eq!(
        from_run,
        run[..from_run.len()].to_vec(),
        "an aggregate's events in a cut batch are the head of its run"
    );
    b.lease.release().await.expect("release");
    let b = store
        .claim(unordered(10).with_max_bytes(2_500))
        .await
        .expect("claim");
    assert_eq!(
        ids(&b),
        run[..2].to_vec(),
        "unordered claims honour the budget too"
    );
    b.lease.release().await.expect("release");
    let b = store.claim(strict(10)).await.expect("claim");
    assert_eq!(b.events.len(), 4, "no budget: everything pending");
    b.lease.release().await.expect("release");
}

/// Published events never come back.
pub async fn published_events_are_not_claimed_again(fx: &dyn StoreFixture) {
    let store = fx.store().await;
    let written = insert(&store, (0..3).map(|i| sample_event("a", i)).collect()).await;
    let b = store.claim(strict(10)).await.expect("claim");
    assert_eq!(ids(&b), written);
    settle_all(b, Action::Published).await;
    for id in &written {
        assert!(
            is_done(&store, *id).await,
            "event {id} must be processed after Published"
        );
    }
    let again = store.claim(strict(10)).await.expect("claim");
    assert!(
        again.events.is_empty(),
        "published events must not be claimed again"
    );
    assert_eq!(store.stats().await.expect("stats").pending, 0);
}

/// `release()` and dropping a lease both make the events claimable at once, unchanged.
pub async fn released_and_dropped_leases_give_events_back(fx: &dyn StoreFixture) {
    let store = fx.store().await;
    let written = insert(&store, vec![sample_event("a", 0), sample_event("b", 0)]).await;
    let b = store.claim(strict(10)).await.expect("claim");
    assert_eq!(ids(&b), written);
    b.lease.release().await.expect("release");
    let b = store.claim(strict(10)).await.expect("claim after release");
    assert_eq!(ids(&b), written, "released events must be claimable again");
    assert!(
        b.events.iter().all(|e| e.attempts == 0),
        "release must not count an attempt"
    );
    drop(b);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let b = store.claim(strict(10)).await.expect("claim after drop");
        if ids(&b) == written {
            b.lease.release().await.expect("release");
            break;
        }
        drop(b);
        assert!(
            tokio::time::Instant::now() < deadline,
            "events of a dropped lease must become claimable again promptly"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A retry stores attempts and the error and delays the event.
pub async fn retry_records_attempts_error_and_delay(fx: &dyn StoreFixture) {
    let store = fx.store().await;
    let written = insert(
        &store,
        vec![sample_event("late", 0), sample_event("soon", 0)],
    )
    .await;
    let b = store.claim(strict(10)).await.expect("claim");
    let settlements = vec![
        Settlement {
            id: written[0],
            action: Action::Retry {
                attempts: 1,
                delay: Duration::from_secs(3600),
                error: "broker down".into(),
            },
        },
        Settlement {
            id: written[1],
            action: Action::Retry {
                attempts: 3,
                delay: Duration::ZERO,
                error: "timeout".into(),
            },
        },
    ];
    b.lease.settle(settlements).await.expect("settle");
    let late = store
        .state(written[0])
        .await
        .expect("state")
        .expect("retried event kept");
    assert_eq!(late.status, EventStatus::Pending);
    assert_eq!(late.attempts, 1);
    assert_eq!(late.last_error.as_deref(), Some("broker down"));
    let b = store.claim(strict(10)).await.expect("claim");
    assert_eq!(
        ids(&b),
        vec![written[1]],
        "only the event whose delay passed may be claimed"
    );
    assert_eq!(b.events[0].attempts, 3, "attempts must come back as stored");
    b.lease.release().await.expect("release");
    assert_eq!(
        store.stats().await.expect("stats").pending,
        2,
        "backing-off events count as pending"
    );
}

/// A dead letter is not claimed and holds back the later events of its aggregate, not others.
pub async fn dead_letters_hold_back_their_aggregate_only(fx: &dyn StoreFixture) {
    let store = fx.store().await;
    let a = insert(
        &store,
        vec![sample_event("poison", 0), sample_event("poison", 1)],
    )
    .await;
    let other = insert(&store, vec![sample_event("healthy", 0)]).await;
    let b = store.claim(strict(1)).await.expect("claim");
    assert_eq!(ids(&b), vec![a[0]]);
    b.lease
        .settle(vec![Settlement {
            id: a[0],
            action: Action::DeadLetter {
                attempts: 4,
                error: "too large".into(),
            },
        }])
        .await
        .expect("settle");
    let st = store
        .state(a[0])
        .await
        .expect("state")
        .expect("dead letter kept");
    assert_eq!(st.status, EventStatus::DeadLettered);
    assert_eq!(st.attempts, 4);
    assert_eq!(st.last_error.as_deref(), Some("too large"));
    let b = store.claim(strict(10)).await.expect("claim");
    assert_eq!(
        ids(&b),
        other,
        "a dead letter must hold back later events of its aggregate only"
    );
    b.lease.release().await.expect("release");
    // A store may give them in one batch or in two, a moment apart (the WAL source's come from its
    // buffer and from its held table, which it looks at every `held_poll_interval`).
    let expected = HashSet::from([a[1], other[0]]);
    let mut got: HashSet<Uuid> = HashSet::new();
    let mut leases = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while got != expected && std::time::Instant::now() < deadline {
        let b = store.claim(unordered(10)).await.expect("claim");
        if b.events.is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        got.extend(ids(&b));
        leases.push(b.lease);
    }
    assert_eq!(
        got, expected,
        "unordered mode ignores the dead letter's aggregate"
    );
    for lease in leases {
        lease.release().await.expect("release");
    }
    let stats = store.stats().await.expect("stats");
    assert_eq!(stats.dead_letters, 1);
    assert_eq!(stats.pending, 2);
}

/// While a lease holds events of an aggregate, no other claim returns any event of it.
pub async fn live_lease_excludes_its_aggregates(fx: &dyn StoreFixture) {
    let store = fx.store().await;
    let a = insert(&store, vec![sample_event("a", 0), sample_event("a", 1)]).await;
    let b_ids = insert(&store, vec![sample_event("b", 0), sample_event("b", 1)]).await;
    let first = store.claim(strict(1)).await.expect("first claim");
    assert_eq!(ids(&first), vec![a[0]]);
    let second = store.claim(strict(10)).await.expect("second claim");
    assert_eq!(
        ids(&second),
        b_ids,
        "a live lease on aggregate a must keep all of a's events out of other claims"
    );
    second.lease.release().await.expect("release");
    settle_all(first, Action::Published).await;
    let third = store.claim(strict(10)).await.expect("third claim");
    let got = ids(&third);
    assert_eq!(
        got.first(),
        Some(&a[1]),
        "after the head is published, the next event of a is claimable"
    );
    third.lease.release().await.expect("release");
}

/// A batch may hold a run of one aggregate, in insertion order.
pub async fn runs_of_one_aggregate_come_in_order(fx: &dyn StoreFixture) {
    let store = fx.store().await;
    let mut events = Vec::new();
    for i in 0..5 {
        events.push(sample_event("x", i));
        events.push(sample_event("y", i));
    }
    let written = insert(&store, events).await;
    let b = store.claim(strict(100)).await.expect("claim");
    assert_eq!(
        ids(&b),
        written,
        "the whole runs of x and y, in insertion order"
    );
    b.lease.release().await.expect("release");
}

/// Unordered mode claims events whose aggregate head is held elsewhere.
pub async fn unordered_claims_past_the_head(fx: &dyn StoreFixture) {
    let store = fx.store().await;
    let a = insert(&store, (0..3).map(|i| sample_event("a", i)).collect()).await;
    let first = store.claim(unordered(1)).await.expect("claim");
    assert_eq!(ids(&first), vec![a[0]]);
    let second = store.claim(unordered(10)).await.expect("claim");
    assert_eq!(ids(&second), a[1..].to_vec());
    first.lease.release().await.expect("release");
    second.lease.release().await.expect("release");
}

/// An event left out of the settlements is released.
pub async fn missing_settlement_releases(fx: &dyn StoreFixture) {
    let store = fx.store().await;
    let w = insert(&store, vec![sample_event("a", 0), sample_event("b", 0)]).await;
    let b = store.claim(strict(10)).await.expect("claim");
    b.lease
        .settle(vec![
            Settlement {
                id: w[0],
                action: Action::Published,
            },
            Settlement {
                id: Uuid::now_v7(),
                action: Action::Published,
            },
        ])
        .await
        .expect("settle with a foreign id");
    let b = store.claim(strict(10)).await.expect("claim");
    assert_eq!(
        ids(&b),
        vec![w[1]],
        "the unsettled event must be claimable again"
    );
    assert_eq!(b.events[0].attempts, 0);
    b.lease.release().await.expect("release");
}

/// Stats count pending events and dead letters, per event type, and the events held back behind a
/// dead letter of their aggregate.
pub async fn stats_count_pending_and_dead(fx: &dyn StoreFixture) {
    let store = fx.store().await;
    let mut events: Vec<NewEvent> = (0..3).map(|i| sample_event(&format!("s{i}"), 0)).collect();
    events.push(NewEvent::new(
        "invoice",
        "i-1",
        "invoice.paid",
        serde_json::json!({}),
    ));
    let w = insert(&store, events).await;
    let b = store.claim(strict(10)).await.expect("claim");
    b.lease
        .settle(vec![Settlement {
            id: w[3],
            action: Action::DeadLetter {
                attempts: 1,
                error: "bad".into(),
            },
        }])
        .await
        .expect("settle");
    let s = store.stats().await.expect("stats");
    assert_eq!(s.pending, 3);
    assert_eq!(s.dead_letters, 1);
    assert!(s.oldest_pending_age_seconds.is_some());
    let by: HashMap<&str, (u64, u64)> = s
        .by_event_type
        .iter()
        .map(|t| (t.event_type.as_str(), (t.pending, t.dead_letters)))
        .collect();
    assert_eq!(by.get("order.updated"), Some(&(3, 0)));
    assert_eq!(by.get("invoice.paid"), Some(&(0, 1)));
    assert_eq!(
        (s.held_back, s.held_back_aggregates),
        (0, 0),
        "nothing comes after the dead letter"
    );
    // Two later events of the dead letter's aggregate wait behind it; another aggregate's do not.
    insert(
        &store,
        vec![
            NewEvent::new(
                "invoice",
                "i-1",
                "invoice.paid",
                serde_json::json!({"n": 1}),
            ),
            NewEvent::new(
                "invoice",
                "i-1",
                "invoice.paid",
                serde_json::json!({"n": 2}),
            ),
            NewEvent::new("invoice", "i-2", "invoice.paid", serde_json::json!({})),
        ],
    )
    .await;
    let s = store.stats().await.expect("stats");
    assert_eq!(
        (s.held_back, s.held_back_aggregates),
        (2, 1),
        "events after a dead letter of their aggregate are held back"
    );
}

/// Concurrent claimers never share an event, nor (in per-aggregate mode) an aggregate.
pub async fn concurrent_claims_never_overlap(fx: &dyn StoreFixture) {
    let store = fx.store().await;
    let mut events = Vec::new();
    for i in 0..10 {
        for a in 0..10 {
            events.push(sample_event(&format!("c{a}"), i));
        }
    }
    insert(&store, events).await;
    let mut handles = Vec::new();
    for _ in 0..4 {
        let s = store.clone();
        handles.push(tokio::spawn(async move {
            s.claim(strict(7)).await.expect("concurrent claim")
        }));
    }
    let mut batches = Vec::new();
    for h in handles {
        batches.push(h.await.expect("join"));
    }
    let mut seen_ids = HashSet::new();
    let mut owner: HashMap<String, usize> = HashMap::new();
    for (i, b) in batches.iter().enumerate() {
        for e in &b.events {
            assert!(seen_ids.insert(e.id), "event {} claimed twice", e.id);
            let prev = owner.insert(e.aggregate_id.clone(), i);
            assert!(
                prev.is_none() || prev == Some(i),
                "aggregate {} held by two live leases",
                e.aggregate_id
            );
        }
    }
    assert!(!seen_ids.is_empty());
    for b in batches {
        b.lease.release().await.expect("release");
    }
}
