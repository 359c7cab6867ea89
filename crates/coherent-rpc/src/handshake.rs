//! The handshake payload carried by `Hello` (connecting side) and `HelloAck` (accepting
//! side): protocol version, serde format, decodable compressions, limits and the bearer
//! token. It is a fixed binary layout so that it can be read before any format is agreed.

use crate::codec::{CompressionSet, Format};
use crate::error::{ErrorCode, RpcError};

/// The four bytes every handshake starts with.
pub const MAGIC: [u8; 4] = *b"CRPC";
/// The protocol version this build speaks.
pub const VERSION: u8 = 1;
/// The fixed part of a handshake payload, before the token bytes.
pub const FIXED_LEN: usize = 22;
/// The longest token accepted.
pub const MAX_TOKEN_LEN: usize = 4096;

/// One side's handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version.
    pub version: u8,
    /// The serde format of every payload on this connection (chosen by the connecting side).
    pub format: Format,
    /// The compressions this side can decode.
    pub decodes: CompressionSet,
    /// The largest payload this side accepts, after decompression.
    pub max_message_size: u32,
    /// How many calls this side runs at once for this connection.
    pub max_inbound_calls: u32,
    /// How many stream items a producer may send this side ahead of its acks, per stream.
    pub stream_window: u32,
    /// A bearer token (empty for none; always empty in a `HelloAck`).
    pub token: String,
}

impl Hello {
    /// The handshake payload's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(FIXED_LEN + self.token.len());
        out.extend_from_slice(&MAGIC);
        out.push(self.version);
        out.push(self.format.to_u8());
        out.push(self.decodes.0);
        out.push(0);
        out.extend_from_slice(&self.max_message_size.to_le_bytes());
        out.extend_from_slice(&self.max_inbound_calls.to_le_bytes());
        out.extend_from_slice(&self.stream_window.to_le_bytes());
        out.extend_from_slice(&(self.token.len() as u16).to_le_bytes());
        out.extend_from_slice(self.token.as_bytes());
        out
    }

    /// Reads a handshake payload; every malformation is a `Protocol` (or version) error.
    pub fn decode(buf: &[u8]) -> Result<Self, RpcError> {
        let bad = |m: &str| RpcError::protocol(format!("bad handshake: {m}"));
        if buf.len() < FIXED_LEN {
            return Err(bad("shorter than its fixed part"));
        }
        if buf[..4] != MAGIC {
            return Err(bad("wrong magic"));
        }
        let version = buf[4];
        if version != VERSION {
            return Err(RpcError::new(
                ErrorCode::UnsupportedVersion,
                format!("protocol version {version} is not supported (this peer speaks {VERSION})"),
            ));
        }
        let format = Format::from_u8(buf[5]).ok_or_else(|| bad("unknown format"))?;
        if buf[6] & !CompressionSet::ALL.0 != 0 || buf[7] != 0 {
            return Err(bad("reserved bits set"));
        }
        let u32_at = |i: usize| u32::from_le_bytes(buf[i..i + 4].try_into().expect("4 bytes"));
        let token_len = u16::from_le_bytes([buf[20], buf[21]]) as usize;
        if token_len > MAX_TOKEN_LEN {
            return Err(bad("token too long"));
        }
        if buf.len() != FIXED_LEN + token_len {
            return Err(bad("length does not match its token length"));
        }
        let token = std::str::from_utf8(&buf[FIXED_LEN..])
            .map_err(|_| bad("token is not UTF-8"))?
            .to_owned();
        let hello = Hello {
            version,
            format,
            decodes: CompressionSet(buf[6]),
            max_message_size: u32_at(8),
            max_inbound_calls: u32_at(12),
            stream_window: u32_at(16),
            token,
        };
        if hello.stream_window == 0 {
            return Err(bad("stream window is zero"));
        }
        Ok(hello)
    }
}
