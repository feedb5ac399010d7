//! Unit tests of the publisher against brokers that never answer (a listener nobody accepts
//! from): refusals before producing, refused records sent again alone, when the producer is
//! replaced; then how runs are split into calls, and topic names.

use super::producer::STALE_MESSAGES;
use super::*;

/// A publisher with `config`, but brokers that take connections and never answer (a listener
/// nobody accepts from: the kernel completes the handshakes and buffers the requests, as a
/// connection wedged by an outage does) and a delivery timeout of 300 ms. Keep the listener.
fn silent_publisher(config: KafkaConfig) -> (std::net::TcpListener, KafkaPublisher) {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let publisher = KafkaPublisher::new(KafkaConfig {
        brokers: silent.local_addr().unwrap().to_string(),
        topic: "silent".into(),
        delivery_timeout: Duration::from_millis(300),
        ..config
    })
    .unwrap();
    (silent, publisher)
}

/// One event of each of `n` aggregates.
fn one_each(n: usize) -> Vec<Event> {
    (0..n)
        .map(|n| txoutbox_core::testkit::publisher_suite::event(&format!("o-{n}"), n))
        .collect()
}

/// An event with an empty aggregate id (written by plain SQL: the Writer refuses one) would be
/// a record with an empty key, which the default partitioner sends to any partition: it fails
/// for good before it is produced, the rest of its aggregate is not sent past it, and other
/// aggregates' events go on (here to brokers that never answer, so they time out). Under a
/// partitioner that hashes an empty key, it is sent like any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_without_an_aggregate_id_fails_for_good_before_it_is_produced() {
    let (_silent, publisher) = silent_publisher(KafkaConfig::default());
    let events = vec![
        txoutbox_core::testkit::publisher_suite::event("", 0),
        txoutbox_core::testkit::publisher_suite::event("", 1),
        txoutbox_core::testkit::publisher_suite::event("o-2", 2),
    ];
    assert_eq!(events[0].aggregate_id, "");
    let outcomes = publisher.publish(&events).await;
    let kinds: Vec<(ErrorKind, bool)> = outcomes
        .iter()
        .map(|o| {
            let e = o.as_ref().unwrap_err();
            (e.kind(), e.is_retryable())
        })
        .collect();
    assert_eq!(
        kinds,
        vec![
            (ErrorKind::InvalidInput, false),
            (ErrorKind::Rejected, true),
            (ErrorKind::Timeout, true),
        ],
        "{outcomes:?}"
    );
    let message = outcomes[0].as_ref().unwrap_err().to_string();
    assert!(message.contains("aggregate_id is empty"), "{message}");

    let mut hashing = KafkaConfig::default();
    hashing
        .properties
        .insert("partitioner".into(), "murmur2_random".into());
    let (_silent, publisher) = silent_publisher(hashing);
    let outcomes = publisher.publish(&events[..1]).await;
    assert!(
        matches!(outcomes.as_slice(), [Err(e)] if e.kind() == ErrorKind::Timeout),
        "sent (to brokers that never answer): {outcomes:?}"
    );
}

/// Brokers that never answer (`silent_publisher`), as a connection wedged by an outage.
/// Two calls in a row that time out entirely replace the producer although its metadata check
/// fails too; a producer kept there would time out every later call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_whose_calls_time_out_twice_is_replaced_even_when_the_brokers_do_not_answer() {
    let (silent, publisher) = silent_publisher(KafkaConfig::default());
    let first = publisher.producer();
    let event = txoutbox_core::testkit::publisher_suite::event("o-1", 1);
    let timed_out = |outcomes: Vec<PublishOutcome>| matches!(outcomes.as_slice(), [Err(e)] if e.kind() == ErrorKind::Timeout);
    assert!(timed_out(
        publisher.publish(std::slice::from_ref(&event)).await
    ));
    assert!(publisher.check().await.is_err(), "the brokers answered");
    assert!(publisher.is_current(&first), "replaced after one call");
    assert!(timed_out(
        publisher.publish(std::slice::from_ref(&event)).await
    ));
    assert!(
        !publisher.is_current(&first),
        "the producer was kept after two calls in a row timed out"
    );
    drop(silent);
}

/// Sending refused records again alone: not an event whose aggregate had an earlier event fail
/// otherwise in the call, and once a resend finds the broker not answering, no more (the rest
/// come back as back-pressure).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_records_go_again_alone_in_order_and_within_the_budget() {
    let (silent, publisher) = silent_publisher(KafkaConfig::default());
    let event = txoutbox_core::testkit::publisher_suite::event;
    let events = [event("a", 0), event("a", 1), event("b", 0), event("c", 0)];
    let refusal = || {
        Some(Err(Error::new(
            ErrorKind::InvalidInput,
            "refused with its batch",
        )
        .permanent()))
    };
    let mut outcomes = vec![
        Some(Err(Error::new(ErrorKind::Connection, "failed otherwise"))),
        refusal(),
        refusal(),
        refusal(),
    ];
    publisher
        .resend_alone(&events, &[1, 2, 3], &mut outcomes, Duration::from_secs(5))
        .await;
    let kinds: Vec<ErrorKind> = outcomes
        .iter()
        .map(|o| o.as_ref().unwrap().as_ref().unwrap_err().kind())
        .collect();
    assert_eq!(
        kinds,
        vec![
            ErrorKind::Connection,   // as it was
            ErrorKind::Rejected,     // not sent: its aggregate's earlier event failed
            ErrorKind::Timeout,      // sent alone; the brokers do not answer
            ErrorKind::Backpressure, // not sent once they did not
        ]
    );
    drop(silent);
}

