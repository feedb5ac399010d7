//! The Kafka publisher against a real Kafka-protocol broker.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::HashMap;
use std::time::Duration;

use txoutbox_core::testkit::publisher_suite::event;
use txoutbox_core::Publisher;
use txoutbox_kafka::testing::Fixture;
use txoutbox_kafka::KafkaPublisher;

const WAIT: Duration = Duration::from_secs(60);

// The publisher contract (txoutbox_core::testkit::publisher_suite), one test per rule.
txoutbox_core::publisher_contract!(Fixture::new(3).await);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_headers_and_order_across_partitions() {
    let fx = Fixture::new(4).await;
    let p = fx.publisher();
    let mut events = Vec::new();
    for n in 0..25 {
        for a in 0..8 {
            let mut e = event(&format!("agg-{a}"), n);
            e.event_type = "order.updated".into();
            events.push(e);
        }
    }
    let out = p.publish(&events).await;
    assert!(
        out.iter().all(|o| o.is_ok()),
        "{:?}",
        out.iter().find(|o| o.is_err())
    );
    let got = fx.wait_for(events.len(), WAIT).await;
    assert_eq!(got.len(), events.len());
    let mut partition_of: HashMap<String, i32> = HashMap::new();
    let mut last_n: HashMap<String, i64> = HashMap::new();
    for d in &got {
        let agg = String::from_utf8(d.key.clone().unwrap()).unwrap();
        assert_eq!(
            d.received.aggregate_id.as_deref(),
            Some(agg.as_str()),
            "key = aggregate id"
        );
        let p = *partition_of.entry(agg.clone()).or_insert(d.partition);
        assert_eq!(p, d.partition, "one aggregate, one partition");
        let v: serde_json::Value = serde_json::from_slice(&d.received.payload).unwrap();
        let n = v["n"].as_i64().unwrap();
        if let Some(prev) = last_n.insert(agg.clone(), n) {
            assert!(prev < n, "aggregate {agg}: {n} after {prev}");
        }
        let h = &d.received.headers;
        assert!(h.contains_key("outbox-event-id"));
        assert_eq!(
            h.get("outbox-event-type").map(String::as_str),
            Some("order.updated")
        );
        assert_eq!(
            h.get("outbox-aggregate-type").map(String::as_str),
            Some("order")
        );
        assert_eq!(
            h.get("content-type").map(String::as_str),
            Some("application/json")
        );
        assert!(h.get("traceparent").is_some_and(|t| t.starts_with("00-")));
    }
    let used: std::collections::HashSet<i32> = partition_of.values().copied().collect();
    assert!(
        used.len() > 1,
        "8 aggregates spread over several partitions: {used:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_events_in_one_batch() {
    let fx = Fixture::new(3).await;
    let p = fx.publisher();
    let events: Vec<_> = (0..10_000)
        .map(|i| event(&format!("agg-{}", i % 100), i / 100))
        .collect();
    let out = p.publish(&events).await;
    assert_eq!(
        out.iter().filter(|o| o.is_err()).count(),
        0,
        "{:?}",
        out.iter().find(|o| o.is_err())
    );
    let got = fx.wait_for(10_000, WAIT).await;
    assert_eq!(got.len(), 10_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_event_topics_and_templates() {
    let fx = Fixture::new(1).await;
    // The template renders the topic from the event ("outbox.test.<id>" = "outbox." + aggregate type).
    let p = KafkaPublisher::new(txoutbox_kafka::KafkaConfig {
        topic: "outbox.{aggregate_type}".into(),
        ..fx.config()
    })
    .unwrap();
    let mut templated = event("t", 0);
    templated.aggregate_type = fx.topic.trim_start_matches("outbox.").to_string();
    // The event's own destination wins over the template.
    let mut routed = event("routed", 0);
    routed.event_type = "elsewhere".into();
    routed.destination = Some(fx.topic.clone());
    let out = p.publish(&[templated.clone(), routed.clone()]).await;
    assert!(out.iter().all(|o| o.is_ok()), "{out:?}");
    let got = fx.wait_for(2, WAIT).await;
    let ids: Vec<_> = got.iter().filter_map(|d| d.received.event_id).collect();
    assert_eq!(ids, vec![templated.id, routed.id]);
    assert!(p.check().await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_creates_a_topic_and_reads_its_partition_count() {
    let config = txoutbox_kafka::KafkaConfig {
        brokers: txoutbox_kafka::testing::brokers(),
        ..txoutbox_kafka::KafkaConfig::default()
    };
    let topic = format!("outbox.test.admin.{}", uuid::Uuid::new_v4().simple());
    // Creating it again (with another count) keeps it as it is: the count tells what a caller got.
    for asked in [3, 5] {
        txoutbox_kafka::admin::create_topic(&config, &topic, asked, 1)
            .await
            .unwrap();
        assert_eq!(
            txoutbox_kafka::admin::partition_count(&config, &topic)
                .await
                .unwrap(),
            Some(3),
            "after asking for {asked}"
        );
    }
    txoutbox_kafka::admin::delete_topic(&config, &topic)
        .await
        .unwrap();
}
