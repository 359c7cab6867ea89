//! The streaming replication protocol, as much of it as the change feed needs: a connection
//! in `replication=database` mode, `START_REPLICATION SLOT … LOGICAL`, the stream of
//! `XLogData` and keepalive messages it answers with, and the standby status updates that
//! confirm how far the feed has applied (the server moves the slot to the confirmed
//! position).
//!
//! tokio-postgres (0.7) has no copy-both mode, which the stream needs, so the connection is
//! made here, on `postgres-protocol`'s message writers and its password and SCRAM-SHA-256
//! code; the few backend messages the stream uses are read here. With TLS as the
//! database's other connections (`SSLRequest`, then rustls: see `db::tls`).

use std::io;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use postgres_protocol::authentication::{md5_hash, sasl};
use postgres_protocol::message::frontend;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The largest message the stream accepts: PostgreSQL's own bound on one allocation (1 GiB),
/// which bounds a row's values, and a little for the message's headers.
pub(super) const MAX_MESSAGE: usize = (1 << 30) + 4096;

/// The largest message of another kind (errors, notices, authentication, rows of the
/// identity query).
const MAX_OTHER: usize = 1 << 20;

/// An input buffer grown past this by a large message is given back once it is empty.
const SHRINK_ABOVE: usize = 1 << 20;

/// Why the stream failed.
#[derive(Debug)]
pub(super) enum StreamError {
    /// The server answered an error: its SQLSTATE and message.
    Server { code: String, message: String },
    /// The connection failed or the server broke the protocol.
    Io(io::Error),
    /// No host of the configuration is the server of the feed's SQL connection.
    Elsewhere(String),
    /// The configuration asks for what this connection does not do (channel binding
    /// required, direct TLS negotiation): a feed reads its slot through SQL instead, on
    /// connections that do it.
    Unsupported(String),
}

impl StreamError {
    fn protocol(what: impl Into<String>) -> Self {
        Self::Io(io::Error::new(io::ErrorKind::InvalidData, what.into()))
    }

    /// The server refused the connection itself (`pg_hba.conf` refuses it, the role may
    /// not replicate, every WAL sender is taken), or
    /// the configuration leads it to another server: a feed can still read its slot
    /// through SQL.
    pub(super) fn refused_connection(&self) -> bool {
        match self {
            Self::Server { code, .. } => {
                code == "28000" || code == "28P01" || code == "42501" || self.passing()
            }
            Self::Elsewhere(_) | Self::Unsupported(_) => true,
            Self::Io(_) => false,
        }
    }

    /// A refusal that may pass (every WAL sender taken): streaming is tried again later.
    pub(super) fn passing(&self) -> bool {
        matches!(self, Self::Server { code, .. } if code == "53300")
    }

    /// The slot is held by another connection (`55006`): an earlier leader's, whose
    /// connection the server has not noticed is gone.
    pub(super) fn slot_in_use(&self) -> bool {
        matches!(self, Self::Server { code, .. } if code == "55006")
    }
}

impl std::fmt::Display for StreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Server { code, message } => write!(f, "{message} (SQLSTATE {code})"),
            Self::Io(e) => write!(f, "{e}"),
            Self::Elsewhere(why) => write!(
                f,
                "the replication connection reached another server: {why}"
            ),
            Self::Unsupported(why) => write!(f, "the replication connection: {why}"),
        }
    }
}

