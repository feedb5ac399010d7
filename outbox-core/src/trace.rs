//! W3C trace context across the outbox (feature `opentelemetry`).
//!
//! The writer calls [`inject_current`] so each event carries the `traceparent` (and `tracestate`) of
//! the span that wrote it; every publisher copies event headers to broker headers; the relay's
//! `outbox.publish` span links to each event's context ([`link_events`]), so a trace shows the write,
//! the publish and the consumers as one story even though the publish happens later, elsewhere.

use std::collections::{BTreeMap, HashMap};

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::event::{header, Event};

/// Most links one publish span gets (OpenTelemetry's default span link limit).
pub const MAX_LINKS: usize = 128;

/// Writes the current span's W3C context into `headers`, unless they already carry a `traceparent`
/// or no sampled-or-not span is active.
pub fn inject_current(headers: &mut BTreeMap<String, String>) {
    if headers.contains_key(header::TRACEPARENT) {
        return;
    }
    let cx = tracing::Span::current().context();
    if !cx.span().span_context().is_valid() {
        return;
    }
    let mut carrier: HashMap<String, String> = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    for (k, v) in carrier {
        if !v.is_empty() {
            headers.insert(k, v);
        }
    }
}

/// The remote span context carried by `headers`, if valid.
pub fn extract(headers: &BTreeMap<String, String>) -> Option<opentelemetry::trace::SpanContext> {
    let carrier: HashMap<String, String> = headers
        .iter()
        .filter(|(k, _)| k.as_str() == header::TRACEPARENT || k.as_str() == header::TRACESTATE)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if carrier.is_empty() {
        return None;
    }
    let cx = TraceContextPropagator::new().extract(&carrier);
    let sc = cx.span().span_context().clone();
    sc.is_valid().then_some(sc)
}

/// Links `span` to the writer span of each event (at most [`MAX_LINKS`], first ones first).
pub fn link_events(span: &tracing::Span, events: &[Event]) {
    for sc in events
        .iter()
        .filter_map(|e| extract(&e.headers))
        .take(MAX_LINKS)
    {
        span.add_link(sc);
    }
}
