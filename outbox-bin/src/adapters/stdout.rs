//! Standard output: JSON lines, the default publisher (it needs no broker).

use std::sync::Arc;

use async_trait::async_trait;

use outbox_core::publishers::JsonLinesPublisher;
use outbox_core::{Error, Publisher};

use super::{Adapter, Progress};
use crate::bench::engine::BenchTarget;
use crate::bench::BenchArgs;
use crate::config::Config;

/// The standard output adapter.
#[derive(Debug, Clone, Copy)]
pub struct Stdout;

/// The table's entry.
pub static ADAPTER: Stdout = Stdout;

#[async_trait]
impl Adapter for Stdout {
    fn name(&self) -> &'static str {
        "stdout"
    }

    fn validate(&self, _config: &Config) -> Result<(), Error> {
        Ok(())
    }

    async fn publisher(&self, _config: &Config) -> Result<Arc<dyn Publisher>, Error> {
        Ok(Arc::new(JsonLinesPublisher::stdout()))
    }

    async fn bench_target(
        &self,
        _config: &Config,
        _args: &BenchArgs,
        _progress: &Progress,
    ) -> Result<Box<dyn BenchTarget>, Error> {
        let brokers: Vec<&str> = super::available()
            .into_iter()
            .filter(|n| *n != "stdout")
            .chain(["discard"])
            .collect();
        Err(Error::config(format!(
            "outbox bench needs a broker: pass --broker {}, or set publisher.type to one",
            brokers.join("|")
        )))
    }
}
