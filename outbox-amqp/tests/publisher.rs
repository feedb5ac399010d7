//! The AMQP publisher against the real RabbitMQ server.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use outbox_amqp::testing::Fixture;
use outbox_amqp::AmqpPublisher;
use outbox_core::testkit::publisher_suite::{self, event};
use outbox_core::{ErrorKind, Publisher};

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test]
async fn conformance() {
    let fx = Fixture::new().await;
    publisher_suite::run_all(&fx).await;
    fx.cleanup().await;
}

#[tokio::test]
async fn messages_carry_the_event_in_native_fields() {
    let fx = Fixture::new().await;
    let p = fx.publisher();
    let mut e = event("order-7", 1);
    e.event_type = "order.shipped".into();
    let out = p.publish(std::slice::from_ref(&e)).await;
    assert!(out[0].is_ok(), "{:?}", out[0]);
    let got = fx.wait_for(1, WAIT).await;
    assert_eq!(got.len(), 1);
    let d = &got[0];
    let props = &d.properties;
    assert_eq!(
        props.message_id().as_ref().map(|m| m.to_string()),
        Some(e.id.to_string())
    );
    assert_eq!(
        props.kind().as_ref().map(|m| m.to_string()).as_deref(),
        Some("order.shipped")
    );
    assert_eq!(
        props
            .content_type()
            .as_ref()
            .map(|m| m.to_string())
            .as_deref(),
        Some("application/json")
    );
    assert_eq!(*props.delivery_mode(), Some(2), "persistent delivery");
    assert_eq!(*props.timestamp(), Some(e.created_at.timestamp() as u64));
    assert_eq!(
        d.routing_key, "order.shipped",
        "routing key defaults to the event type"
    );
    let h = &d.received.headers;
    assert_eq!(h.get("outbox-event-id"), Some(&e.id.to_string()));
    assert_eq!(
        h.get("outbox-aggregate-type").map(String::as_str),
        Some("order")
    );
    assert_eq!(
        h.get("outbox-aggregate-id").map(String::as_str),
        Some("order-7")
    );
    assert_eq!(h.get("traceparent"), e.headers.get("traceparent"));
    assert_eq!(d.received.payload, e.payload);
    fx.cleanup().await;
}

#[tokio::test]
async fn unroutable_messages_are_failures_not_silent_successes() {
    let fx = Fixture::new().await;
    // An exchange with no queue bound: the publisher declares it, nothing can receive.
    let lonely = format!("{}.lonely", fx.exchange);
    let p = AmqpPublisher::new(outbox_amqp::AmqpConfig {
        exchange: lonely.clone(),
        ..fx.config()
    })
    .unwrap();
    let out = p.publish(&[event("a", 0), event("b", 0)]).await;
    assert_eq!(out.len(), 2, "one outcome per event");
    for o in &out {
        let err = o.as_ref().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Unroutable, "{err}");
        assert!(
            !err.is_retryable(),
            "unroutable is permanent by default: {err}"
        );
        assert!(err.to_string().contains("312 NO_ROUTE"), "{err}");
    }
    let p = AmqpPublisher::new(outbox_amqp::AmqpConfig {
        exchange: lonely.clone(),
        unroutable_is_retryable: true,
        ..fx.config()
    })
    .unwrap();
    let out = p.publish(&[event("a", 0)]).await;
    assert!(
        out[0].as_ref().unwrap_err().is_retryable(),
        "configurable as retryable"
    );
    let ch = fx.connection.create_channel().await.unwrap();
    ch.exchange_delete(lonely.into(), Default::default())
        .await
        .unwrap();
    fx.cleanup().await;
}

#[tokio::test]
async fn bad_events_fail_alone() {
    let fx = Fixture::new().await;
    let p = AmqpPublisher::new(outbox_amqp::AmqpConfig {
        max_message_bytes: 1000,
        allowed_destinations: vec![format!("{}.does-not-exist", fx.exchange)],
        ..fx.config()
    })
    .unwrap();
    let mut too_big = event("big", 0);
    too_big.payload = vec![b'x'; 2000];
    let mut missing_exchange = event("lost", 0);
    missing_exchange.destination = Some(format!("{}.does-not-exist", fx.exchange));
    let mut long_header = event("hdr", 0);
    long_header.headers.insert("h".repeat(300), "v".into());
    let mut long_type = event("typ", 0);
    long_type.event_type = "t".repeat(300);
    let good = [event("ok-1", 0), event("ok-2", 0)];
    let batch = vec![
        good[0].clone(),
        too_big,
        missing_exchange,
        long_header,
        long_type,
        good[1].clone(),
    ];
    let out = p.publish(&batch).await;
    assert!(
        out[0].is_ok() && out[5].is_ok(),
        "healthy events of the batch still go through: {out:?}"
    );
    let kinds: Vec<(ErrorKind, bool)> = out[1..5]
        .iter()
        .map(|o| {
            let e = o.as_ref().unwrap_err();
            (e.kind(), e.is_retryable())
        })
        .collect();
    assert_eq!(
        kinds,
        vec![
            (ErrorKind::PayloadTooLarge, false),
            (ErrorKind::DestinationNotFound, false),
            (ErrorKind::InvalidInput, false),
            (ErrorKind::InvalidInput, false),
        ]
    );
    assert!(out[2]
        .as_ref()
        .unwrap_err()
        .to_string()
        .contains("does-not-exist"));
    // The channel survived the bad events: the next batch is fine.
    assert!(p.publish(&[event("after", 0)]).await[0].is_ok());
    let got = fx.wait_for(3, WAIT).await;
    let ids: Vec<_> = got.iter().filter_map(|d| d.received.event_id).collect();
    assert!(ids.contains(&good[0].id) && ids.contains(&good[1].id));
    assert_eq!(got.len(), 3, "nothing else was delivered");
    fx.cleanup().await;
}

