//! `outbox publish-test`: sends one synthetic event through the configured publisher, to check
//! connectivity, routing and permissions; nothing is written to the outbox.

use txoutbox_core::{Error, ErrorKind, NewEvent};

use super::{build_publisher, Failure};
use crate::config::Config;

pub(super) async fn cmd_publish_test(
    config: &Config,
    event_type: String,
    aggregate_type: String,
    destination: Option<String>,
) -> Result<(), Failure> {
    let publisher = build_publisher(config).await?;
    let sent_at = chrono::Utc::now();
    let mut new = NewEvent::new(
        aggregate_type,
        "publish-test",
        event_type,
        serde_json::json!({ "test": true, "sent_at": sent_at }),
    );
    if let Some(d) = destination {
        new = new.with_destination(d);
    }
    new.validate()?;
    let event = txoutbox_core::Event {
        id: new.id,
        aggregate_type: new.aggregate_type,
        aggregate_id: new.aggregate_id,
        event_type: new.event_type,
        payload: match &new.payload {
            txoutbox_core::Payload::Json(v) => v.to_string().into_bytes(),
            txoutbox_core::Payload::Binary { data, .. } => data.clone(),
        },
        content_type: new.payload.content_type().to_string(),
        headers: new.headers,
        destination: new.destination,
        created_at: sent_at,
        attempts: 0,
    };
    let outcome = publisher
        .publish(std::slice::from_ref(&event))
        .await
        .pop()
        .unwrap_or_else(|| {
            Err(Error::new(
                ErrorKind::Unexpected,
                "the publisher returned no outcome",
            ))
        });
    match outcome {
        Ok(()) => {
            println!(
                "published test event {} ({}) via {}",
                event.id,
                event.event_type,
                publisher.name()
            );
            Ok(())
        }
        Err(e) => Err(Failure {
            code: 1,
            message: format!(
                "publishing the test event via {} failed: {e}",
                publisher.name()
            ),
        }),
    }
}
