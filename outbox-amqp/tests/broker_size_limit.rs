//! RabbitMQ's own message size limit (`max_message_size`), lower than the publisher's
//! `amqp.max_message_bytes`: the broker, not the publisher, refuses the event. Alone in its file: it
//! changes the node's setting for the length of the test (and puts it back).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::process::Command;
use std::time::Duration;

use txoutbox_amqp::testing::Fixture;
use txoutbox_core::testkit::publisher_suite::event;
use txoutbox_core::{Event, Publisher};

fn eval(expr: &str) -> String {
    txoutbox_amqp::testing::rabbitmqctl(&["eval", expr])
        .trim()
        .to_string()
}

/// The node's `max_message_size` while alive; the one found, again when dropped.
struct NodeLimit(String);

impl NodeLimit {
    fn set(bytes: usize) -> NodeLimit {
        let before = eval("application:get_env(rabbit, max_message_size).");
        let value = before
            .strip_prefix("{ok,")
            .and_then(|v| v.strip_suffix('}'))
            .unwrap_or("134217728")
            .to_string();
        eval(&format!(
            "application:set_env(rabbit, max_message_size, {bytes})."
        ));
        NodeLimit(value)
    }
}

impl Drop for NodeLimit {
    fn drop(&mut self) {
        // Never a panic here (this may run while the test panics); `scripts/test-env.sh` puts back
        // a limit this test left behind.
        let restored = Command::new("rabbitmqctl")
            .args([
                "eval",
                &format!("application:set_env(rabbit, max_message_size, {}).", self.0),
            ])
            .output();
        if !restored.is_ok_and(|o| o.status.success()) {
            eprintln!(
                "could not put RabbitMQ's max_message_size back to {}",
                self.0
            );
        }
    }
}

fn sized(aggregate: &str, n: usize, bytes: usize) -> Event {
    let mut e = event(aggregate, n);
    e.payload = serde_json::json!({"aggregate": aggregate, "n": n, "pad": "x".repeat(bytes)})
        .to_string()
        .into_bytes();
    e
}

/// An event over the broker's limit fails for good, naming the limit. RabbitMQ closes the channel
/// over it, so the other events of the call fail retryably (saying why), the later event of its
/// aggregate among them; sent again (as the relay does), the others are published, and the publisher
/// goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_over_the_brokers_own_limit_fails_for_good_naming_the_limit() {
    let _limit = NodeLimit::set(1024 * 1024);
    let fx = Fixture::new().await;
    let p = fx.publisher();
    assert!(p.config().max_message_bytes > 2 * 1024 * 1024);
    let events = vec![
        sized("a", 0, 1000),
        sized("b", 0, 2 * 1024 * 1024),
        sized("c", 0, 1000),
        sized("b", 1, 1000),
        sized("d", 0, 1000),
    ];
    let out = p.publish(&events).await;
    let describe = |o: &txoutbox_core::PublishOutcome| match o {
        Ok(()) => "published".to_string(),
        Err(e) => format!("{:?} retryable={}: {e}", e.kind(), e.is_retryable()),
    };
    let said: Vec<String> = out.iter().map(describe).collect();
    let big = out[1]
        .as_ref()
        .expect_err("the broker refuses the 2 MiB event");
    assert_eq!(
        big.kind(),
        txoutbox_core::ErrorKind::PayloadTooLarge,
        "{big}"
    );
    assert!(
        !big.is_retryable(),
        "a message the broker refuses as too large fails for good: {big}"
    );
    assert!(
        big.to_string().contains("max_message_size of 1048576"),
        "the error names the broker's limit: {big}"
    );
    for i in [0, 2, 3, 4] {
        assert!(
            out[i].as_ref().err().is_none_or(|e| e.is_retryable()),
            "event {i} is not at fault: {}",
            said[i]
        );
    }
    // The relay sends the others again (the later event of b stays held back behind the dead letter).
    let others = [events[0].clone(), events[2].clone(), events[4].clone()];
    let again = p.publish(&others).await;
    assert!(again.iter().all(Result::is_ok), "{again:?}");
    let expected: std::collections::HashSet<_> = others.iter().map(|e| e.id).collect();
    let mut ids = std::collections::HashSet::new();
    for n in others.len()..others.len() + 4 {
        let got = fx.wait_for(n, Duration::from_secs(30)).await;
        ids = got.iter().filter_map(|d| d.received.event_id).collect();
        if expected.is_subset(&ids) {
            break;
        }
    }
    assert!(expected.is_subset(&ids), "published: {ids:?}");
    assert!(!ids.contains(&events[1].id) && !ids.contains(&events[3].id));
}
