//! Where events may go: destinations outside the allow-list are refused and never probed, and a
//! publisher that remembers destinations keeps no more of them than its bound.

use std::collections::HashSet;

use uuid::Uuid;

use super::common::{event, failure, receive_ours};
use crate::error::ErrorKind;
use crate::testkit::{BrokerFixture, Setup};

/// By default an event may name only the publisher's own destination: another one that exists on
/// the broker is refused (permission denied, permanent, naming the setting and the destination),
/// never probed nor sent to; a pattern in `allowed_destinations` that matches it lets it through.
pub async fn destinations_outside_the_allow_list_are_refused(fx: &dyn BrokerFixture) {
    let other = fx.sibling().await;
    let strict = fx.build(Setup::default()).await;
    let mut elsewhere = event("elsewhere", 0);
    elsewhere.destination = Some(other.destination());
    let outcomes = strict
        .publisher
        .publish(std::slice::from_ref(&elsewhere))
        .await;
    let (kind, retryable, text) = failure(&outcomes, 0);
    assert_eq!(
        (kind, retryable),
        (ErrorKind::PermissionDenied, false),
        "{text}"
    );
    let setting = format!("{}.allowed_destinations", strict.publisher.name());
    assert!(
        text.contains(&setting) && text.contains(&other.destination()),
        "the error names {setting} and the destination: {text}"
    );
    if let Some(cached) = &strict.cached_destinations {
        assert_eq!(cached(), 0, "a refused destination is not even probed");
    }
    let mut home = event("home", 0);
    home.destination = Some(fx.destination());
    let outcomes = strict.publisher.publish(std::slice::from_ref(&home)).await;
    assert!(
        outcomes[0].is_ok(),
        "the publisher's own destination, named, stays allowed: {outcomes:?}"
    );
    let got = receive_ours(fx, &[home.id].into(), &[home.id].into()).await;
    assert_eq!(got.len(), 1, "the event for the own destination arrives");
    // A pattern: the destination's first half, then `*`.
    let name = other.destination();
    let half = name
        .char_indices()
        .nth(name.chars().count() / 2)
        .map_or(0, |(i, _)| i);
    let open = fx
        .build(Setup {
            allowed_destinations: vec![format!("{}*", &name[..half])],
            ..Setup::default()
        })
        .await
        .publisher;
    let mut allowed = event("allowed", 0);
    allowed.destination = Some(other.destination());
    let outcomes = open.publish(std::slice::from_ref(&allowed)).await;
    assert!(outcomes[0].is_ok(), "an allowed destination: {outcomes:?}");
    let ours: HashSet<Uuid> = [elsewhere.id, allowed.id].into();
    let got: Vec<Uuid> = receive_ours(other.as_ref(), &ours, &[allowed.id].into())
        .await
        .iter()
        .filter_map(|r| r.event_id)
        .collect();
    assert_eq!(
        got,
        vec![allowed.id],
        "the allowed event arrives, the refused one never did"
    );
    other.dispose().await;
}

/// Events naming ten destinations, twice each, all arrive; a publisher that remembers destinations
/// (exchanges known to exist, queue URLs) keeps exactly its bound of them, however many destinations
/// events name, and a forgotten one is looked up again and still published to.
pub async fn the_destination_cache_stays_bounded(fx: &dyn BrokerFixture) {
    const BOUND: usize = 4;
    let built = fx
        .build(Setup {
            allowed_destinations: vec!["*".into()],
            destination_cache: Some(BOUND),
            ..Setup::default()
        })
        .await;
    let mut others = Vec::new();
    for _ in 0..10 {
        others.push(fx.sibling().await);
    }
    let mut sent: Vec<HashSet<Uuid>> = vec![HashSet::new(); others.len()];
    for round in 0..2 {
        for (i, other) in others.iter().enumerate() {
            let mut e = event(&format!("agg-{i}"), round);
            e.destination = Some(other.destination());
            let outcomes = built.publisher.publish(std::slice::from_ref(&e)).await;
            assert!(outcomes[0].is_ok(), "{}: {outcomes:?}", other.destination());
            if let Some(cached) = &built.cached_destinations {
                assert!(
                    cached() <= BOUND,
                    "{} destinations remembered, more than the bound of {BOUND}",
                    cached()
                );
            }
            sent[i].insert(e.id);
        }
        if let Some(cached) = &built.cached_destinations {
            assert_eq!(
                cached(),
                BOUND,
                "after {} destinations the cache is full, no fuller",
                others.len()
            );
        }
    }
    for (other, ids) in others.iter().zip(&sent) {
        let got = receive_ours(other.as_ref(), ids, ids).await;
        assert_eq!(got.len(), 2, "both events reach {}", other.destination());
    }
    for other in others {
        other.dispose().await;
    }
}
