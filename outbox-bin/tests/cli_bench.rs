//! `outbox bench` against the real PostgreSQL and brokers, with small sizes: every phase runs and
//! reports consistent figures, the benchmark's schema and destinations are removed, bad options are
//! refused. (Speed is the benchmark's output, never asserted here.)
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use common::{outbox, run, text, unmigrated_table};
use serde_json::Value;
use txoutbox_postgres::testing::pool;

fn bench_schema() -> String {
    format!(
        "outbox_bench_t{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    )
}

fn bench(schema: &str, broker: &str, extra: &[&str]) -> (i32, Value, String) {
    let table = unmigrated_table();
    let mut args = vec!["bench", "--broker", broker, "--schema", schema, "--json"];
    args.extend_from_slice(extra);
    let mut c = outbox(&table, &args);
    c.env("OUTBOX_AMQP__URL", txoutbox_amqp::testing::amqp_url())
        .env("OUTBOX_KAFKA__BROKERS", txoutbox_kafka::testing::brokers())
        .env(
            "OUTBOX_SQS__ENDPOINT_URL",
            txoutbox_sqs::testing::endpoint(),
        )
        .env("OUTBOX_SQS__REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test");
    let out = run(c);
    let stderr = text(&out.stderr);
    let json = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out.status.code().unwrap_or(-1), json, stderr)
}

