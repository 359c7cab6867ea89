//! TLS for the connections to PostgreSQL (feature `tls`): the pool's, the notifier's
//! listener, the change feed's SQL connection and its replication stream all use the one
//! [`Tls`] a [`Database`](super::Database) was opened with.
//!
//! Without a TLS configuration ([`PostgresOptions::tls`](super::PostgresOptions::tls)) the
//! connections are plain, whatever the server offers (`sslmode=prefer`, the default,
//! becomes `disable`); a URL that asks for `sslmode=require` then fails to open, with a
//! reason, rather than sending anything in the clear. With one, a server that speaks TLS
//! must show a certificate that the configuration's roots vouch for, for the URL's host
//! name (what libpq calls `verify-full`, which tokio-postgres's URLs do not take: write
//! `require`); `require` also refuses a server that does not speak TLS, `prefer` goes on in
//! the clear with it (so a man in the middle can choose plain: use `require`).
//!
//! The replication stream, which this crate speaks by hand, authenticates with SCRAM
//! without channel binding (the certificate check is what ties it to the server), and
//! does the `SSLRequest` of PostgreSQL's own negotiation: with `channel_binding=require`
//! or `sslnegotiation=direct` in the URL, a change feed reads its slot with SQL instead,
//! on connections that honour them.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::config::SslMode;
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};
use tokio_postgres::Socket;

use crate::error::{CommandError, ErrorKind};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How the ops crate's connections to one database speak TLS.
#[derive(Clone)]
pub(crate) enum Tls {
    /// Plain connections.
    Plain,
    /// rustls, with the application's client configuration: the connector of the
    /// connections tokio-postgres makes, and of the stream made here.
    #[cfg(feature = "tls")]
    Rustls(tokio_postgres_rustls::MakeRustlsConnect),
}

impl Tls {
    /// TLS with `config` (its roots, its client certificate if any).
    #[cfg(feature = "tls")]
    pub(crate) fn rustls(config: tokio_rustls::rustls::ClientConfig) -> Self {
        Tls::Rustls(tokio_postgres_rustls::MakeRustlsConnect::new(config))
    }

    /// Checks `config`'s `sslmode` against this: a plain setup turns `prefer` into
    /// `disable`, and refuses `require`.
    pub(crate) fn settle(&self, config: &mut tokio_postgres::Config) -> Result<(), CommandError> {
        match self {
            Tls::Plain => match config.get_ssl_mode() {
                SslMode::Require => Err(CommandError::new(
                    ErrorKind::Database,
                    "the URL asks for sslmode=require, and no TLS configuration was given \
                     (PostgresOptions::tls, feature `tls`)",
                )),
                _ => {
                    config.ssl_mode(SslMode::Disable);
                    Ok(())
                }
            },
            #[cfg(feature = "tls")]
            Tls::Rustls(_) => Ok(()),
        }
    }

    /// Opens `stream`'s TLS session, for a connection this crate speaks by hand (the change
    /// feed's replication stream), as [`tokio_postgres`] does for the others: an
    /// `SSLRequest`, then the handshake if the server agrees. `Ok(Err(stream))` when the
    /// connection is to stay plain.
    #[cfg(feature = "tls")]
    pub(crate) async fn open(
        &self,
        mut stream: tokio::net::TcpStream,
        mode: SslMode,
        host: &str,
    ) -> io::Result<
        Result<
            <tokio_postgres_rustls::MakeRustlsConnect as MakeTlsConnect<tokio::net::TcpStream>>::Stream,
            tokio::net::TcpStream,
        >,
    >{
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let Tls::Rustls(make) = self else {
            return Ok(Err(stream));
        };
        if mode == SslMode::Disable {
            return Ok(Err(stream));
        }
        let mut request = bytes::BytesMut::new();
        postgres_protocol::message::frontend::ssl_request(&mut request);
        stream.write_all(&request).await?;
        let mut answer = [0u8];
        stream.read_exact(&mut answer).await?;
        if answer[0] != b'S' {
            if mode == SslMode::Require {
                return Err(io::Error::other(
                    "the server does not speak TLS (sslmode=require)",
                ));
            }
            return Ok(Err(stream));
        }
        let connect = match MakeTlsConnect::<tokio::net::TcpStream>::make_tls_connect(
            &mut make.clone(),
            host,
        ) {
            Ok(connect) => connect,
            Err(never) => match never {},
        };
        Ok(Ok(connect.connect(stream).await?))
    }
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tls::Plain => f.write_str("Plain"),
            #[cfg(feature = "tls")]
            Tls::Rustls(_) => f.write_str("Rustls"),
        }
    }
}