impl From<io::Error> for StreamError {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

/// What the stream carries.
#[derive(Debug)]
pub(super) enum Frame {
    /// A message of the output plugin.
    Data { data: Bytes },
    /// The server's position (everything before it was sent), and whether it wants an
    /// answer now.
    Keepalive { end: u64, reply: bool },
}

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// A replication connection.
pub(super) struct Stream {
    io: Box<dyn Io>,
    input: BytesMut,
    output: BytesMut,
    /// The server process of the connection (`BackendKeyData`).
    pid: Option<i32>,
}

/// Opens a replication connection to the server `identity` describes (what
/// [`IDENTITY`] answers on the feed's SQL connection): `config`'s hosts (or `hostaddr`s)
/// are tried in turn, with its user, password, database and options, under
/// `application`; a server that answers another identity (a standby, another host of a
/// multi-host URL) is passed over. TCP keepalives and `TCP_USER_TIMEOUT` as on the SQL
/// connection: a server gone silent fails the stream in seconds.
pub(super) async fn connect(
    config: &tokio_postgres::Config,
    tls: &crate::db::tls::Tls,
    application: &str,
    identity: &str,
) -> Result<Stream, StreamError> {
    use tokio_postgres::config::{ChannelBinding, SslNegotiation};
    if config.get_channel_binding() == ChannelBinding::Require {
        return Err(StreamError::Unsupported(
            "channel_binding=require, and its SCRAM has no channel binding".to_owned(),
        ));
    }
    if config.get_ssl_negotiation() == SslNegotiation::Direct {
        return Err(StreamError::Unsupported(
            "sslnegotiation=direct, and it negotiates TLS with an SSLRequest".to_owned(),
        ));
    }
    let ports = config.get_ports();
    let (hosts, addresses) = (config.get_hosts(), config.get_hostaddrs());
    let timeout = config
        .get_connect_timeout()
        .copied()
        .unwrap_or(Duration::from_secs(10));
    let mut last = None;
    for i in 0..hosts.len().max(addresses.len()) {
        let port = ports
            .get(i)
            .or_else(|| ports.first())
            .copied()
            .unwrap_or(5432);
        // The name a certificate must carry: the host's, else the address's.
        let name = match (hosts.get(i), addresses.get(i)) {
            (Some(tokio_postgres::config::Host::Tcp(name)), _) => name.clone(),
            (_, Some(address)) => address.to_string(),
            _ => String::new(),
        };
        let opened = async {
            let tcp = match (addresses.get(i), hosts.get(i)) {
                (Some(address), _) => tokio::net::TcpStream::connect((*address, port)).await?,
                (None, Some(tokio_postgres::config::Host::Tcp(name))) => {
                    tokio::net::TcpStream::connect((name.as_str(), port)).await?
                }
                #[cfg(unix)]
                (None, Some(tokio_postgres::config::Host::Unix(dir))) => {
                    let path = dir.join(format!(".s.PGSQL.{port}"));
                    let socket = tokio::net::UnixStream::connect(path).await?;
                    return Ok(Box::new(socket) as Box<dyn Io>);
                }
                (None, None) => unreachable!("i is below the longer list"),
            };
            let _ = tcp.set_nodelay(true);
            let keepalive = socket2::TcpKeepalive::new()
                .with_time(Duration::from_secs(5))
                .with_interval(Duration::from_secs(2))
                .with_retries(3);
            let socket = socket2::SockRef::from(&tcp);
            let _ = socket.set_tcp_keepalive(&keepalive);
            #[cfg(any(target_os = "linux", target_os = "android"))]
            let _ = socket.set_tcp_user_timeout(Some(Duration::from_secs(10)));
            #[cfg(feature = "tls")]
            match tls.open(tcp, config.get_ssl_mode(), &name).await? {
                Ok(tls) => Ok::<_, io::Error>(Box::new(tls) as Box<dyn Io>),
                Err(tcp) => Ok(Box::new(tcp) as Box<dyn Io>),
            }
            #[cfg(not(feature = "tls"))]
            {
                let _ = (tls, &name);
                Ok::<_, io::Error>(Box::new(tcp) as Box<dyn Io>)
            }
        };
        let io = match tokio::time::timeout(timeout, opened).await {
            Ok(Ok(io)) => io,
            Ok(Err(e)) => {
                last = Some(StreamError::Io(e));
                continue;
            }
            Err(_) => {
                last = Some(StreamError::Io(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "connect timed out",
                )));
                continue;
            }
        };
        let mut stream = Stream {
            io,
            input: BytesMut::with_capacity(8192),
            output: BytesMut::with_capacity(1024),
            pid: None,
        };
        let started = async {
            stream.startup(config, application).await?;
            stream.query_one(IDENTITY).await
        };
        match tokio::time::timeout(timeout, started).await {
            Ok(Ok(Some(answer))) if answer == identity => return Ok(stream),
            Ok(Ok(answer)) => {
                last = Some(StreamError::Elsewhere(format!(
                    "host {} answers {answer:?}, the feed's connection {identity:?}",
                    i + 1
                )))
            }
            Ok(Err(e)) => last = Some(e),
            Err(_) => {
                last = Some(StreamError::Io(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the replication connection's start timed out",
                )))
            }
        }
    }
    Err(last.unwrap_or_else(|| {
        StreamError::Io(io::Error::new(
            io::ErrorKind::InvalidInput,
            "no host to connect to",
        ))
    }))
}

/// What tells one server from another, asked on both connections: when the postmaster
/// started (a standby of the same cluster started at another moment) and whether it is in
/// recovery.
pub(super) const IDENTITY: &str =
    "SELECT pg_postmaster_start_time()::text || ' ' || pg_is_in_recovery()::text";

/// A backend message: its tag and body.
struct Message {
    tag: u8,
    body: Bytes,
}

