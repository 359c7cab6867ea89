//! The streaming replication protocol, as much of it as the change feed needs: a connection
//! in `replication=database` mode, `START_REPLICATION SLOT … LOGICAL`, the stream of
//! `XLogData` and keepalive messages it answers with, and the standby status updates that
//! confirm how far the feed has applied (the server moves the slot to the confirmed
//! position).
//!
//! tokio-postgres (0.7) has no copy-both mode, which the stream needs, so the connection is
//! made here, on `postgres-protocol`'s message writers and its password and SCRAM-SHA-256
//! code; the few backend messages the stream uses are read here. Without TLS, like every
//! other connection of the ops crate.

use std::io;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use postgres_protocol::authentication::{md5_hash, sasl};
use postgres_protocol::message::frontend;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The largest message the stream accepts: PostgreSQL's own bound on one allocation (1 GiB),
/// which bounds a row's values, and a little for the message's headers.
pub(super) const MAX_MESSAGE: usize = (1 << 30) + 4096;

/// Why the stream failed.
#[derive(Debug)]
pub(super) enum StreamError {
    /// The server answered an error: its SQLSTATE and message.
    Server { code: String, message: String },
    /// The connection failed or the server broke the protocol.
    Io(io::Error),
}

impl StreamError {
    fn protocol(what: impl Into<String>) -> Self {
        Self::Io(io::Error::new(io::ErrorKind::InvalidData, what.into()))
    }

    /// The server refused the connection itself (`pg_hba.conf` has no line for
    /// replication connections, the role may not replicate, too many senders): a feed
    /// can still read its slot through SQL.
    pub(super) fn refused_connection(&self) -> bool {
        matches!(self, Self::Server { code, .. }
            if code == "28000" || code == "28P01" || code == "42501" || code == "53300")
    }
}

impl std::fmt::Display for StreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Server { code, message } => write!(f, "{message} (SQLSTATE {code})"),
            Self::Io(e) => write!(f, "{e}"),
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
}

/// Opens a replication connection with `config`'s first reachable host, user, password,
/// database and options, under `application`.
pub(super) async fn connect(
    config: &tokio_postgres::Config,
    application: &str,
) -> Result<Stream, StreamError> {
    let ports = config.get_ports();
    let timeout = config
        .get_connect_timeout()
        .copied()
        .unwrap_or(Duration::from_secs(10));
    let mut last = None;
    for (i, host) in config.get_hosts().iter().enumerate() {
        let port = ports
            .get(i)
            .or_else(|| ports.first())
            .copied()
            .unwrap_or(5432);
        let opened: io::Result<Box<dyn Io>> = match host {
            tokio_postgres::config::Host::Tcp(name) => {
                match tokio::time::timeout(
                    timeout,
                    tokio::net::TcpStream::connect((name.as_str(), port)),
                )
                .await
                {
                    Ok(Ok(socket)) => {
                        let _ = socket.set_nodelay(true);
                        Ok(Box::new(socket))
                    }
                    Ok(Err(e)) => Err(e),
                    Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out")),
                }
            }
            #[cfg(unix)]
            tokio_postgres::config::Host::Unix(dir) => {
                let path = dir.join(format!(".s.PGSQL.{port}"));
                match tokio::net::UnixStream::connect(path).await {
                    Ok(socket) => Ok(Box::new(socket) as Box<dyn Io>),
                    Err(e) => Err(e),
                }
            }
        };
        match opened {
            Ok(io) => {
                let mut stream = Stream {
                    io,
                    input: BytesMut::with_capacity(8192),
                    output: BytesMut::with_capacity(1024),
                };
                stream.startup(config, application).await?;
                return Ok(stream);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(StreamError::Io(last.unwrap_or_else(|| {
        io::Error::new(io::ErrorKind::InvalidInput, "no host to connect to")
    })))
}

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
        if self.input.len() < 5 {
            return Ok(None);
        }
        let tag = self.input[0];
        let len = u32::from_be_bytes([self.input[1], self.input[2], self.input[3], self.input[4]])
            as usize;
        if !(4..=MAX_MESSAGE).contains(&len) {
            return Err(StreamError::protocol(format!(
                "a message of {len} bytes (at most {MAX_MESSAGE})"
            )));
        }
        if self.input.len() < len + 1 {
            self.input.reserve(len + 1 - self.input.len());
            return Ok(None);
        }
        let mut frame = self.input.split_to(len + 1);
        frame.advance(5);
        Ok(Some(Message {
            tag,
            body: frame.freeze(),
        }))
    }

    async fn read_message(&mut self) -> Result<Message, StreamError> {
        loop {
            if let Some(message) = self.parse()? {
                return Ok(message);
            }
            if self.input.capacity() - self.input.len() < 4096 {
                self.input.reserve(8192);
            }
            if self.io.read_buf(&mut self.input).await? == 0 {
                return Err(StreamError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the server closed the replication connection",
                )));
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
                                     (channel binding needs TLS, which the feed does not use)",
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
                // Parameter status, backend key data, notices.
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
        self.input.len() >= 5 && {
            let len =
                u32::from_be_bytes([self.input[1], self.input[2], self.input[3], self.input[4]])
                    as usize;
            self.input.len() > len
        }
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
            (vec![b'd', 0, 0, 0, 3], "a message of 3 bytes"),
            (
                vec![b'd', 0x7f, 0xff, 0xff, 0xff],
                "a message of 2147483647 bytes",
            ),
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
