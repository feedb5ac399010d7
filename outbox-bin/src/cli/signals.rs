//! SIGTERM and SIGINT (Ctrl-C elsewhere): caught from the start of `outbox relay`, each asks it to
//! stop claiming and finish its batches in flight.

use tracing::{error, info};

use txoutbox_core::CancellationToken;

/// SIGTERM and SIGINT, caught from the moment [`Signals::install`] returns.
pub(super) struct Signals {
    #[cfg(unix)]
    streams: Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>,
}

impl Signals {
    pub(super) fn install() -> Signals {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let streams = match (
                signal(SignalKind::terminate()),
                signal(SignalKind::interrupt()),
            ) {
                (Ok(term), Ok(int)) => Some((term, int)),
                _ => {
                    error!("cannot install signal handlers");
                    None
                }
            };
            Signals { streams }
        }
        #[cfg(not(unix))]
        {
            Signals {}
        }
    }

    /// The next signal's name; never returns when the handlers could not be installed.
    async fn recv(&mut self) -> &'static str {
        #[cfg(unix)]
        {
            match &mut self.streams {
                Some((term, int)) => tokio::select! {
                    _ = term.recv() => "SIGTERM",
                    _ = int.recv() => "SIGINT",
                },
                None => std::future::pending().await,
            }
        }
        #[cfg(not(unix))]
        {
            match tokio::signal::ctrl_c().await {
                Ok(()) => "Ctrl-C",
                Err(_) => std::future::pending().await,
            }
        }
    }
}

pub(super) async fn watch_signals(mut signals: Signals, shutdown: CancellationToken) {
    let name = signals.recv().await;
    info!(
        signal = name,
        "shutdown requested: no new claims; finishing in-flight batches"
    );
    shutdown.cancel();
}
