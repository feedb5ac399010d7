//! A broker that is down: every event fails retryably and the readiness check fails, and once it
//! is back the same publisher publishes again.

use std::time::Duration;

use super::common::{event, failure, RECOVERY_TIMEOUT};
use crate::event::Event;
use crate::testkit::{BrokerFixture, Outage};

/// [`a_broker_that_is_down_fails_retryably_then_recovers`] on the fixture's [`BrokerFixture::outage`].
pub async fn broker_down(fx: &dyn BrokerFixture) {
    let outage = fx.outage().await;
    a_broker_that_is_down_fails_retryably_then_recovers(outage.as_ref()).await;
}

/// While the broker is down every event of a batch fails retryably (nothing is reported published)
/// and `check()` fails; once it is back, publishing recovers without a new publisher.
pub async fn a_broker_that_is_down_fails_retryably_then_recovers(outage: &dyn Outage) {
    let p = outage.publisher().await;
    let batch =
        |round: usize| -> Vec<Event> { (0..20).map(|i| event(&format!("a{i}"), round)).collect() };
    let out = p.publish(&batch(0)).await;
    assert!(
        out.iter().all(Result::is_ok),
        "warm-up, before the outage: {:?}",
        out.iter().find(|o| o.is_err())
    );
    outage.stop().await;
    let events = batch(1);
    let out = p.publish(&events).await;
    assert_eq!(out.len(), events.len(), "one outcome per event");
    for (i, o) in out.iter().enumerate() {
        let (_, retryable, text) = failure(&out, i);
        assert!(
            retryable,
            "a broker that is down is a retryable failure: {text} ({o:?})"
        );
    }
    assert!(
        p.check().await.is_err(),
        "check() (readiness) reports the broker down"
    );
    outage.start().await;
    let deadline = tokio::time::Instant::now() + RECOVERY_TIMEOUT;
    for round in 2.. {
        let events = batch(round);
        let out = p.publish(&events).await;
        assert_eq!(out.len(), events.len(), "one outcome per event");
        if out.iter().all(Result::is_ok) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no recovery within {RECOVERY_TIMEOUT:?} of the broker's return: {:?}",
            out.iter().find(|o| o.is_err())
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(p.check().await.is_ok(), "check() after the recovery");
}
