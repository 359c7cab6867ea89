//! Payload encoding: the serde format negotiated in the handshake and the per-message
//! compression applied above a size threshold. Decoders here face hostile bytes, so every
//! size is checked against the receiver's limit before anything is allocated.

use bytes::Bytes;
use serde::{de::DeserializeOwned, Serialize};

use crate::error::{ErrorCode, RpcError};
use crate::frame::Compression;

/// The serde format of call arguments, results and stream items.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Format {
    /// postcard: compact, Rust-first (the default). Wire value 0.
    #[default]
    Postcard,
    /// MessagePack through rmp-serde (structs as arrays), for non-Rust peers. Wire value 1.
    MessagePack,
}

impl Format {
    pub(crate) fn to_u8(self) -> u8 {
        match self {
            Self::Postcard => 0,
            Self::MessagePack => 1,
        }
    }

    pub(crate) fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Self::Postcard),
            1 => Some(Self::MessagePack),
            _ => None,
        }
    }

    /// Serializes `value` in this format.
    pub fn encode<T: Serialize + ?Sized>(self, value: &T) -> Result<Bytes, RpcError> {
        // Room for a typical small message up front: growing from empty reallocates
        // several times for anything but the tiniest value.
        let buf = Vec::with_capacity(64);
        let out = match self {
            Self::Postcard => postcard::to_extend(value, buf).map_err(|e| e.to_string()),
            Self::MessagePack => {
                let mut buf = buf;
                rmp_serde::encode::write(&mut buf, value)
                    .map(|()| buf)
                    .map_err(|e| e.to_string())
            }
        };
        out.map(Bytes::from)
            .map_err(|e| RpcError::new(ErrorCode::BadArguments, format!("cannot encode: {e}")))
    }

    /// Deserializes a `T` from `bytes` in this format.
    pub fn decode<T: DeserializeOwned>(self, bytes: &[u8]) -> Result<T, RpcError> {
        let out = match self {
            Self::Postcard => postcard::from_bytes(bytes).map_err(|e| e.to_string()),
            Self::MessagePack => rmp_serde::from_slice(bytes).map_err(|e| e.to_string()),
        };
        out.map_err(|e| RpcError::new(ErrorCode::BadArguments, format!("cannot decode: {e}")))
    }
}

/// Compression codecs a peer can decode, as the handshake's bit mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CompressionSet(pub(crate) u8);

impl CompressionSet {
    /// No compression at all.
    pub const NONE: Self = Self(0);
    /// LZ4 only.
    pub const LZ4: Self = Self(1);
    /// zstd only.
    pub const ZSTD: Self = Self(2);
    /// LZ4 and zstd.
    pub const ALL: Self = Self(3);

    /// Whether `c` is in the set (`Compression::None` always is).
    pub fn contains(self, c: Compression) -> bool {
        match c {
            Compression::None => true,
            Compression::Lz4 => self.0 & 1 != 0,
            Compression::Zstd => self.0 & 2 != 0,
        }
    }
}

/// Compresses `data` with `c`, or returns `None` when that would not make it smaller.
pub(crate) fn compress(c: Compression, data: &[u8]) -> Option<Vec<u8>> {
    let out = match c {
        Compression::None => return None,
        Compression::Lz4 => lz4_flex::compress_prepend_size(data),
        // Level 1: compression sits on the call path, so speed matters more than ratio.
        Compression::Zstd => zstd::bulk::compress(data, 1).ok()?,
    };
    (out.len() < data.len()).then_some(out)
}

/// Decompresses a payload, refusing output larger than `max` before allocating it.
pub fn decompress(c: Compression, data: Bytes, max: u32) -> Result<Bytes, RpcError> {
    let too_large = |n: u64| {
        RpcError::new(
            ErrorCode::TooLarge,
            format!("decompressed size {n} exceeds the limit of {max}"),
        )
    };
    let bad = |e: String| RpcError::protocol(format!("cannot decompress: {e}"));
    match c {
        Compression::None => Ok(data),
        Compression::Lz4 => {
            let Some(len) = data.get(..4) else {
                return Err(bad("lz4 payload shorter than its size prefix".into()));
            };
            let n = u32::from_le_bytes(len.try_into().expect("4 bytes"));
            if n > max {
                return Err(too_large(n.into()));
            }
            lz4_flex::decompress_size_prepended(&data)
                .map(Bytes::from)
                .map_err(|e| bad(e.to_string()))
        }
        Compression::Zstd => {
            let n = match zstd::zstd_safe::get_frame_content_size(&data) {
                Ok(Some(n)) => n,
                _ => return Err(bad("zstd frame without a content size".into())),
            };
            if n > u64::from(max) {
                return Err(too_large(n));
            }
            let out = zstd::bulk::decompress(&data, n as usize).map_err(|e| bad(e.to_string()))?;
            if out.len() as u64 != n {
                return Err(bad("zstd content size does not match its frame".into()));
            }
            Ok(Bytes::from(out))
        }
    }
}
