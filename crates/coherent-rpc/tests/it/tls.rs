//! TLS over TCP with rustls: server certificates, and client certificates when required.

use std::sync::Arc;

use coherent_rpc::tls::rustls::{
    self,
    pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer},
    server::WebPkiClientVerifier,
    ClientConfig, RootCertStore, ServerConfig,
};
use coherent_rpc::{Config, Endpoint, ErrorCode};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use tokio::net::TcpListener;

use crate::support::*;

struct Pki {
    ca: CertificateDer<'static>,
    server: (CertificateDer<'static>, PrivateKeyDer<'static>),
    client: (CertificateDer<'static>, PrivateKeyDer<'static>),
}

fn pki() -> Pki {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::from_params(&ca_params, &ca_key);
    let leaf = |name: &str| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec![name.to_owned()])
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        (
            cert.der().clone(),
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
    };
    Pki {
        server: leaf("localhost"),
        client: leaf("client"),
        ca: ca.der().clone(),
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(pki: &Pki) -> Arc<RootCertStore> {
    let mut roots = RootCertStore::empty();
    roots.add(pki.ca.clone()).unwrap();
    Arc::new(roots)
}

async fn serve(config: ServerConfig) -> std::net::SocketAddr {
    let (server, _) = calc_server(Config::default());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { server.serve_tls(listener, Arc::new(config)).await });
    addr
}

#[tokio::test]
async fn calls_work_over_tls_with_a_server_certificate() {
    let pki = pki();
    let server = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![pki.server.0.clone()], pki.server.1.clone_key())
        .unwrap();
    let addr = serve(server).await;
    let client = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots(&pki))
        .with_no_client_auth();
    let peer = Endpoint::builder()
        .build()
        .connect_tls(addr, "localhost", Arc::new(client))
        .await
        .unwrap();
    let calc = CalcClient::new(peer);
    assert_eq!(calc.sum(40, 2).await.unwrap(), 42);
    let data = vec![3u8; 300_000];
    assert_eq!(calc.echo(data.clone()).await.unwrap(), data);
}

#[tokio::test]
async fn a_server_that_requires_client_certificates_refuses_a_client_without_one() {
    let pki = pki();
    let verifier = WebPkiClientVerifier::builder_with_provider(roots(&pki), provider())
        .build()
        .unwrap();
    let server = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![pki.server.0.clone()], pki.server.1.clone_key())
        .unwrap();
    let addr = serve(server).await;
    let builder = || {
        ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots(&pki))
    };
    let with_cert = builder()
        .with_client_auth_cert(vec![pki.client.0.clone()], pki.client.1.clone_key())
        .unwrap();
    let peer = Endpoint::builder()
        .build()
        .connect_tls(addr, "localhost", Arc::new(with_cert))
        .await
        .unwrap();
    assert_eq!(CalcClient::new(peer).sum(1, 2).await.unwrap(), 3);

    let without = builder().with_no_client_auth();
    let err = Endpoint::builder()
        .build()
        .connect_tls(addr, "localhost", Arc::new(without))
        .await
        .unwrap_err();
    // TLS 1.3 reports the refusal after the client's side of the TLS handshake, when
    // it reads: the RPC handshake then fails as a disconnect.
    assert_eq!(err.code(), ErrorCode::Disconnected, "{err}");
}

/// Connections waiting in the TLS handshake are bounded (by as many as untrusted clients
/// may hold: here both places), and one more is closed before any handshake: a flood of
/// TCP connections that never say hello costs no more than that, and a place given back
/// serves the next client.
#[tokio::test]
async fn connections_waiting_in_the_tls_handshake_are_bounded_and_the_rest_are_closed() {
    use tokio::io::AsyncReadExt;
    let pki = pki();
    let server_config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![pki.server.0.clone()], pki.server.1.clone_key())
        .unwrap();
    // Silent connections would wait an hour in the handshake: only their place can end
    // them here.
    let (server, _) = calc_server(
        Config::default()
            .max_connections(2)
            .handshake_timeout(std::time::Duration::from_secs(3600)),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn({
        let server = server.clone();
        let config = Arc::new(server_config);
        async move { server.serve_tls(listener, config).await }
    });
    // Two that never say hello take the two places.
    let mut silent = Vec::new();
    for _ in 0..2 {
        silent.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    let deadline = std::time::Duration::from_secs(30);
    // Twenty more (accepted after them, in the order they connected) are closed at once,
    // unread.
    for _ in 0..20 {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut buf = [0u8; 16];
        let n = within(deadline, s.read(&mut buf)).await.unwrap_or(0);
        assert_eq!(n, 0);
    }
    assert!(server.stats().connections_refused >= 20);
    // A place given back serves a client.
    drop(silent.pop());
    let client = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots(&pki))
        .with_no_client_auth();
    let peer = within(deadline, async {
        loop {
            match Endpoint::builder()
                .build()
                .connect_tls(addr, "localhost", Arc::new(client.clone()))
                .await
            {
                Ok(peer) => break peer,
                // The place is given back when the server sees the close.
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(10)).await,
            }
        }
    })
    .await;
    assert_eq!(CalcClient::new(peer).sum(1, 2).await.unwrap(), 3);
}

/// `f`, or a panic past `limit` (a liveness guard, not a measurement).
async fn within<T>(limit: std::time::Duration, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(limit, f)
        .await
        .expect("did not happen within the deadline")
}