impl MakeTlsConnect<Socket> for Tls {
    type Stream = TlsStream;
    type TlsConnect = Connect;
    type Error = BoxError;

    fn make_tls_connect(&mut self, domain: &str) -> Result<Connect, BoxError> {
        #[cfg(not(feature = "tls"))]
        let _ = domain;
        match self {
            Tls::Plain => Ok(Connect::Plain),
            #[cfg(feature = "tls")]
            Tls::Rustls(make) => match MakeTlsConnect::<Socket>::make_tls_connect(make, domain) {
                Ok(connect) => Ok(Connect::Rustls(connect)),
                Err(never) => match never {},
            },
        }
    }
}

#[cfg(feature = "tls")]
type RustlsConnect =
    <tokio_postgres_rustls::MakeRustlsConnect as MakeTlsConnect<Socket>>::TlsConnect;
#[cfg(feature = "tls")]
type RustlsStream = <tokio_postgres_rustls::MakeRustlsConnect as MakeTlsConnect<Socket>>::Stream;

/// One connection's TLS handshake, as [`Tls`] makes it.
pub(crate) enum Connect {
    Plain,
    #[cfg(feature = "tls")]
    Rustls(RustlsConnect),
}

impl TlsConnect<Socket> for Connect {
    type Stream = TlsStream;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<TlsStream, BoxError>> + Send>>;

    fn connect(self, stream: Socket) -> Self::Future {
        #[cfg(not(feature = "tls"))]
        let _ = stream;
        match self {
            // `Tls::settle` turned `prefer` into `disable`: never asked.
            Connect::Plain => Box::pin(async { Err("no TLS configuration".into()) }),
            #[cfg(feature = "tls")]
            Connect::Rustls(connect) => {
                Box::pin(
                    async move { Ok(TlsStream::Rustls(Box::new(connect.connect(stream).await?))) },
                )
            }
        }
    }
}

/// A connection's TLS session.
pub(crate) enum TlsStream {
    #[cfg(feature = "tls")]
    Rustls(Box<RustlsStream>),
}

impl tokio_postgres::tls::TlsStream for TlsStream {
    fn channel_binding(&self) -> ChannelBinding {
        match *self {
            #[cfg(feature = "tls")]
            TlsStream::Rustls(ref s) => s.channel_binding(),
        }
    }
}

impl AsyncRead for TlsStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        #[cfg(not(feature = "tls"))]
        let _ = (cx, buf);
        match *self.get_mut() {
            #[cfg(feature = "tls")]
            TlsStream::Rustls(ref mut s) => Pin::new(&mut **s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for TlsStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        #[cfg(not(feature = "tls"))]
        let _ = (cx, buf);
        match *self.get_mut() {
            #[cfg(feature = "tls")]
            TlsStream::Rustls(ref mut s) => Pin::new(&mut **s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        #[cfg(not(feature = "tls"))]
        let _ = cx;
        match *self.get_mut() {
            #[cfg(feature = "tls")]
            TlsStream::Rustls(ref mut s) => Pin::new(&mut **s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        #[cfg(not(feature = "tls"))]
        let _ = cx;
        match *self.get_mut() {
            #[cfg(feature = "tls")]
            TlsStream::Rustls(ref mut s) => Pin::new(&mut **s).poll_shutdown(cx),
        }
    }
}
