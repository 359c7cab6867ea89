//! TLS over TCP through rustls: the same handshake and frames inside a TLS session.
//! Certificates and client-certificate verification are rustls configurations, built by
//! the application; this module only wires them to an endpoint.

use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio_rustls::{TlsAcceptor, TlsConnector};

pub use tokio_rustls::rustls;

use crate::endpoint::Endpoint;
use crate::error::RpcError;
use crate::peer::Peer;

impl Endpoint {
    /// Connects over TCP, then TLS as `server_name` with `config`, then the handshake.
    pub async fn connect_tls(
        &self,
        addr: impl ToSocketAddrs,
        server_name: &str,
        config: Arc<rustls::ClientConfig>,
    ) -> Result<Peer, RpcError> {
        let name = rustls::pki_types::ServerName::try_from(server_name.to_owned())
            .map_err(|e| RpcError::disconnected(format!("bad TLS server name: {e}")))?;
        let timeout = self.config_ref().handshake_timeout;
        let tls = tokio::time::timeout(timeout, async {
            let tcp = crate::net::connect_tcp(addr, self.config_ref().tcp_send_buffer).await?;
            TlsConnector::from(config)
                .connect(name, crate::net::Eager::new(tcp))
                .await
        })
        .await
        .map_err(|_| RpcError::disconnected("TLS connect timed out"))??;
        self.connect(tls).await
    }

    /// Accepts one TLS connection on an accepted TCP stream. The connection takes its place
    /// under `max_connections` after the TLS handshake: a loop of the caller's own must
    /// bound how many wait in one (as [`serve_tls`](Self::serve_tls) does).
    pub async fn accept_tls(
        &self,
        tcp: TcpStream,
        config: Arc<rustls::ServerConfig>,
    ) -> Result<Peer, RpcError> {
        let tls = self.tls_accept(tcp, config).await?;
        self.accept(tls).await
    }

    async fn tls_accept(
        &self,
        tcp: TcpStream,
        config: Arc<rustls::ServerConfig>,
    ) -> Result<tokio_rustls::server::TlsStream<crate::net::Eager<TcpStream>>, RpcError> {
        let _ = tcp.set_nodelay(true);
        if let Ok(peer) = tcp.peer_addr() {
            crate::net::set_send_buffer(&tcp, peer, self.config_ref().tcp_send_buffer);
        }
        let timeout = self.config_ref().handshake_timeout;
        let tcp = crate::net::Eager::new(tcp);
        Ok(
            tokio::time::timeout(timeout, TlsAcceptor::from(config).accept(tcp))
                .await
                .map_err(|_| RpcError::protocol("TLS handshake timed out"))??,
        )
    }

    /// Accepts TLS connections until the listener fails, each on its own task.
    pub async fn serve_tls(
        &self,
        listener: TcpListener,
        config: Arc<rustls::ServerConfig>,
    ) -> Result<(), RpcError> {
        let mut backoff = crate::endpoint::AcceptBackoff::default();
        let permits = self
            .max_in_handshake()
            .min(tokio::sync::Semaphore::MAX_PERMITS);
        let in_handshake = Arc::new(tokio::sync::Semaphore::new(permits));
        loop {
            let (tcp, _) = match listener.accept().await {
                Ok(s) => {
                    backoff.succeeded();
                    s
                }
                Err(e) => {
                    self.accept_failed(&mut backoff, e).await?;
                    continue;
                }
            };
            // A place among those in a TLS handshake first: one over the bound costs no
            // handshake, and those waiting in one (each for `handshake_timeout` at most) are
            // bounded, by fewer than `max_connections`, so that clients that have not shown
            // a certificate yet cannot take the places kept for the tiers. The connection
            // takes its real place after the handshake, as any other. Closed at once when
            // refused: there is no channel yet to say why over.
            let Ok(handshaking) = in_handshake.clone().try_acquire_owned() else {
                self.count_refused();
                tracing::debug!("a TLS connection over the bound of handshakes: closed");
                continue;
            };
            let this = self.clone();
            let config = config.clone();
            tokio::spawn(async move {
                let served = async {
                    let tls = this.tls_accept(tcp, config).await;
                    drop(handshaking);
                    this.serve_accepted(tls?).await
                };
                if let Err(e) = served.await {
                    tracing::debug!(%e, "TLS connection failed");
                }
            });
        }
    }
}
