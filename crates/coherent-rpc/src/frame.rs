//! The frame envelope: how one message is laid out on the byte stream.
//! `kind|flags (1) · call id (LEB128 varint, 1..=10) · method id (u32 LE) · length (u32 LE) · payload`.
//! This module only encodes and decodes envelopes; it never interprets payloads.

use thiserror::Error;

/// The longest envelope: 1 + 10 + 4 + 4 bytes.
pub const MAX_HEADER_LEN: usize = 19;

/// What a frame means; the low 4 bits of its first byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// The connecting side's handshake.
    Hello = 1,
    /// The accepting side's handshake answer.
    HelloAck = 2,
    /// A call that expects a reply (or a stream).
    Call = 3,
    /// A call that expects no reply.
    OneWay = 4,
    /// A call's successful result.
    Ok = 5,
    /// A call's protocol failure (code + message).
    Error = 6,
    /// The caller gave up on a call.
    Cancel = 7,
    /// One item of a server stream.
    StreamItem = 8,
    /// The normal end of a server stream.
    StreamEnd = 9,
    /// The consumer grants the producer more stream credits.
    StreamAck = 10,
    /// Keep-alive probe; the payload is echoed in a `Pong`.
    Ping = 11,
    /// Keep-alive answer.
    Pong = 12,
    /// The sender closes the connection, with a reason (code + message).
    Close = 13,
    /// Two or more items of a server stream, each as `length (varint) · item`.
    StreamBatch = 14,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Hello,
            2 => Self::HelloAck,
            3 => Self::Call,
            4 => Self::OneWay,
            5 => Self::Ok,
            6 => Self::Error,
            7 => Self::Cancel,
            8 => Self::StreamItem,
            9 => Self::StreamEnd,
            10 => Self::StreamAck,
            11 => Self::Ping,
            12 => Self::Pong,
            13 => Self::Close,
            14 => Self::StreamBatch,
            _ => return None,
        })
    }
}

/// How a payload is compressed; bits 4-5 of a frame's first byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Compression {
    /// Stored as is.
    None = 0,
    /// LZ4 block, preceded by the uncompressed length (u32 LE).
    Lz4 = 1,
    /// A zstd frame that declares its content size.
    Zstd = 2,
}

impl Compression {
    /// The compression numbered `v` (its bits in a frame's first byte).
    pub(crate) fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Self::None),
            1 => Some(Self::Lz4),
            2 => Some(Self::Zstd),
            _ => None,
        }
    }
}

/// A decoded envelope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The frame's kind.
    pub kind: Kind,
    /// How the payload is compressed.
    pub compression: Compression,
    /// Bit 6: a stream frame (`StreamItem`, `StreamBatch`, `StreamEnd`, `StreamAck`) of an
    /// *upload*, the stream a caller sends to the callee as a call's argument, instead of
    /// the callee's answer stream. The call id then names a call the other way round.
    pub upload: bool,
    /// Which call the frame belongs to (0 for connection-level frames).
    pub call_id: u64,
    /// The called method (0 when the frame is not a call).
    pub method_id: u32,
    /// The payload's length in bytes, as sent (after compression).
    pub len: u32,
}

/// Why bytes are not a frame. Every variant ends the connection with a `Close`.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The kind nibble names no kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// Bit 7 or the compression value 3 is set, or bit 6 on a frame that is not a stream
    /// frame.
    #[error("invalid frame flags {0:#04x}")]
    BadFlags(u8),
    /// The call id varint runs past 10 bytes, overflows u64 or is not minimal.
    #[error("malformed call id varint")]
    BadVarint,
    /// A `StreamBatch` payload is empty or ends inside an item.
    #[error("malformed stream batch")]
    BadBatch,
    /// The declared payload length exceeds the receiver's limit.
    #[error("frame payload of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// The declared length.
        len: u32,
        /// The receiver's limit.
        max: u32,
    },
}

impl Header {
    /// Writes the envelope into `out` and returns how many bytes it took.
    pub fn encode(&self, out: &mut [u8; MAX_HEADER_LEN]) -> usize {
        out[0] = self.kind as u8 | ((self.compression as u8) << 4) | (u8::from(self.upload) << 6);
        let mut n = 1 + write_varint(self.call_id, &mut out[1..]);
        out[n..n + 4].copy_from_slice(&self.method_id.to_le_bytes());
        n += 4;
        out[n..n + 4].copy_from_slice(&self.len.to_le_bytes());
        n + 4
    }

    /// Reads an envelope from the front of `buf`.
    ///
    /// `Ok(None)` means more bytes are needed; `Ok(Some((header, header_len)))` means the
    /// envelope is complete (the payload may still be arriving). `max_len` bounds the
    /// declared payload length so that a hostile length never makes us buffer it.
    pub fn decode(buf: &[u8], max_len: u32) -> Result<Option<(Header, usize)>, FrameError> {
        let Some(&first) = buf.first() else {
            return Ok(None);
        };
        let kind = Kind::from_u8(first & 0x0F).ok_or(FrameError::UnknownKind(first & 0x0F))?;
        let compression =
            Compression::from_u8((first >> 4) & 0x03).ok_or(FrameError::BadFlags(first))?;
        let upload = first & 0x40 != 0;
        let stream_kind = matches!(
            kind,
            Kind::StreamItem | Kind::StreamBatch | Kind::StreamEnd | Kind::StreamAck
        );
        if first & 0x80 != 0 || (upload && !stream_kind) {
            return Err(FrameError::BadFlags(first));
        }
        let Some((call_id, vlen)) = read_varint(&buf[1..])? else {
            return Ok(None);
        };
        let at = 1 + vlen;
        if buf.len() < at + 8 {
            return Ok(None);
        }
        let method_id = u32::from_le_bytes(buf[at..at + 4].try_into().expect("4 bytes"));
        let len = u32::from_le_bytes(buf[at + 4..at + 8].try_into().expect("4 bytes"));
        if len > max_len {
            return Err(FrameError::TooLarge { len, max: max_len });
        }
        Ok(Some((
            Header {
                kind,
                compression,
                upload,
                call_id,
                method_id,
                len,
            },
            at + 8,
        )))
    }
}

