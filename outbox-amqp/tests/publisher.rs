//! The AMQP publisher against the real RabbitMQ server.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use txoutbox_amqp::testing::Fixture;
use txoutbox_amqp::AmqpPublisher;
use txoutbox_core::testkit::publisher_suite::event;
use txoutbox_core::{ErrorKind, Publisher};

const WAIT: Duration = Duration::from_secs(30);

// The publisher contract (txoutbox_core::testkit::publisher_suite), one test per rule.
txoutbox_core::publisher_contract!(Fixture::new().await);

/// With `amqp.cloudevents_prefix = "ce-"`, binary-mode CloudEvents are read by Knative's RabbitMQ
/// binding (the CloudEvents SDK's `rabbitmq` binding) instead of the AMQP one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_with_the_knative_prefix_are_read_by_its_binding() {
    use txoutbox_core::testkit::{publisher_suite, BrokerFixture, CloudEventsBinding};
    let fx = Fixture::new().await.with_cloudevents_prefix("ce-");
    assert_eq!(fx.cloudevents_binding(), CloudEventsBinding::RabbitMq);
    publisher_suite::messages_in_each_format_are_read_by_a_cloudevents_library(&fx).await;
    fx.dispose().await;
}

#[test]
fn an_unknown_cloudevents_prefix_is_a_config_error() {
    let config = txoutbox_amqp::AmqpConfig {
        cloudevents_prefix: "x-ce-".into(),
        ..txoutbox_amqp::AmqpConfig::default()
    };
    let e = AmqpPublisher::new(config).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(
        e.message().contains("amqp.cloudevents_prefix = \"x-ce-\"")
            && e.message().contains("cloudEvents_"),
        "{e}"
    );
}

/// With `amqp.cloudevents_prefix = "ce_"` the attributes travel under the Kafka binding's names:
/// every attribute of binary mode, and the content type in the message's property.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_under_the_kafka_bindings_names_carry_every_attribute() {
    use txoutbox_core::format::{Formatter, MessageFormat};
    use txoutbox_core::testkit::{BrokerFixture, Setup};
    let fx = Fixture::new().await.with_cloudevents_prefix("ce_");
    let p = fx
        .build(Setup {
            format: Formatter::new(
                MessageFormat::CloudeventsBinary,
                "s",
                "/shop/{aggregate_type}",
            )
            .unwrap(),
            ..Setup::default()
        })
        .await
        .publisher;
    let e = event("order-ce", 1);
    assert!(p.publish(std::slice::from_ref(&e)).await[0].is_ok());
    let got = fx.wait_for(1, WAIT).await;
    let h = &got[0].received.headers;
    let expected = Formatter::new(
        MessageFormat::CloudeventsBinary,
        "s",
        "/shop/{aggregate_type}",
    )
    .unwrap()
    .headers(&e, "ce_");
    for (name, value) in expected {
        assert_eq!(h.get(&name), Some(&value), "{name} in {h:?}");
    }
    assert_eq!(
        got[0].received.content_type.as_deref(),
        Some(e.content_type.as_str())
    );
    fx.dispose().await;
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
    let p = AmqpPublisher::new(txoutbox_amqp::AmqpConfig {
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
    let p = AmqpPublisher::new(txoutbox_amqp::AmqpConfig {
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
    let p = AmqpPublisher::new(txoutbox_amqp::AmqpConfig {
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
