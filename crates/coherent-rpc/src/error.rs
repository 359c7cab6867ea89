//! The protocol's own failure kind, distinct from an application's typed errors.
//! An `RpcError` is what crosses the wire in an `Error` or `Close` frame: a stable
//! numeric code (see PROTOCOL.md) and a human-readable message.

use std::fmt;

/// Why a call or a connection failed, as carried on the wire (`u16`, little endian).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(u16)]
pub enum ErrorCode {
    /// The method id names no method the callee serves.
    UnknownMethod = 1,
    /// The arguments (or a reply) could not be decoded in the negotiated format.
    BadArguments = 2,
    /// The caller's deadline passed before a reply came.
    DeadlineExceeded = 3,
    /// The connection closed (or could not be made) before the call completed.
    Disconnected = 4,
    /// A message is larger than the receiver's limit.
    TooLarge = 5,
    /// The handshake's credentials were refused.
    Unauthenticated = 6,
    /// The callee already runs its maximum of concurrent calls for this connection.
    Overloaded = 7,
    /// The caller cancelled the call.
    Cancelled = 8,
    /// The peer broke the protocol (malformed frame, bad handshake, duplicate id...).
    Protocol = 9,
    /// The handler failed without a typed error (for example it panicked).
    Internal = 10,
    /// The peers share no protocol version.
    UnsupportedVersion = 11,
    /// A code this build does not know (sent by a newer peer).
    Unknown = 0xFFFF,
}

impl ErrorCode {
    /// Reads a wire code; codes this build does not know become [`ErrorCode::Unknown`].
    pub fn from_u16(code: u16) -> Self {
        match code {
            1 => Self::UnknownMethod,
            2 => Self::BadArguments,
            3 => Self::DeadlineExceeded,
            4 => Self::Disconnected,
            5 => Self::TooLarge,
            6 => Self::Unauthenticated,
            7 => Self::Overloaded,
            8 => Self::Cancelled,
            9 => Self::Protocol,
            10 => Self::Internal,
            11 => Self::UnsupportedVersion,
            _ => Self::Unknown,
        }
    }

    /// The wire value of this code.
    pub fn as_u16(self) -> u16 {
        self as u16
    }
}

/// A protocol or transport failure: a code and a message.
///
/// Boxed inside so that `Result<T, RpcError>` stays one pointer wide on hot paths.
#[derive(Clone, PartialEq, Eq)]
pub struct RpcError(Box<Inner>);

#[derive(Clone, PartialEq, Eq)]
struct Inner {
    code: ErrorCode,
    message: String,
}

impl RpcError {
    /// An error with this code and message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self(Box::new(Inner {
            code,
            message: message.into(),
        }))
    }

    /// The error's code.
    pub fn code(&self) -> ErrorCode {
        self.0.code
    }

    /// The error's message.
    pub fn message(&self) -> &str {
        &self.0.message
    }

    pub(crate) fn disconnected(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Disconnected, message)
    }

    pub(crate) fn protocol(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Protocol, message)
    }

    /// Encodes the `Error`/`Close` payload: code (u16 LE) then the UTF-8 message.
    pub(crate) fn to_payload(&self) -> Vec<u8> {
        let msg = self.message().as_bytes();
        // Messages are for people; a bound keeps a hostile echo from growing frames.
        let msg = &msg[..floor_char_boundary(self.message(), msg.len().min(1024))];
        let mut out = Vec::with_capacity(2 + msg.len());
        out.extend_from_slice(&self.code().as_u16().to_le_bytes());
        out.extend_from_slice(msg);
        out
    }

    /// Decodes an `Error`/`Close` payload; invalid UTF-8 is replaced, never rejected.
    pub(crate) fn from_payload(payload: &[u8]) -> Self {
        if payload.len() < 2 {
            return Self::protocol("error frame shorter than its 2-byte code");
        }
        let code = ErrorCode::from_u16(u16::from_le_bytes([payload[0], payload[1]]));
        Self::new(code, String::from_utf8_lossy(&payload[2..]).into_owned())
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

impl fmt::Debug for RpcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RpcError({:?}: {})", self.code(), self.message())
    }
}

impl fmt::Display for RpcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.code(), self.message())
    }
}

impl std::error::Error for RpcError {}

impl From<std::io::Error> for RpcError {
    fn from(e: std::io::Error) -> Self {
        Self::disconnected(e.to_string())
    }
}

/// As a value (a compute method's cached `Err`, say): the wire code and the message, so
/// that `Result<T, RpcError>` can be a replicated method's result.
impl serde::Serialize for RpcError {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        (self.code().as_u16(), self.message()).serialize(s)
    }
}

impl<'de> serde::Deserialize<'de> for RpcError {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let (code, message): (u16, String) = serde::Deserialize::deserialize(d)?;
        Ok(Self::new(ErrorCode::from_u16(code), message))
    }
}
