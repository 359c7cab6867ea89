//! Real transports: TCP on a loopback port and Unix domain sockets.

use coherent_rpc::Config;
use tokio::net::TcpListener;

use crate::support::*;

#[tokio::test]
async fn calls_work_over_tcp_and_the_server_serves_many_connections() {
    let (server, _) = calc_server(Config::default());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { server.serve_tcp(listener).await });
    let client = coherent_rpc::Endpoint::builder().build();
    let mut clients = Vec::new();
    for i in 0..3 {
        let calc = CalcClient::new(client.connect_tcp(addr).await.unwrap());
        assert_eq!(calc.sum(i, 1).await.unwrap(), i + 1);
        clients.push(calc);
    }
    let data = vec![9u8; 1 << 20];
    assert_eq!(clients[1].echo(data.clone()).await.unwrap(), data);
}

#[cfg(unix)]
#[tokio::test]
async fn calls_work_over_a_unix_socket() {
    let dir = std::env::temp_dir().join(format!("coherent-rpc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("calc.sock");
    let _ = std::fs::remove_file(&path);
    let (server, _) = calc_server(Config::default());
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    tokio::spawn(async move { server.serve_unix(listener).await });
    let peer = coherent_rpc::Endpoint::builder()
        .build()
        .connect_unix(&path)
        .await
        .unwrap();
    assert_eq!(CalcClient::new(peer).sum(20, 22).await.unwrap(), 42);
    let _ = std::fs::remove_file(&path);
}

#[tokio::test]
async fn calls_work_over_two_one_way_pipes_joined_like_a_child_processes_stdio() {
    // A child's stdout is what we read, its stdin what we write: two one-way pipes.
    // `simplex` returns (read end, write end).
    let (server_in, client_out) = tokio::io::simplex(64 * 1024);
    let (client_in, server_out) = tokio::io::simplex(64 * 1024);
    let (server, _) = calc_server(Config::default());
    let accepted =
        tokio::spawn(async move { server.accept(tokio::io::join(server_in, server_out)).await });
    let peer = coherent_rpc::Endpoint::builder()
        .build()
        .connect(tokio::io::join(client_in, client_out))
        .await
        .unwrap();
    let _server_side = accepted.await.unwrap().unwrap();
    assert_eq!(CalcClient::new(peer).sum(2, 2).await.unwrap(), 4);
}
