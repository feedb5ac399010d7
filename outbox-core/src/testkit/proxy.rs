//! A TCP proxy of the test's own, to make a real server unreachable for a while without stopping it
//! (other tests keep using the server directly).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// Forwards `127.0.0.1:<port>` to a server. [`TcpProxy::cut`] closes every connection through it
/// and stops listening (clients then get "connection refused", as from a stopped server);
/// [`TcpProxy::restore`] listens on the same port again.
#[derive(Debug)]
pub struct TcpProxy {
    port: u16,
    target: SocketAddr,
    tasks: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl TcpProxy {
    /// A proxy on a free loopback port to `target`, listening.
    pub async fn start(target: SocketAddr) -> TcpProxy {
        let proxy = TcpProxy {
            port: super::free_port(),
            target,
            tasks: Arc::default(),
        };
        proxy.restore().await;
        proxy
    }

    /// The loopback port clients connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Closes every connection through the proxy and stops listening.
    pub fn cut(&self) {
        let tasks = std::mem::take(&mut *super::lock(&self.tasks));
        for t in tasks {
            t.abort();
        }
    }

    /// Listens again on the same port (after [`TcpProxy::cut`]).
    pub async fn restore(&self) {
        let listener = TcpListener::bind(("127.0.0.1", self.port))
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "the test proxy cannot listen on 127.0.0.1:{}: {e}",
                    self.port
                )
            });
        let (target, tasks) = (self.target, self.tasks.clone());
        let accept = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let link = tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
                super::lock(&tasks).push(link);
            }
        });
        super::lock(&self.tasks).push(accept);
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.cut();
    }
}
