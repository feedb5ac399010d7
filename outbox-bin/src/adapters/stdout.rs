//! Standard output: JSON lines, the default publisher (it needs no broker).

use std::sync::Arc;

use async_trait::async_trait;

use txoutbox_core::format::Formatter;
use txoutbox_core::publishers::JsonLinesPublisher;
use txoutbox_core::{Error, Publisher};

use super::{Adapter, Named};
use crate::target::{BenchTarget, Progress, TargetOptions};

/// The standard output adapter.
#[derive(Debug, Clone, Copy)]
pub struct Stdout;

/// The table's entry.
pub static ADAPTER: Stdout = Stdout;

impl Named for Stdout {
    fn name(&self) -> &'static str {
        "stdout"
    }
}

/// It has no section; each event is printed as a JSON line (`publisher.format` applies to brokers).
#[async_trait]
impl Adapter for Stdout {
    type Section = ();

    fn validate(&self, _section: &()) -> Result<(), Error> {
        Ok(())
    }

    async fn publisher(
        &self,
        _section: &(),
        _format: Formatter,
    ) -> Result<Arc<dyn Publisher>, Error> {
        Ok(Arc::new(JsonLinesPublisher::stdout()))
    }

    async fn bench_target(
        &self,
        _section: &(),
        _options: &TargetOptions,
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