/// An `ErrorResponse`'s SQLSTATE and message.
fn server_error(mut body: &[u8]) -> StreamError {
    let (mut code, mut message) = (String::new(), String::new());
    while let Some((&kind, rest)) = body.split_first() {
        if kind == 0 {
            break;
        }
        let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
        let value = String::from_utf8_lossy(&rest[..end]).into_owned();
        match kind {
            b'C' => code = value,
            b'M' => message = value,
            _ => {}
        }
        body = rest.get(end + 1..).unwrap_or_default();
    }
    StreamError::Server { code, message }
}

impl Stream {
    async fn send(&mut self) -> io::Result<()> {
        self.io.write_all(&self.output).await?;
        self.output.clear();
        self.io.flush().await
    }

    /// The next whole message in the input, if there is one.
    fn parse(&mut self) -> Result<Option<Message>, StreamError> {
        let Some(len) = self.header()? else {
            return Ok(None);
        };
        if self.input.len() < len + 1 {
            return Ok(None);
        }
        let tag = self.input[0];
        let mut frame = self.input.split_to(len + 1);
        frame.advance(5);
        if self.input.is_empty() && self.input.capacity() > SHRINK_ABOVE {
            // After a large message: back to a small buffer.
            self.input = BytesMut::with_capacity(8192);
        }
        Ok(Some(Message {
            tag,
            body: frame.freeze(),
        }))
    }

    /// The length of the message at the front of the input (without its tag), once its
    /// header is in, checked against the cap of its kind.
    fn header(&self) -> Result<Option<usize>, StreamError> {
        if self.input.len() < 5 {
            return Ok(None);
        }
        let tag = self.input[0];
        let len = u32::from_be_bytes([self.input[1], self.input[2], self.input[3], self.input[4]])
            as usize;
        let cap = if tag == b'd' { MAX_MESSAGE } else { MAX_OTHER };
        if !(4..=cap).contains(&len) {
            return Err(StreamError::protocol(format!(
                "a message {:?} of {len} bytes (at most {cap})",
                tag as char
            )));
        }
        Ok(Some(len))
    }