/// The items of a `StreamBatch` payload, in order: each is `length (varint) · item`.
///
/// Yields `Err(FrameError::BadBatch)` once, and then nothing, when the payload ends
/// inside an item or its length. [`batch_len`] checks a whole payload up front.
#[derive(Debug, Clone)]
pub struct BatchItems<'a> {
    rest: &'a [u8],
}

impl<'a> BatchItems<'a> {
    /// The items of `payload`.
    pub fn new(payload: &'a [u8]) -> Self {
        Self { rest: payload }
    }

    /// The bytes after the items read so far.
    pub fn remaining(&self) -> &'a [u8] {
        self.rest
    }
}

impl<'a> Iterator for BatchItems<'a> {
    type Item = Result<&'a [u8], FrameError>;

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let item = match read_varint(self.rest) {
            Ok(Some((len, n))) if len <= (self.rest.len() - n) as u64 => {
                let (item, rest) = self.rest[n..].split_at(len as usize);
                self.rest = rest;
                Ok(item)
            }
            Ok(_) | Err(_) => {
                self.rest = &[];
                Err(FrameError::BadBatch)
            }
        };
        Some(item)
    }
}

/// How many items a `StreamBatch` payload holds, or why it is malformed (an empty
/// payload, or one that ends inside an item).
pub fn batch_len(payload: &[u8]) -> Result<u32, FrameError> {
    let mut n = 0u32;
    for item in BatchItems::new(payload) {
        item?;
        n = n.saturating_add(1);
    }
    if n == 0 {
        return Err(FrameError::BadBatch);
    }
    Ok(n)
}

/// Writes `v` as an unsigned LEB128 varint; returns the number of bytes written.
pub fn write_varint(mut v: u64, out: &mut [u8]) -> usize {
    let mut i = 0;
    loop {
        let byte = (v & 0x7F) as u8;
        v >>= 7;
        if v == 0 {
            out[i] = byte;
            return i + 1;
        }
        out[i] = byte | 0x80;
        i += 1;
    }
}

/// Reads a minimal unsigned LEB128 varint of at most 10 bytes.
///
/// Non-minimal encodings are refused so that every id has exactly one byte form.
#[inline]
pub fn read_varint(buf: &[u8]) -> Result<Option<(u64, usize)>, FrameError> {
    match buf.first() {
        // Most varints (lengths of short items, small ids) are one byte.
        Some(&b) if b < 0x80 => Ok(Some((u64::from(b), 1))),
        _ => match *buf {
            // Two bytes (ids up to 16,383), minimal when the second is not zero.
            [b0, b1, ..] if b1 < 0x80 && b1 != 0 => {
                Ok(Some((u64::from(b0 & 0x7F) | u64::from(b1) << 7, 2)))
            }
            _ => read_long_varint(buf),
        },
    }
}

#[inline(never)]
fn read_long_varint(buf: &[u8]) -> Result<Option<(u64, usize)>, FrameError> {
    let mut v: u64 = 0;
    for i in 0..10 {
        let Some(&b) = buf.get(i) else {
            return Ok(None);
        };
        let bits = u64::from(b & 0x7F);
        if i == 9 && b > 1 {
            return Err(FrameError::BadVarint);
        }
        v |= bits << (7 * i);
        if b & 0x80 == 0 {
            if i > 0 && b == 0 {
                return Err(FrameError::BadVarint);
            }
            return Ok(Some((v, i + 1)));
        }
    }
    Err(FrameError::BadVarint)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip_at_every_width() {
        let mut buf = [0u8; 10];
        for v in [
            0,
            1,
            127,
            128,
            300,
            16_383,
            16_384,
            u32::MAX as u64,
            u64::MAX,
        ] {
            let n = write_varint(v, &mut buf);
            assert_eq!(read_varint(&buf[..n]), Ok(Some((v, n))));
            assert_eq!(read_varint(&buf[..n - 1]), Ok(None));
        }
    }

    #[test]
    fn batches_split_into_their_items_and_truncated_ones_are_refused() {
        let batch = [1, 0xAA, 0, 2, 0xBB, 0xCC];
        let items: Vec<_> = BatchItems::new(&batch).collect();
        assert_eq!(
            items,
            vec![Ok(&[0xAA][..]), Ok(&[][..]), Ok(&[0xBB, 0xCC][..])]
        );
        assert_eq!(batch_len(&batch), Ok(3));
        assert_eq!(batch_len(&batch[..5]), Err(FrameError::BadBatch));
        assert_eq!(batch_len(&[]), Err(FrameError::BadBatch));
        assert_eq!(batch_len(&[0x80]), Err(FrameError::BadBatch));
        let mut truncated = BatchItems::new(&batch[..5]);
        assert_eq!(truncated.next(), Some(Ok(&[0xAA][..])));
        assert_eq!(truncated.next(), Some(Ok(&[][..])));
        assert_eq!(truncated.next(), Some(Err(FrameError::BadBatch)));
        assert_eq!(truncated.next(), None);
    }

    #[test]
    fn overlong_and_overflowing_varints_are_refused() {
        assert_eq!(read_varint(&[0x80, 0x00]), Err(FrameError::BadVarint));
        assert_eq!(read_varint(&[0xFF; 10]), Err(FrameError::BadVarint));
        assert_eq!(read_varint(&[0xFF; 11]), Err(FrameError::BadVarint));
    }
}
