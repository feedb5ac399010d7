//! Settings of the SQS publisher, with documented defaults.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use txoutbox_core::routing::{AllowList, Template};
use txoutbox_core::{duration, Error};

/// The default queue template.
pub const DEFAULT_QUEUE: &str = "outbox-events";
/// SQS's largest message (body and attributes), and largest `SendMessageBatch` request: 1 MiB.
pub const SQS_MAX_BYTES: usize = 1_048_576;

/// Settings of [`crate::SqsPublisher`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct SqsConfig {
    /// Queue: a URL, or a name resolved to its URL once (then cached); a template over
    /// `{aggregate_type}`, `{aggregate_id}`, `{event_type}`. A name ending in `.fifo` is a FIFO queue.
    /// Default `outbox-events`. An event's own destination (URL or name) wins.
    pub queue: String,
    /// AWS region. Default: the standard chain (`AWS_REGION`, profile), else `us-east-1`.
    pub region: Option<String>,
    /// Endpoint override for emulators or VPC endpoints, e.g. `http://127.0.0.1:4566`. Default:
    /// `AWS_ENDPOINT_URL` if set, else AWS.
    pub endpoint_url: Option<String>,
    /// A CA certificate file (PEM) to trust for HTTPS besides the system's roots: the private CA
    /// of a VPC endpoint behind a corporate proxy, or of an emulator served over HTTPS. Default:
    /// unset, the system's roots only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<std::path::PathBuf>,
    /// Largest message accepted (body plus attributes); larger events fail permanently without
    /// being sent. Default 1 MiB, SQS's limit (lower it to match a queue's `MaximumMessageSize`).
    pub max_message_bytes: usize,
    /// `SendMessageBatch` requests in flight at once. Default 16.
    pub max_concurrent_requests: usize,
    /// Time a whole SDK operation may take, retries included. Default 30 s.
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    #[serde(with = "duration::serde_str")]
    pub operation_timeout: Duration,
    /// Time one attempt may take. Default 10 s.
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    #[serde(with = "duration::serde_str")]
    pub attempt_timeout: Duration,
    /// Time to connect. Default 3 s.
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    #[serde(with = "duration::serde_str")]
    pub connect_timeout: Duration,
    /// Attempts the SDK makes per request (1 = no SDK retry; the relay retries anyway). Default 3.
    pub sdk_max_attempts: u32,
    /// Destinations events may name besides the configured queue: names or patterns where `*`
    /// matches any run of characters (`["*"]` allows every queue). An event whose destination is
    /// neither is dead-lettered with an error naming this setting (permission denied), never sent:
    /// anyone who can write to the outbox could otherwise reach any queue the relay's credentials
    /// reach. Default: none (the configured queue only).
    #[serde(default)]
    pub allowed_destinations: Vec<String>,
}

impl Default for SqsConfig {
    fn default() -> Self {
        SqsConfig {
            queue: DEFAULT_QUEUE.into(),
            region: None,
            endpoint_url: None,
            ca_file: None,
            max_message_bytes: SQS_MAX_BYTES,
            max_concurrent_requests: 16,
            operation_timeout: Duration::from_secs(30),
            attempt_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(3),
            sdk_max_attempts: 3,
            allowed_destinations: Vec::new(),
        }
    }
}

impl SqsConfig {
    /// The destinations this publisher may send to: the configured queue and `allowed_destinations`.
    ///
    /// # Errors
    /// A config error naming `sqs.allowed_destinations` when a pattern is empty.
    pub fn allow_list(&self) -> Result<AllowList, Error> {
        AllowList::new(
            "sqs.allowed_destinations",
            Template::parse("sqs.queue", &self.queue)?.pattern(),
            &self.allowed_destinations,
        )
    }

    /// The publisher's own limit of one call (`Publisher::call_limit`): 1.5 x the operation
    /// timeout.
    pub fn call_limit(&self) -> txoutbox_core::CallLimit {
        txoutbox_core::CallLimit {
            limit: self.operation_timeout.mul_f64(1.5),
            settings: format!(
                "1.5 x sqs.operation_timeout {}",
                txoutbox_core::duration::format(self.operation_timeout)
            ),
        }
    }

    /// Checks the values and parses the queue template.
    ///
    /// # Errors
    /// A config error naming the key (`sqs.<key>`), the value and what is expected.
    pub fn validate(&self) -> Result<Template, Error> {
        if !(1024..=SQS_MAX_BYTES).contains(&self.max_message_bytes) {
            return Err(Error::config(format!(
                "sqs.max_message_bytes = {}: expected 1024 to {SQS_MAX_BYTES}",
                self.max_message_bytes
            )));
        }
        if !(1..=256).contains(&self.max_concurrent_requests) {
            return Err(Error::config(format!(
                "sqs.max_concurrent_requests = {}: expected 1 to 256",
                self.max_concurrent_requests
            )));
        }
        if !(1..=10).contains(&self.sdk_max_attempts) {
            return Err(Error::config(format!(
                "sqs.sdk_max_attempts = {}: expected 1 to 10",
                self.sdk_max_attempts
            )));
        }
        for (key, d) in [
            ("sqs.operation_timeout", self.operation_timeout),
            ("sqs.attempt_timeout", self.attempt_timeout),
            ("sqs.connect_timeout", self.connect_timeout),
        ] {
            if d.is_zero() {
                return Err(Error::config(format!(
                    "{key} = 0s: expected a positive duration"
                )));
            }
        }
        if let Some(url) = &self.endpoint_url {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(Error::config(format!(
                    "sqs.endpoint_url = {url:?}: expected an http:// or https:// URL"
                )));
            }
        }
        if let Some(path) = &self.ca_file {
            txoutbox_core::tls::read_ca_file(path, "sqs.ca_file")?;
        }
        if self.region.as_deref().is_some_and(|r| r.trim().is_empty()) {
            return Err(Error::config(
                "sqs.region is empty: expected a region such as \"eu-west-1\" (or leave it unset)",
            ));
        }
        self.allow_list()?;
        Template::parse("sqs.queue", &self.queue)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_key() {
        let bad = |c: SqsConfig| c.validate().unwrap_err().message().to_string();
        assert!(bad(SqsConfig {
            max_message_bytes: 10,
            ..SqsConfig::default()
        })
        .starts_with("sqs.max_message_bytes"));
        assert!(bad(SqsConfig {
            endpoint_url: Some("127.0.0.1:4566".into()),
            ..SqsConfig::default()
        })
        .starts_with("sqs.endpoint_url"));
        assert!(bad(SqsConfig {
            queue: "{nope}".into(),
            ..SqsConfig::default()
        })
        .starts_with("sqs.queue"));
        assert!(bad(SqsConfig {
            sdk_max_attempts: 0,
            ..SqsConfig::default()
        })
        .starts_with("sqs.sdk_max_attempts"));
        assert!(SqsConfig::default().validate().is_ok());
    }
}