#[tokio::test]
async fn ten_thousand_confirms_in_one_batch() {
    let fx = Fixture::new().await;
    let p = fx.publisher();
    let events: Vec<_> = (0..10_000)
        .map(|i| event(&format!("agg-{}", i % 100), i / 100))
        .collect();
    let out = p.publish(&events).await;
    assert_eq!(out.len(), 10_000);
    let failed = out.iter().filter(|o| o.is_err()).count();
    assert_eq!(
        failed,
        0,
        "first failure: {:?}",
        out.iter().find(|o| o.is_err())
    );
    let got = fx.wait_for(10_000, Duration::from_secs(60)).await;
    assert_eq!(got.len(), 10_000);
    fx.cleanup().await;
}

#[tokio::test]
async fn a_missing_configured_exchange_is_reported_and_retryable() {
    let fx = Fixture::new().await;
    let p = AmqpPublisher::new(outbox_amqp::AmqpConfig {
        exchange: format!("{}.absent", fx.exchange),
        declare_exchange: false,
        reconnect_initial_backoff: Duration::from_millis(10),
        ..fx.config()
    })
    .unwrap();
    let err = p.check().await.unwrap_err();
    assert!(
        err.is_retryable(),
        "the events wait for the operator: {err}"
    );
    assert!(err.to_string().contains("amqp.declare_exchange"), "{err}");
    let out = p.publish(&[event("a", 0)]).await;
    assert!(out[0].as_ref().unwrap_err().is_retryable());
    fx.cleanup().await;
}

/// The exchanges known to exist are remembered up to a bound, however many destinations writers
/// name; a forgotten one is checked again and still published to.
#[tokio::test]
async fn the_known_exchanges_stay_bounded() {
    let home = Fixture::new().await;
    let mut others = Vec::new();
    for _ in 0..10 {
        others.push(Fixture::new().await);
    }
    let publisher = AmqpPublisher::new(outbox_amqp::AmqpConfig {
        allowed_destinations: vec!["*".into()],
        ..home.config()
    })
    .unwrap()
    .with_exchange_cache(4);
    for round in 0..2 {
        for (i, fx) in others.iter().enumerate() {
            let mut e = event(&format!("agg-{i}"), round);
            e.destination = Some(fx.exchange.clone());
            let outcomes = publisher.publish(&[e]).await;
            assert!(outcomes[0].is_ok(), "{:?}", outcomes[0]);
            assert!(
                publisher.cached_exchanges() <= 4,
                "{} exchanges remembered",
                publisher.cached_exchanges()
            );
        }
    }
    for fx in &others {
        assert_eq!(fx.wait_for(2, WAIT).await.len(), 2, "{}", fx.exchange);
    }
    for fx in others {
        fx.cleanup().await;
    }
    home.cleanup().await;
}

/// By default events may name only the configured exchange: another one, however real, is refused
/// (permission denied, naming the setting) and never probed nor sent to; a pattern in
/// `amqp.allowed_destinations` lets it through.
#[tokio::test]
async fn destinations_outside_the_allow_list_are_refused() {
    let home = Fixture::new().await;
    let other = Fixture::new().await;
    let strict = AmqpPublisher::new(home.config()).unwrap();
    let mut e = event("elsewhere", 0);
    e.destination = Some(other.exchange.clone());
    let out = strict.publish(std::slice::from_ref(&e)).await;
    let err = out[0].as_ref().unwrap_err();
    assert_eq!(
        (err.kind(), err.is_retryable()),
        (ErrorKind::PermissionDenied, false),
        "{err}"
    );
    assert!(
        err.to_string().contains("amqp.allowed_destinations")
            && err.to_string().contains(&other.exchange),
        "{err}"
    );
    assert_eq!(
        strict.cached_exchanges(),
        0,
        "a refused exchange is not even probed"
    );
    let mut mine = event("home", 0);
    mine.destination = Some(home.exchange.clone());
    assert!(
        strict.publish(&[mine]).await[0].is_ok(),
        "the configured exchange stays allowed"
    );
    assert_eq!(home.wait_for(1, WAIT).await.len(), 1);
    assert!(
        other.wait_for(1, Duration::from_secs(1)).await.is_empty(),
        "nothing reached the other exchange"
    );
    let open = AmqpPublisher::new(outbox_amqp::AmqpConfig {
        allowed_destinations: vec!["outbox.test.*".into()],
        ..home.config()
    })
    .unwrap();
    assert!(open.publish(&[e]).await[0].is_ok());
    assert_eq!(other.wait_for(1, WAIT).await.len(), 1);
    other.cleanup().await;
    home.cleanup().await;
}