    async fn read_message(&mut self) -> Result<Message, StreamError> {
        loop {
            if let Some(message) = self.parse()? {
                return Ok(message);
            }
            // The buffer grows with what arrives, a chunk at a time (a length announced
            // is not allocated before its bytes come).
            if self.input.capacity() - self.input.len() < 4096 {
                self.input.reserve(64 * 1024);
            }
            if self.io.read_buf(&mut self.input).await? == 0 {
                return Err(StreamError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the server closed the replication connection",
                )));
            }
        }
    }

    /// The server process of the connection.
    pub(super) fn pid(&self) -> Option<i32> {
        self.pid
    }

    /// Runs `sql` (simple query protocol) and answers the first column of its first row.
    async fn query_one(&mut self, sql: &str) -> Result<Option<String>, StreamError> {
        frontend::query(sql, &mut self.output)?;
        self.send().await?;
        let mut answer = None;
        loop {
            let message = self.read_message().await?;
            let mut body = message.body;
            match message.tag {
                b'D' if answer.is_none() && body.len() >= 6 => {
                    let _columns = body.get_i16();
                    let len = body.get_i32();
                    if len >= 0 && body.len() >= len as usize {
                        answer = Some(String::from_utf8_lossy(&body[..len as usize]).into_owned());
                    }
                }
                b'E' => {
                    let e = server_error(&body);
                    // The rest of the answer, up to ReadyForQuery.
                    while self.read_message().await?.tag != b'Z' {}
                    return Err(e);
                }
                b'Z' => return Ok(answer),
                _ => {}
            }
        }
    }

    async fn startup(
        &mut self,
        config: &tokio_postgres::Config,
        application: &str,
    ) -> Result<(), StreamError> {
        let user = config
            .get_user()
            .ok_or_else(|| StreamError::protocol("the configuration names no user"))?
            .to_owned();
        let mut parameters = vec![
            ("user", user.clone()),
            ("database", config.get_dbname().unwrap_or(&user).to_owned()),
            ("replication", "database".to_owned()),
            ("application_name", application.to_owned()),
            ("client_encoding", "UTF8".to_owned()),
        ];
        if let Some(options) = config.get_options() {
            parameters.push(("options", options.to_owned()));
        }
        frontend::startup_message(
            parameters.iter().map(|(k, v)| (*k, v.as_str())),
            &mut self.output,
        )?;
        self.send().await?;
        let password = config.get_password().map(<[u8]>::to_vec);
        let needs_password = || {
            password.clone().ok_or_else(|| StreamError::Server {
                code: "28P01".to_owned(),
                message: "the server asks for a password and the configuration has none".to_owned(),
            })
        };
        let mut scram: Option<sasl::ScramSha256> = None;
        loop {
            let message = self.read_message().await?;
            let mut body = message.body.clone();
            match message.tag {
                b'R' => {
                    if body.len() < 4 {
                        return Err(StreamError::protocol("a short authentication message"));
                    }
                    match body.get_i32() {
                        0 => {}
                        3 => {
                            frontend::password_message(&needs_password()?, &mut self.output)?;
                            self.send().await?;
                        }
                        5 => {
                            if body.len() < 4 {
                                return Err(StreamError::protocol("an MD5 request without salt"));
                            }
                            let salt = [body[0], body[1], body[2], body[3]];
                            let hash = md5_hash(user.as_bytes(), &needs_password()?, salt);
                            frontend::password_message(hash.as_bytes(), &mut self.output)?;
                            self.send().await?;
                        }
                        10 => {
                            let offers_scram = body
                                .split(|&b| b == 0)
                                .any(|m| m == sasl::SCRAM_SHA_256.as_bytes());
                            if !offers_scram {
                                return Err(StreamError::protocol(
                                    "the server offers no SASL mechanism but SCRAM-SHA-256-PLUS \
                                     (channel binding, which the feed's replication stream \
                                     does not do)",
                                ));
                            }
                            let state = sasl::ScramSha256::new(
                                &needs_password()?,
                                sasl::ChannelBinding::unsupported(),
                            );
                            frontend::sasl_initial_response(
                                sasl::SCRAM_SHA_256,
                                state.message(),
                                &mut self.output,
                            )?;
                            self.send().await?;
                            scram = Some(state);
                        }
                        11 => {
                            let state = scram.as_mut().ok_or_else(|| {
                                StreamError::protocol("a SASL continuation without a start")
                            })?;
                            state.update(&body)?;
                            frontend::sasl_response(state.message(), &mut self.output)?;
                            self.send().await?;
                        }
                        12 => {
                            let mut state = scram.take().ok_or_else(|| {
                                StreamError::protocol("a SASL final message without a start")
                            })?;
                            state.finish(&body)?;
                        }
                        other => {
                            return Err(StreamError::protocol(format!(
                                "authentication method {other} is not supported by the \
                                 change feed's replication connection"
                            )))
                        }
                    }
                }
                b'E' => return Err(server_error(&body)),
                b'Z' => return Ok(()),
                b'K' if body.len() >= 8 => self.pid = Some(body.get_i32()),
                // Parameter status, notices.
                _ => {}
            }
        }
    }

    /// Starts streaming `slot` from where it was confirmed, with pgoutput's protocol
    /// version 1 over `publication`.
    pub(super) async fn start(&mut self, slot: &str, publication: &str) -> Result<(), StreamError> {
        let quote = |s: &str| s.replace('\'', "''");
        let command = format!(
            "START_REPLICATION SLOT \"{}\" LOGICAL 0/0 (\"proto_version\" '1', \
             \"publication_names\" '{}')",
            slot.replace('"', "\"\""),
            quote(publication)
        );
        frontend::query(&command, &mut self.output)?;
        self.send().await?;
        loop {
            let message = self.read_message().await?;
            match message.tag {
                b'W' => return Ok(()),
                b'E' => return Err(server_error(&message.body)),
                b'N' | b'S' => {}
                other => {
                    return Err(StreamError::protocol(format!(
                        "message {:?} in answer to START_REPLICATION",
                        other as char
                    )))
                }
            }
        }
    }

    /// Whether a whole message waits in the input (the next `next` answers without
    /// waiting for the network).
    pub(super) fn has_buffered(&self) -> bool {
        matches!(self.header(), Ok(Some(len)) if self.input.len() > len)
    }

    /// The next frame of the stream. Cancel-safe: what was read stays in the input.
    pub(super) async fn next(&mut self) -> Result<Frame, StreamError> {
        loop {
            let message = self.read_message().await?;
            let mut body = message.body;
            match message.tag {
                b'd' => match body.first() {
                    Some(b'w') if body.len() >= 25 => {
                        body.advance(1);
                        // Where the WAL of the message starts and ends, when it was sent.
                        body.advance(24);
                        return Ok(Frame::Data { data: body });
                    }
                    Some(b'k') if body.len() >= 18 => {
                        body.advance(1);
                        let end = body.get_u64();
                        let _sent_at = body.get_i64();
                        let reply = body.get_u8() != 0;
                        return Ok(Frame::Keepalive { end, reply });
                    }
                    _ => {
                        return Err(StreamError::protocol(format!(
                            "a replication message of {} bytes starting {:?}",
                            body.len(),
                            body.first().map(|&b| b as char)
                        )))
                    }
                },
                b'E' => return Err(server_error(&body)),
                b'c' => {
                    return Err(StreamError::protocol(
                        "the server ended the replication stream",
                    ))
                }
                // Notices, parameter status.
                _ => {}
            }
        }
    }

    /// Tells the server that everything before `lsn` is applied (the slot may move
    /// there).
    pub(super) async fn confirm(&mut self, lsn: u64) -> Result<(), StreamError> {
        let mut update = BytesMut::with_capacity(34);
        update.put_u8(b'r');
        update.put_u64(lsn); // written
        update.put_u64(lsn); // flushed
        update.put_u64(lsn); // applied
        update.put_i64(postgres_clock());
        update.put_u8(0);
        frontend::CopyData::new(update.freeze())?.write(&mut self.output);
        self.send().await?;
        Ok(())
    }
}

