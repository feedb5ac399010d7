//! Amazon SQS (feature `sqs`): section `[sqs]`, [`txoutbox_sqs::SqsPublisher`].

use std::sync::Arc;

use async_trait::async_trait;

use txoutbox_core::format::Formatter;
use txoutbox_core::{Error, Publisher};
use txoutbox_sqs::{admin, SqsConfig, SqsPublisher};

use super::{Adapter, Named};
use crate::target::{BenchTarget, Progress, TargetOptions};

/// `[sqs]`.
pub type Section = SqsConfig;

impl super::Section for SqsConfig {}

/// The SQS adapter.
#[derive(Debug, Clone, Copy)]
pub struct Sqs;

/// The table's entry.
pub static ADAPTER: Sqs = Sqs;

/// The benchmark's queue.
const QUEUE: &str = "outbox-bench";

impl Named for Sqs {
    fn name(&self) -> &'static str {
        "sqs"
    }
}

#[async_trait]
impl Adapter for Sqs {
    type Section = SqsConfig;

    fn call_limit(&self, section: &SqsConfig) -> Option<txoutbox_core::CallLimit> {
        Some(section.call_limit())
    }

    fn validate(&self, section: &SqsConfig) -> Result<(), Error> {
        section.validate().map(|_| ())
    }

    async fn publisher(
        &self,
        section: &SqsConfig,
        format: Formatter,
    ) -> Result<Arc<dyn Publisher>, Error> {
        Ok(Arc::new(
            SqsPublisher::new(section.clone())
                .await?
                .with_format(format),
        ))
    }

    async fn bench_target(
        &self,
        section: &SqsConfig,
        _options: &TargetOptions,
        progress: &Progress,
    ) -> Result<Box<dyn BenchTarget>, Error> {
        let mut c = section.clone();
        c.queue = QUEUE.into();
        let admin = SqsPublisher::new(c.clone()).await?;
        let url = admin::create_queue(&admin, QUEUE).await?;
        progress(&format!("sqs: queue {url}"));
        Ok(Box::new(SqsTarget {
            config: c,
            admin,
            url,
        }))
    }
}

/// Standard queue `outbox-bench` (created for the run, deleted at the end); region, endpoint and
/// timeouts from `[sqs]`.
struct SqsTarget {
    config: SqsConfig,
    admin: SqsPublisher,
    url: String,
}

#[async_trait]
impl BenchTarget for SqsTarget {
    fn name(&self) -> &str {
        "sqs"
    }

    async fn publisher(&self) -> Result<Arc<dyn Publisher>, Error> {
        Ok(Arc::new(SqsPublisher::new(self.config.clone()).await?))
    }

    async fn teardown(&self) {
        if let Err(e) = admin::delete_queue(&self.admin, &self.url).await {
            eprintln!("[bench] could not delete the queue {}: {e}", self.url);
        }
    }
}