/// Records the producer drops (purged: it failed, or was replaced) while no record of the call
/// was refused come back as connection errors (an attempt, and the relay's outage handling),
/// not as back-pressure sent again at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_a_failing_producer_drops_with_no_record_refused_are_connection_errors() {
    let (silent, publisher) = silent_publisher(KafkaConfig {
        delivery_timeout: Duration::from_secs(10),
        ..KafkaConfig::default()
    });
    let producer = publisher.producer();
    let events: Vec<Event> = (0..3)
        .map(|n| txoutbox_core::testkit::publisher_suite::event("o-1", n))
        .collect();
    let purge = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        producer.purge(rdkafka::producer::PurgeConfig::default().queue().inflight());
    };
    let (outcomes, ()) = tokio::join!(publisher.publish(&events), purge);
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, Err(e) if e.kind() == ErrorKind::Connection && e.is_retryable())),
        "{outcomes:?}"
    );
    drop(silent);
}

/// A producer whose queue is full of records the brokers have not taken (a call left them there)
/// and takes none of the next call's within `enqueue_timeout` is replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_whose_full_queue_takes_no_record_of_a_call_is_replaced() {
    let (silent, publisher) = silent_publisher(KafkaConfig {
        enqueue_timeout: Duration::from_millis(100),
        properties: [("queue.buffering.max.messages".to_string(), "10".to_string())].into(),
        ..KafkaConfig::default()
    });
    let first = publisher.producer();
    let events: Vec<Event> = one_each(20);
    let outcomes = publisher.publish(&events).await;
    assert!(outcomes
        .iter()
        .any(|o| matches!(o, Err(e) if e.kind() == ErrorKind::Timeout)));
    assert!(
        publisher.is_current(&first),
        "replaced after the first call"
    );
    let outcomes = publisher.publish(&events[..5]).await;
    assert!(outcomes
        .iter()
        .all(|o| matches!(o, Err(e) if e.kind() == ErrorKind::Backpressure)));
    assert!(!publisher.is_current(&first), "the full producer was kept");
    drop(silent);
}

/// A call whose events time out while the producer holds many messages the brokers have not
/// taken (no message expires in its queue) replaces the producer at once, dropping them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_left_holding_many_unsent_messages_is_replaced() {
    let (silent, publisher) = silent_publisher(KafkaConfig::default());
    // A call of many events: they stay in the producer's queue (a call does not count the
    // messages it has just enqueued as stale, up to twice its own).
    let first = publisher.producer();
    let many: Vec<Event> = one_each(STALE_MESSAGES as usize);
    let outcomes = publisher.publish(&many).await;
    assert!(outcomes
        .iter()
        .all(|o| matches!(o, Err(e) if e.kind() == ErrorKind::Timeout)));
    assert!(publisher.is_current(&first), "replaced after one call");
    // The next call times out too, but not entirely (one event is refused at once): the copies
    // the producer still holds replace it, not two calls in a row timed out.
    let mut refused = txoutbox_core::testkit::publisher_suite::event("o-x", 0);
    refused.destination = Some("not-allowed".into());
    let next = [
        refused,
        txoutbox_core::testkit::publisher_suite::event("o-y", 0),
    ];
    let outcomes = publisher.publish(&next).await;
    assert!(matches!(&outcomes[0], Err(e) if e.kind() != ErrorKind::Timeout));
    assert!(matches!(&outcomes[1], Err(e) if e.kind() == ErrorKind::Timeout));
    assert!(
        !publisher.is_current(&first),
        "the producer kept {} unsent messages",
        first.in_flight_count()
    );
    drop(silent);
}

/// The idempotent producer takes an aggregate's run in one call, up to an event routed to
/// another topic; without idempotence, one event of an aggregate per call.
#[test]
fn runs_go_in_one_call_per_topic_with_the_idempotent_producer() {
    let publisher = KafkaPublisher::new(KafkaConfig {
        allowed_destinations: vec!["audit".into()],
        ..KafkaConfig::default()
    })
    .unwrap();
    assert!(publisher.keeps_order());
    let first = txoutbox_core::testkit::publisher_suite::event("o-1", 1);
    let second = txoutbox_core::testkit::publisher_suite::event("o-1", 2);
    let mut elsewhere = txoutbox_core::testkit::publisher_suite::event("o-1", 3);
    elsewhere.destination = Some("audit".into());
    assert!(publisher.same_call(&first, &second));
    assert!(!publisher.same_call(&second, &elsewhere));
    let by_type = KafkaPublisher::new(KafkaConfig {
        topic: "events.{event_type}".into(),
        ..KafkaConfig::default()
    })
    .unwrap();
    assert!(!by_type.keeps_order());
    let mut shipped = second.clone();
    shipped.event_type = "order.shipped".into();
    assert!(!by_type.same_call(&second, &shipped));
    let plain = KafkaPublisher::new(KafkaConfig {
        idempotence: false,
        acks: "1".into(),
        ..KafkaConfig::default()
    })
    .unwrap();
    assert!(!plain.keeps_order());
}

#[test]
fn topic_names_are_checked() {
    assert!(check_topic("outbox.event.order").is_ok());
    assert!(check_topic("Orders_v2-eu").is_ok());
    for bad in [
        "",
        ".",
        "..",
        "has space",
        "slash/topic",
        "ünïcode",
        &"x".repeat(250),
    ] {
        let e = check_topic(bad).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::DestinationNotFound);
        assert!(!e.is_retryable());
    }
}
