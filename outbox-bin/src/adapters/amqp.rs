//! RabbitMQ (feature `amqp`): section `[amqp]`, [`txoutbox_amqp::AmqpPublisher`].

use std::sync::Arc;

use async_trait::async_trait;

use txoutbox_amqp::admin::BoundQueue;
use txoutbox_amqp::{AmqpConfig, AmqpPublisher};
use txoutbox_core::format::Formatter;
use txoutbox_core::{Error, Publisher};

use super::{Adapter, Named};
use crate::target::{BenchTarget, Progress, TargetOptions};

/// `[amqp]`.
pub type Section = AmqpConfig;

impl super::Section for AmqpConfig {}

/// The RabbitMQ adapter.
#[derive(Debug, Clone, Copy)]
pub struct Amqp;

/// The table's entry.
pub static ADAPTER: Amqp = Amqp;

/// The benchmark's exchange and queue.
const BENCH: &str = "outbox.bench";

impl Named for Amqp {
    fn name(&self) -> &'static str {
        "amqp"
    }
}

#[async_trait]
impl Adapter for Amqp {
    type Section = AmqpConfig;

    fn call_limit(&self, section: &AmqpConfig) -> Option<txoutbox_core::CallLimit> {
        Some(section.call_limit())
    }

    fn validate(&self, section: &AmqpConfig) -> Result<(), Error> {
        section.validate().map(|_| ())
    }

    fn redact(&self, shown: &mut AmqpConfig) {
        shown.url = txoutbox_amqp::redact_url(&shown.url);
    }

    async fn publisher(
        &self,
        section: &AmqpConfig,
        format: Formatter,
    ) -> Result<Arc<dyn Publisher>, Error> {
        Ok(Arc::new(
            AmqpPublisher::new(section.clone())?.with_format(format),
        ))
    }

    async fn bench_target(
        &self,
        section: &AmqpConfig,
        _options: &TargetOptions,
        progress: &Progress,
    ) -> Result<Box<dyn BenchTarget>, Error> {
        let mut c = section.clone();
        c.exchange = BENCH.into();
        c.declare_exchange = true;
        let queue = BoundQueue::declare(&c, BENCH, "#").await?;
        progress(&format!(
            "amqp: exchange {BENCH} -> durable queue {} at {}",
            queue.name(),
            txoutbox_amqp::redact_url(&c.url)
        ));
        Ok(Box::new(AmqpTarget {
            config: c,
            queue: tokio::sync::Mutex::new(Some(queue)),
        }))
    }
}

/// Exchange `outbox.bench` (declared), bound with `#` to the durable queue `outbox.bench`; purged
/// before each run, deleted at the end. URL and timeouts from `[amqp]`.
struct AmqpTarget {
    config: AmqpConfig,
    queue: tokio::sync::Mutex<Option<BoundQueue>>,
}

#[async_trait]
impl BenchTarget for AmqpTarget {
    fn name(&self) -> &str {
        "amqp"
    }

    async fn publisher(&self) -> Result<Arc<dyn Publisher>, Error> {
        let p = AmqpPublisher::new(self.config.clone())?;
        p.connect().await?;
        Ok(Arc::new(p))
    }

    async fn reset(&self) -> Result<(), Error> {
        if let Some(q) = self.queue.lock().await.as_ref() {
            q.purge().await?;
        }
        Ok(())
    }

    async fn teardown(&self) {
        if let Some(q) = self.queue.lock().await.take() {
            if let Err(e) = q.delete().await {
                eprintln!("[bench] could not delete the queue {BENCH}: {e}");
            }
        }
    }
}