async fn schema_exists(schema: &str) -> bool {
    let pg = pool(1).await;
    sqlx::query_scalar::<_, bool>("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
        .bind(schema)
        .fetch_one(&pg)
        .await
        .unwrap()
}

fn num(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
}

#[tokio::test]
async fn every_phase_runs_against_rabbitmq_and_reports_consistent_figures() {
    let schema = bench_schema();
    let (code, r, stderr) = bench(
        &schema,
        "amqp",
        &[
            "--backlog=3000",
            "--relays=2",
            "--aggregates=50",
            "--reference-events=400",
            "--writers=2",
            "--writer-duration=1s",
            "--rate=200",
            "--latency-duration=2s",
            "--claim-processed-rows=20000",
            "--claim-pending-rows=5000",
            "--claim-samples=5",
            // Past the WAL source's part size (10 x wal.read_ahead = 20,000 events).
            "--transactions=30000x100x20",
        ],
    );
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stderr.contains("[bench] drain"),
        "progress is shown: {stderr}"
    );
    assert_eq!(r["target"], "amqp");

    let w = &r["writer"];
    assert!(num(w, "without_outbox_tps") > 0.0 && num(w, "with_outbox_tps") > 0.0);
    let expected_overhead = 1.0 - num(w, "with_outbox_tps") / num(w, "without_outbox_tps");
    assert!((num(w, "overhead") - expected_overhead).abs() < 1e-9);
    assert!(num(w, "with_noop_statement_tps") > 0.0);
    let expected_floor = 1.0 - num(w, "with_noop_statement_tps") / num(w, "without_outbox_tps");
    assert!((num(w, "noop_statement_overhead") - expected_floor).abs() < 1e-9);
    assert!(num(w, "with_outbox_without_ordering_tps") > 0.0);
    let expected_rule =
        1.0 - num(w, "with_outbox_tps") / num(w, "with_outbox_without_ordering_tps");
    assert!((num(w, "ordering_rule_overhead") - expected_rule).abs() < 1e-9);
    assert!(num(w, "with_message_tps") > 0.0);
    let expected_message = 1.0 - num(w, "with_message_tps") / num(w, "without_outbox_tps");
    assert!((num(w, "message_overhead") - expected_message).abs() < 1e-9);
    assert!(num(w, "with_message_in_statement_tps") > 0.0);

    let drain = r["drain"].as_array().unwrap();
    let runs: Vec<(String, String, u64, u64)> = drain
        .iter()
        .map(|d| {
            (
                d["relay"].as_str().unwrap().to_string(),
                d["publisher"].as_str().unwrap().to_string(),
                d["relays"].as_u64().unwrap(),
                d["events"].as_u64().unwrap(),
            )
        })
        .collect();
    let run = |relay: &str, publisher: &str, relays, events| {
        (relay.to_string(), publisher.to_string(), relays, events)
    };
    assert_eq!(
        runs,
        vec![
            run("yardstick", "none", 1, 3000),
            run("relay", "discard", 1, 3000),
            run("relay", "amqp", 1, 3000),
            run("relay", "discard", 2, 3000),
            run("relay", "amqp", 2, 3000),
            run("wal", "discard", 1, 3000),
            run("wal", "amqp", 1, 3000),
            run("reference", "amqp", 1, 400),
        ]
    );
    for d in drain {
        let rate = num(d, "events_per_second");
        assert!(rate > 0.0);
        assert!((rate * num(d, "seconds") - num(d, "events")).abs() < 1.0);
        if d["relay"] != "yardstick" {
            assert!(num(d, "peak_rss_bytes") > 1e6, "RSS sampled: {d}");
        }
    }
    // One large transaction, drained by each source.
    let transactions = r["transactions"].as_array().unwrap();
    assert_eq!(transactions.len(), 1, "{r}");
    assert_eq!(transactions[0]["transaction"]["events"], 30_000);
    let sources: Vec<&str> = transactions[0]["drains"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            assert_eq!(d["events"], 30_000, "{d}");
            assert!(num(d, "peak_rss_bytes") > 1e6, "RSS sampled: {d}");
            d["relay"].as_str().unwrap()
        })
        .collect();
    assert_eq!(sources, ["relay", "wal"]);
    let ratio = |p: &str| r["ratios"][p].as_f64().unwrap();
    let rate = |i: usize| num(&drain[i], "events_per_second");
    assert!((ratio("ceiling_vs_yardstick_1") - rate(1) / rate(0)).abs() < 1e-9);
    assert!((ratio("ceiling_vs_yardstick_n") - rate(3) / rate(0)).abs() < 1e-9);
    assert!((ratio("target_vs_ceiling_1") - rate(2) / rate(1)).abs() < 1e-9);
    assert!((ratio("target_vs_ceiling_n") - rate(4) / rate(3)).abs() < 1e-9);
    assert!((ratio("target_vs_reference") - rate(2).max(rate(4)) / rate(7)).abs() < 1e-9);
    // The WAL source beside the polling relay, one relay each.
    assert!((ratio("wal_vs_polling_ceiling") - rate(5) / rate(1)).abs() < 1e-9);
    assert!((ratio("wal_vs_polling_target") - rate(6) / rate(2)).abs() < 1e-9);
    // The publisher alone: the drain's backlog, in the relay's batch size and in-flight count.
    let p = &r["publisher"];
    assert_eq!(p["events"].as_u64(), Some(3000), "{p}");
    assert_eq!(p["batch_size"].as_u64(), Some(500), "{p}");
    assert_eq!(p["in_flight"].as_u64(), Some(2), "{p}");
    assert!((num(p, "events_per_second") * num(p, "seconds") - 3000.0).abs() < 1.0);
    assert!(num(p, "batch_p50_ms") > 0.0 && num(p, "batch_p50_ms") <= num(p, "batch_p99_ms"));
    assert!((ratio("target_vs_publisher") - rate(2) / num(p, "events_per_second")).abs() < 1e-9);
    // The relay's RSS is the one-relay runs' (the N-relay runs hold N relays).
    let one_relay_rss = num(&drain[1], "peak_rss_bytes").max(num(&drain[2], "peak_rss_bytes"));
    assert_eq!(num(&r, "relay_peak_rss_bytes"), one_relay_rss);

    let latency = r["latency"].as_array().unwrap();
    assert_eq!(latency.len(), 3);
    assert_eq!(latency[0]["wakeup"], "poll");
    assert_eq!(latency[1]["wakeup"], "notify");
    assert_eq!(latency[2]["wakeup"], "wal");
    for l in latency {
        // 2 s at 200/s, the first second not counted: at most 400 events, each acknowledged (a
        // loaded machine may write fewer).
        let events = num(l, "events");
        assert!((20.0..=400.0).contains(&events), "{l}");
        let (p50, p95, p99, max) = (
            num(l, "p50_ms"),
            num(l, "p95_ms"),
            num(l, "p99_ms"),
            num(l, "max_ms"),
        );
        assert!(p50 > 0.0 && p50 <= p95 && p95 <= p99 && p99 <= max, "{l}");
        // Where the time went: every batch claimed, published and settled, with ordered percentiles.
        let g = &l["stages"];
        let batches = num(g, "batches");
        assert!(batches >= 1.0, "{l}");
        // Calls of at most the batch size (the default 500), each with at least one event.
        let per_batch = num(g, "mean_batch_events");
        assert!((1.0..=500.0).contains(&per_batch), "{l}");
        for step in ["claim", "publish", "settle"] {
            let (p50, p99) = (
                num(g, &format!("{step}_p50_ms")),
                num(g, &format!("{step}_p99_ms")),
            );
            assert!(p50 > 0.0 && p50 <= p99, "{step}: {l}");
        }
    }

    let claim = r["claim"].as_array().unwrap();
    let states: Vec<(u64, u64)> = claim
        .iter()
        .map(|c| {
            (
                c["pending_rows"].as_u64().unwrap(),
                c["processed_rows"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(states, vec![(10_000, 0), (10_000, 20_000), (5_000, 0)]);
    assert_eq!(num(&claim[0], "vs_first"), 1.0);
    for c in claim {
        assert!(num(c, "median_ms") > 0.0 && num(c, "median_ms") <= num(c, "p95_ms"));
    }

    assert!(!schema_exists(&schema).await, "the bench schema is dropped");
}

#[tokio::test]
async fn drains_to_kafka_and_sqs() {
    for (broker, backlog) in [("kafka", "2000"), ("sqs", "300")] {
        let schema = bench_schema();
        let (code, r, stderr) = bench(
            &schema,
            broker,
            &[
                "--phases=drain",
                "--relays=1",
                "--aggregates=20",
                "--kafka-partitions=3",
                &format!("--backlog={backlog}"),
            ],
        );
        if broker == "kafka" {
            assert!(stderr.contains("(3 partitions)"), "{stderr}");
        }
        assert_eq!(code, 0, "{broker}: {stderr}");
        let drain = r["drain"].as_array().unwrap();
        // The yardstick, the polling relay to the ceiling and the broker, the WAL source to both.
        assert_eq!(drain.len(), 5, "{r}");
        assert_eq!(drain[2]["publisher"], broker);
        assert_eq!(
            (drain[4]["relay"].as_str(), drain[4]["publisher"].as_str()),
            (Some("wal"), Some(broker))
        );
        assert_eq!(
            drain[2]["events"].as_u64().unwrap(),
            backlog.parse::<u64>().unwrap()
        );
        assert_eq!(
            r["publisher"]["events"].as_u64().unwrap(),
            backlog.parse::<u64>().unwrap(),
            "{broker}: the publisher alone runs with the drain"
        );
        assert!(r["latency"].as_array().unwrap().is_empty());
        assert!(r["writer"].is_null());
        assert!(!schema_exists(&schema).await);
    }
}

#[tokio::test]
async fn refuses_options_it_cannot_honour() {
    let (code, _, stderr) = bench("public", "discard", &[]);
    assert_eq!(code, 2);
    assert!(stderr.contains("outbox_bench"), "{stderr}");

    let (code, _, stderr) = bench(&bench_schema(), "discard", &["--phases=drain,warp"]);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("\"warp\"") && stderr.contains("expected writer"),
        "{stderr}"
    );

    let (code, _, stderr) = bench(&bench_schema(), "discard", &["--transactions=500000x4096"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("EVENTSxBYTESxAGGREGATES"), "{stderr}");

    let (code, _, stderr) = bench(&bench_schema(), "carrier-pigeon", &[]);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("carrier-pigeon") && stderr.contains("amqp"),
        "{stderr}"
    );

    // The default configuration publishes to standard output, which is no broker to measure.
    let table = unmigrated_table();
    let out = run(outbox(&table, &["bench"]));
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("--broker"),
        "{}",
        text(&out.stderr)
    );
}

/// `--publish-delay` makes every publisher call of the drains that much slower: a slow broker, for
/// showing that relays scale out against one.
#[tokio::test]
async fn a_publish_delay_slows_every_call_of_the_drains() {
    let schema = bench_schema();
    let (code, r, stderr) = bench(
        &schema,
        "discard",
        &[
            "--phases=drain",
            "--relays=2",
            "--backlog=1500",
            "--aggregates=100",
            "--publish-delay=30ms",
        ],
    );
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(r["options"]["publish_delay"], "30ms", "{r}");
    let drain = r["drain"].as_array().unwrap();
    for d in drain.iter().filter(|d| d["relay"] == "relay") {
        let publish = d["stages"]["publish_p50_ms"].as_f64().unwrap();
        assert!(publish >= 30.0, "every call waits 30 ms: {d}");
    }
    assert!(
        drain[0]["stages"].is_null(),
        "the yardstick publishes nothing"
    );
    assert!(!schema_exists(&schema).await);
}
