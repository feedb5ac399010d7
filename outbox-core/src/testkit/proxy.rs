//! A TCP proxy of the test's own, to make a real server unreachable for a while without stopping it
//! (other tests keep using the server directly).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// Forwards `127.0.0.1:<port>` to a server. [`TcpProxy::cut`] closes every connection through it and
/// closes each new one at once (clients see the server hang up, as when it stops);
/// [`TcpProxy::restore`] forwards again. The port stays bound throughout, so no other program can
/// take it meanwhile.
#[derive(Debug)]
pub struct TcpProxy {
    port: u16,
    cut: Arc<AtomicBool>,
    links: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl TcpProxy {
    /// A proxy on a free loopback port to `target`, forwarding.
    pub async fn start(target: SocketAddr) -> TcpProxy {
        let listener = TcpListener::bind(("127.0.0.1", 0))
            .await
            .unwrap_or_else(|e| panic!("the test proxy cannot listen on 127.0.0.1: {e}"));
        let port = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("the test proxy's address: {e}"))
            .port();
        let cut = Arc::new(AtomicBool::new(false));
        let links: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let (down, open) = (cut.clone(), links.clone());
        let accept = tokio::spawn(async move {
            loop {
                let mut client = match listener.accept().await {
                    Ok((client, _)) => client,
                    // A connection aborted before it was accepted, or no descriptor left: go on.
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                // Decided under the lock that `cut` takes, so no link outlives a cut.
                let mut links = super::lock(&open);
                if down.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                links.push(tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                }));
            }
        });
        TcpProxy {
            port,
            cut,
            links,
            accept,
        }
    }

    /// The loopback port clients connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Closes every connection through the proxy, and each new one as it comes.
    pub fn cut(&self) {
        let mut links = super::lock(&self.links);
        self.cut.store(true, Ordering::SeqCst);
        for link in links.drain(..) {
            link.abort();
        }
    }

    /// Forwards new connections again (after [`TcpProxy::cut`]).
    pub fn restore(&self) {
        let _links = super::lock(&self.links);
        self.cut.store(false, Ordering::SeqCst);
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}