/// Microseconds since 2000-01-01, PostgreSQL's epoch.
fn postgres_clock() -> i64 {
    const EPOCH_2000: u64 = 946_684_800;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    (now.as_micros() as i64).saturating_sub((EPOCH_2000 * 1_000_000) as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream over `bytes` as the server's side.
    fn stream_of(bytes: &[u8]) -> Stream {
        let (ours, mut theirs) = tokio::io::duplex(1 << 16);
        let bytes = bytes.to_vec();
        tokio::spawn(async move {
            let _ = theirs.write_all(&bytes).await;
            // Held open: what follows is "nothing more yet", not the end.
            std::future::pending::<()>().await;
        });
        Stream {
            io: Box::new(ours),
            input: BytesMut::new(),
            output: BytesMut::new(),
            pid: None,
        }
    }

    fn message(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut m = vec![tag];
        m.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
        m.extend_from_slice(body);
        m
    }

    #[tokio::test]
    async fn frames_decode_and_hostile_ones_fail_with_a_reason() {
        let mut data = vec![b'w'];
        data.extend_from_slice(&[0; 24]);
        data.extend_from_slice(b"B...");
        let mut keepalive = vec![b'k'];
        keepalive.extend_from_slice(&7u64.to_be_bytes());
        keepalive.extend_from_slice(&[0; 8]);
        keepalive.push(1);
        let mut bytes = message(b'N', b"SNOTICE\0\0");
        bytes.extend(message(b'd', &data));
        bytes.extend(message(b'd', &keepalive));
        let mut stream = stream_of(&bytes);
        match stream.next().await.unwrap() {
            Frame::Data { data } => assert_eq!(&data[..], b"B..."),
            other => panic!("{other:?}"),
        }
        assert!(stream.has_buffered());
        match stream.next().await.unwrap() {
            Frame::Keepalive { end, reply } => assert_eq!((end, reply), (7, true)),
            other => panic!("{other:?}"),
        }
        assert!(!stream.has_buffered());

        let cases: Vec<(Vec<u8>, &str)> = vec![
            (message(b'd', b"k12"), "a replication message of 3 bytes"),
            (message(b'd', b""), "a replication message of 0 bytes"),
            (vec![b'd', 0, 0, 0, 3], "a message 'd' of 3 bytes"),
            (
                vec![b'd', 0x7f, 0xff, 0xff, 0xff],
                "a message 'd' of 2147483647 bytes",
            ),
            (vec![b'E', 0, 0x20, 0, 0], "a message 'E' of 2097152 bytes"),
            (message(b'c', b""), "ended the replication stream"),
            (
                message(b'E', b"SERROR\0C58P01\0Mno such slot\0\0"),
                "no such slot (SQLSTATE 58P01)",
            ),
        ];
        for (bytes, expected) in cases {
            let err = stream_of(&bytes).next().await.unwrap_err().to_string();
            assert!(err.contains(expected), "{err:?} lacks {expected:?}");
        }
    }

    #[test]
    fn an_error_response_gives_its_code_and_message() {
        let body = b"SERROR\0C55000\0Mcan no longer get changes\0\0";
        match server_error(body) {
            StreamError::Server { code, message } => {
                assert_eq!(code, "55000");
                assert_eq!(message, "can no longer get changes");
            }
            other => panic!("{other:?}"),
        }
        // Cut short: what is there, no panic.
        match server_error(b"C55") {
            StreamError::Server { code, .. } => assert_eq!(code, "55"),
            other => panic!("{other:?}"),
        }
    }
}
