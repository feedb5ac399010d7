//! W3C trace context from the writer's span, through the outbox, to the broker headers, with the
//! relay's publish span linked to the writer's span (in-memory span exporter).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;

use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use txoutbox_core::testkit::{sample_event, ScriptedPublisher};
use txoutbox_core::{NewEvent, Relay, RelayConfig};
use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_postgres::{PostgresStore, Writer};

#[tokio::test]
async fn the_writer_span_reaches_the_broker_headers_and_the_publish_span_links_to_it() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("outbox-test")));
    let _guard = tracing::subscriber::set_default(subscriber);

    let pg = pool(4).await;
    let table = fresh_table(&pg).await;
    let writer = Writer::new(table.clone());

    // A request handler writes an order and its event inside its own span.
    let request = tracing::info_span!("http.request");
    let writer_trace = request.context().span().span_context().trace_id();
    let writer_span = request.context().span().span_context().span_id();
    async {
        let mut tx = pg.begin().await.unwrap();
        writer
            .enqueue(
                &mut tx,
                NewEvent::new("order", "t-1", "order.created", serde_json::json!({})),
            )
            .await
            .unwrap();
        writer.commit(tx).await.unwrap();
    }
    .instrument(request)
    .await;
    // Outside any span, nothing is captured.
    let mut tx = pg.begin().await.unwrap();
    writer
        .enqueue(&mut tx, sample_event("t-2", 0).with_header("x", "y"))
        .await
        .unwrap();
    writer.commit(tx).await.unwrap();

    let publisher = ScriptedPublisher::new();
    let relay = Relay::new(
        Arc::new(PostgresStore::new(pg.clone(), table)),
        publisher.clone(),
        RelayConfig::default(),
    )
    .unwrap();
    relay.drain().await;
    let delivered = publisher.delivered();
    let traced = delivered.iter().find(|e| e.aggregate_id == "t-1").unwrap();
    let traceparent = traced
        .headers
        .get("traceparent")
        .expect("the writer captured traceparent");
    assert!(
        traceparent.contains(&writer_trace.to_string()),
        "{traceparent} carries trace {writer_trace}"
    );
    assert!(
        traceparent.contains(&writer_span.to_string()),
        "{traceparent} names the writer's span"
    );
    let untraced = delivered.iter().find(|e| e.aggregate_id == "t-2").unwrap();
    assert_eq!(
        untraced.headers.get("traceparent").map(String::as_str),
        Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        "an existing traceparent is kept"
    );

    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();
    let names: Vec<_> = spans.iter().map(|s| s.name.to_string()).collect();
    let publish = spans
        .iter()
        .find(|s| s.name == "outbox.publish")
        .unwrap_or_else(|| panic!("the relay records a publish span: {names:?}"));
    assert!(
        publish
            .links
            .iter()
            .any(|l| l.span_context.trace_id() == writer_trace
                && l.span_context.span_id() == writer_span),
        "the publish span links to the writer's span: {:?}",
        publish.links
    );
}
