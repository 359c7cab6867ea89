//! Payload encoding: the serde format negotiated in the handshake and the per-message
//! compression applied above a size threshold. Decoders here face hostile bytes, so every
//! size is checked against the receiver's limit before anything is allocated.

use std::cell::RefCell;
use std::io::Write;

use bytes::{BufMut, Bytes, BytesMut};
use serde::{de::DeserializeOwned, Serialize};

use crate::error::{ErrorCode, RpcError};
use crate::frame::Compression;

/// The size of the chunks that encoded messages share (see [`Format::encode`]).
const ARENA_CHUNK: usize = 16 * 1024;
/// Below this much room left, a chunk is replaced before the next message.
const ARENA_ROOM: usize = 256;

/// The serde format of call arguments, results and stream items.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Format {
    /// postcard: compact, Rust-first (the default). Wire value 0.
    #[default]
    Postcard,
    /// MessagePack through rmp-serde, for peers in other languages: structs are maps keyed
    /// by field name and types with a human-readable form use it (a `Uuid` is its string),
    /// so that a value reads as its JSON does. Wire value 1.
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

    /// Serializes `value` in this format into one buffer.
    ///
    /// Messages are written back to back into this thread's 16 KiB chunk, and each is a `Bytes`
    /// slice of it: a small message costs no allocation of its own (a `Vec` per message would
    /// cost two: the buffer, and the shared header that `Bytes::from(Vec)` adds). A chunk is
    /// freed when the last message in it has been written.
    pub fn encode<T: Serialize + ?Sized>(self, value: &T) -> Result<Bytes, RpcError> {
        let mut parts = Parts::default();
        let small = self.encode_parts(value, &mut parts, false)?;
        debug_assert!(parts.rest.is_empty() && small.is_none());
        Ok(parts.first)
    }

    /// Serializes `value` in this format as a [`Message`], as the connection sends it: like
    /// [`encode`](Self::encode), except that a [`Blob`](crate::Blob) of `SPLICE_FROM` bytes or
    /// more is not copied but becomes a part of its own, written to the socket from its
    /// own buffer.
    ///
    /// A message of up to `SMALL` bytes is kept inline, in the `Message` itself: no shared
    /// buffer, so no reference count to touch when it is written and dropped.
    pub fn encode_message<T: Serialize + ?Sized>(self, value: &T) -> Result<Message, RpcError> {
        let mut parts = Parts::default();
        match self.encode_parts(value, &mut parts, true)? {
            Some(small) => Ok(Message(Repr::Small(small))),
            None => Ok(Message(Repr::Parts(parts))),
        }
    }

    /// Encodes `value` into this thread's arena, as `parts`; with `splice` (a message), a
    /// value that turns out short stays in a stack buffer instead, returned here.
    fn encode_parts<T: Serialize + ?Sized>(
        self,
        value: &T,
        parts: &mut Parts,
        splice: bool,
    ) -> Result<Option<Small>, RpcError> {
        thread_local! {
            static ARENA: RefCell<BytesMut> = RefCell::new(BytesMut::new());
        }
        let encoded = ARENA.with(|arena| match arena.try_borrow_mut() {
            Ok(mut arena) => {
                // Left by an encoding that panicked on this thread (its task was caught and
                // the thread lives on): never the start of this message.
                arena.clear();
                let mut sink = Staged {
                    small: Small::default(),
                    spilled: !splice,
                    inner: Splicing {
                        buf: &mut arena,
                        parts,
                        splice,
                    },
                };
                if sink.spilled {
                    sink.make_room();
                }
                let written = self.write(value, &mut sink);
                if !sink.spilled {
                    return written.map(|()| Some(sink.small));
                }
                // Taken even on failure, so that a half-written message never prefixes the next.
                let last = arena.split().freeze();
                written.map(|()| {
                    parts.push(last);
                    None
                })
            }
            // A `Serialize` impl that encodes another message while being encoded.
            Err(_) => {
                let mut own = BytesMut::new();
                self.write(value, &mut own).map(|()| {
                    parts.push(own.freeze());
                    None
                })
            }
        });
        encoded.map_err(|e| failed("encode", e))
    }

    /// Serializes `value` in this format at the end of `out`. On failure `out` may hold
    /// part of the encoding.
    pub fn encode_into<T: Serialize + ?Sized>(
        self,
        value: &T,
        out: &mut Vec<u8>,
    ) -> Result<(), RpcError> {
        self.write(value, out).map_err(|e| failed("encode", e))
    }

    #[inline]
    fn write<T: Serialize + ?Sized, S: Sink>(self, value: &T, out: &mut S) -> Result<(), String> {
        match self {
            Self::Postcard => crate::compact::encode(value, out).map_err(|e| e.to_string()),
            Self::MessagePack => {
                let mut ser = rmp_serde::Serializer::new(Append(out))
                    .with_struct_map()
                    .with_human_readable();
                value.serialize(&mut ser).map_err(|e| e.to_string())
            }
        }
    }

    /// Deserializes a `T` from `bytes` in this format; its [`Blob`](crate::Blob) fields
    /// share `bytes` instead of copying out of it.
    pub fn decode_bytes<T: DeserializeOwned>(self, mut bytes: Bytes) -> Result<T, RpcError> {
        let len = bytes.len();
        crate::blob::decode_in(&mut bytes, 0..len, |b| self.decode(b))
    }

    /// Deserializes a `T` from `bytes` in this format.
    #[inline]
    pub fn decode<T: DeserializeOwned>(self, bytes: &[u8]) -> Result<T, RpcError> {
        match self {
            Self::Postcard => crate::compact::decode(bytes).map_err(|e| failed("decode", e)),
            Self::MessagePack => {
                let mut de = rmp_serde::Deserializer::from_read_ref(bytes).with_human_readable();
                T::deserialize(&mut de).map_err(|e| failed("decode", e))
            }
        }
    }
}

/// The error of a value that could not be encoded or decoded.
#[cold]
fn failed(what: &str, e: impl std::fmt::Display) -> RpcError {
    RpcError::new(ErrorCode::BadArguments, format!("cannot {what}: {e}"))
}

/// A growable buffer that encoders append to.
pub(crate) trait Sink {
    fn push(&mut self, byte: u8);
    fn extend(&mut self, bytes: &[u8]);
}

impl Sink for BytesMut {
    #[inline]
    fn push(&mut self, byte: u8) {
        self.put_u8(byte);
    }

    #[inline]
    fn extend(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// The arena, where a blob offered by [`offer_blob`] is taken as a part of its own
/// instead of being copied in.
struct Splicing<'a> {
    buf: &'a mut BytesMut,
    parts: &'a mut Parts,
    splice: bool,
}

impl Sink for Splicing<'_> {
    #[inline]
    fn push(&mut self, byte: u8) {
        self.buf.put_u8(byte);
    }

    #[inline]
    fn extend(&mut self, bytes: &[u8]) {
        if self.splice && bytes.len() >= SPLICE_FROM {
            if let Some(blob) = offered(bytes) {
                // What precedes the blob (its length among it), then the blob itself.
                self.parts.push(self.buf.split().freeze());
                self.parts.push(blob);
                return;
            }
        }
        self.buf.extend_from_slice(bytes);
    }
}

/// A message's bytes while they fit in a [`Small`]; once they do not, the arena's
/// [`Splicing`], which the bytes so far move to.
struct Staged<'a> {
    small: Small,
    spilled: bool,
    inner: Splicing<'a>,
}

impl Staged<'_> {
    /// Moves to the arena (a fresh chunk if the current one is nearly full).
    #[cold]
    fn spill(&mut self) {
        self.spilled = true;
        self.make_room();
        self.inner.buf.extend_from_slice(self.small.bytes());
    }

    fn make_room(&mut self) {
        let buf = &mut *self.inner.buf;
        if buf.capacity() - buf.len() < ARENA_ROOM {
            // A fresh chunk; the old one lives on in the messages that share it.
            *buf = BytesMut::with_capacity(ARENA_CHUNK);
        }
    }
}

impl Sink for Staged<'_> {
    #[inline]
    fn push(&mut self, byte: u8) {
        if !self.spilled {
            if let Some(slot) = self.small.data.get_mut(usize::from(self.small.len)) {
                *slot = byte;
                self.small.len += 1;
                return;
            }
            self.spill();
        }
        self.inner.push(byte);
    }

    #[inline]
    fn extend(&mut self, bytes: &[u8]) {
        if !self.spilled {
            let at = usize::from(self.small.len);
            if let Some(room) = self.small.data.get_mut(at..at + bytes.len()) {
                room.copy_from_slice(bytes);
                self.small.len += bytes.len() as u8;
                return;
            }
            self.spill();
        }
        self.inner.extend(bytes);
    }
}

/// Blobs of this size or more are sent from their own buffer, not copied into the message
/// (the writer sends parts of this size straight from their buffer too).
pub(crate) const SPLICE_FROM: usize = 32 * 1024;

thread_local! {
    /// The blob being serialized on this thread, while its bytes go to the serializer.
    static OFFER: RefCell<Option<Bytes>> = const { RefCell::new(None) };
}

/// Runs `serialize` (which writes `blob`'s bytes) with `blob` offered to [`Splicing`]: if the
/// slice that reaches it is this blob, it takes a reference to the blob instead of a copy.
/// Serializers other than ours never look at the offer, and it is withdrawn on return.
#[inline(always)]
pub(crate) fn offer_blob<R>(blob: &Bytes, serialize: impl FnOnce() -> R) -> R {
    if blob.len() < SPLICE_FROM {
        return serialize();
    }
    offer_large_blob(blob, serialize)
}

#[inline(never)]
fn offer_large_blob<R>(blob: &Bytes, serialize: impl FnOnce() -> R) -> R {
    /// Puts the previous offer back, even when the serializer panics.
    struct Withdraw(Option<Bytes>);
    impl Drop for Withdraw {
        fn drop(&mut self) {
            let previous = self.0.take();
            let _ = OFFER.try_with(|o| *o.borrow_mut() = previous);
        }
    }
    let Ok(previous) = OFFER.try_with(|o| o.replace(Some(blob.clone()))) else {
        // This thread's locals are being destroyed: no offer, the blob is copied.
        return serialize();
    };
    let _withdraw = Withdraw(previous);
    serialize()
}

/// The offered blob, if `bytes` is exactly it.
fn offered(bytes: &[u8]) -> Option<Bytes> {
    OFFER
        .try_with(|o| {
            o.borrow()
                .as_ref()
                .filter(|b| b.as_ptr() == bytes.as_ptr() && b.len() == bytes.len())
                .cloned()
        })
        .ok()
        .flatten()
}

/// The buffers of one encoded message, in order.
#[derive(Clone, Default)]
struct Parts {
    first: Bytes,
    rest: Vec<Bytes>,
}

impl Parts {
    fn push(&mut self, b: Bytes) {
        if self.first.is_empty() && self.rest.is_empty() {
            self.first = b;
        } else if !b.is_empty() {
            self.rest.push(b);
        }
    }
}

/// Messages up to this long are kept inline (see [`Format::encode_message`]).
const SMALL: usize = 54;

/// A short message's bytes, inline.
#[derive(Clone, Copy)]
struct Small {
    len: u8,
    data: [u8; SMALL],
}

impl Default for Small {
    fn default() -> Self {
        Self {
            len: 0,
            data: [0; SMALL],
        }
    }
}

impl Small {
    fn bytes(&self) -> &[u8] {
        &self.data[..usize::from(self.len)]
    }
}

/// An encoded message as a connection sends it: a short one inline, a longer one in one
/// buffer or, when it holds large [`Blob`](crate::Blob)s, in several in order, so that a
/// blob goes to the socket from its own buffer instead of being copied into the message.
/// Made by [`Format::encode_message`], or from `Bytes`.
#[derive(Clone)]
pub struct Message(Repr);

#[derive(Clone)]
enum Repr {
    Small(Small),
    Parts(Parts),
}

impl Default for Message {
    fn default() -> Self {
        Self(Repr::Small(Small::default()))
    }
}

impl Message {
    /// The message's length in bytes.
    pub fn len(&self) -> usize {
        match &self.0 {
            Repr::Small(s) => usize::from(s.len),
            Repr::Parts(p) => p.first.len() + p.rest.iter().map(Bytes::len).sum::<usize>(),
        }
    }

    /// Whether the message has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its bytes, in order, in one slice or several.
    pub fn parts(&self) -> impl Iterator<Item = &[u8]> {
        let (first, rest): (&[u8], &[Bytes]) = match &self.0 {
            Repr::Small(s) => (s.bytes(), &[]),
            Repr::Parts(p) => (&p.first, &p.rest),
        };
        std::iter::once(first).chain(rest.iter().map(|b| &b[..]))
    }

    /// The message in one buffer (a copy when it is short or has several parts).
    pub fn into_bytes(self) -> Bytes {
        match self.0 {
            Repr::Small(s) => Bytes::copy_from_slice(s.bytes()),
            Repr::Parts(p) if p.rest.is_empty() => p.first,
            Repr::Parts(_) => {
                let mut all = BytesMut::with_capacity(self.len());
                for part in self.parts() {
                    all.extend_from_slice(part);
                }
                all.freeze()
            }
        }
    }

    /// The number of buffers it is in.
    fn part_count(&self) -> usize {
        match &self.0 {
            Repr::Small(_) => 1,
            Repr::Parts(p) => 1 + p.rest.len(),
        }
    }
}

impl From<Bytes> for Message {
    fn from(first: Bytes) -> Self {
        Self(Repr::Parts(Parts {
            first,
            rest: Vec::new(),
        }))
    }
}

impl From<Vec<u8>> for Message {
    fn from(v: Vec<u8>) -> Self {
        Bytes::from(v).into()
    }
}

impl std::fmt::Debug for Message {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Message({} bytes", self.len())?;
        if self.part_count() > 1 {
            write!(f, " in {} parts", self.part_count())?;
        }
        f.write_str(")")
    }
}

/// Stream batches are built in a `Vec`: its `push` is a store, where `BytesMut::put_u8`
/// is a call to `memcpy`, and postcard pushes field by field.
impl Sink for Vec<u8> {
    #[inline]
    fn push(&mut self, byte: u8) {
        Vec::push(self, byte);
    }

    #[inline]
    fn extend(&mut self, bytes: &[u8]) {
        if bytes.len() <= 10 {
            // Varints and short fields: stores beat a call to `memcpy`.
            for &b in bytes {
                Vec::push(self, b);
            }
        } else {
            self.extend_from_slice(bytes);
        }
    }
}

/// MessagePack's encoder output appended to a [`Sink`] directly, through `io::Write`.
struct Append<'a, S>(&'a mut S);

impl<S: Sink> std::io::Write for Append<'_, S> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
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

/// Compresses `message` with `c`, or returns `None` when that would not make it smaller.
/// zstd reads a message of several parts in place, through its streaming encoder (the frame
/// still declares its content size), and stops once its output is as long as the message;
/// LZ4's block format needs the parts in one buffer.
pub(crate) fn compress_message(c: Compression, message: &Message) -> Option<Vec<u8>> {
    if message.part_count() == 1 {
        return compress(c, message.parts().next().expect("one part"));
    }
    if c != Compression::Zstd {
        return compress(c, &message.clone().into_bytes());
    }
    let len = message.len();
    let mut encoder = zstd::stream::write::Encoder::new(Vec::new(), 1).ok()?;
    encoder.include_contentsize(true).ok()?;
    encoder.set_pledged_src_size(Some(len as u64)).ok()?;
    for part in message.parts() {
        for chunk in part.chunks(1 << 20) {
            encoder.write_all(chunk).ok()?;
            if encoder.get_ref().len() >= len {
                // Already as long as the message: it cannot end up smaller.
                return None;
            }
        }
    }
    let out = encoder.finish().ok()?;
    (out.len() < len).then_some(out)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `len` bytes that no codec shrinks (a linear congruential sequence from `seed`).
    fn noise(len: usize, seed: u32) -> Vec<u8> {
        let mut x = seed;
        (0..len)
            .map(|_| {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (x >> 24) as u8
            })
            .collect()
    }

    #[test]
    fn short_messages_are_inline_and_longer_ones_move_to_the_arena() {
        for len in [0, 1, SMALL - 2, SMALL - 1, SMALL, SMALL + 1, 5000] {
            // A string of `len` bytes encodes as its length (1 or 2 bytes) and the bytes.
            let value = "x".repeat(len);
            for format in [Format::Postcard, Format::MessagePack] {
                let message = format.encode_message(&value).unwrap();
                let whole = format.encode(&value).unwrap();
                assert_eq!(message.len(), whole.len());
                assert_eq!(message.clone().into_bytes(), whole, "{format:?}, {len}");
                assert_eq!(
                    matches!(message.0, Repr::Small(_)),
                    whole.len() <= SMALL,
                    "{format:?}, {len}"
                );
                assert_eq!(format.decode::<String>(&whole).unwrap(), value);
            }
        }
        // A failed encoding leaves nothing behind for the next message.
        struct Fails;
        impl Serialize for Fails {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                use serde::ser::{Error, SerializeTuple};
                let mut t = s.serialize_tuple(2)?;
                t.serialize_element(&"y".repeat(100))?;
                Err(S::Error::custom("no"))
            }
        }
        assert!(Format::Postcard.encode_message(&Fails).is_err());
        let next = Format::Postcard.encode_message(&"z".repeat(100)).unwrap();
        assert_eq!(
            next.into_bytes(),
            Format::Postcard.encode(&"z".repeat(100)).unwrap()
        );
    }

    #[test]
    fn a_panicking_serializer_leaves_nothing_for_the_next_message() {
        struct Panics;
        impl Serialize for Panics {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                use serde::ser::SerializeTuple;
                let mut t = s.serialize_tuple(2)?;
                t.serialize_element(&"y".repeat(100))?;
                panic!("the serializer fails")
            }
        }
        for message in [true, false] {
            let caught = std::panic::catch_unwind(|| {
                if message {
                    drop(Format::Postcard.encode_message(&Panics));
                } else {
                    drop(Format::Postcard.encode(&Panics));
                }
            });
            assert!(caught.is_err());
            let value = "z".repeat(100);
            let whole = postcard::to_allocvec(&value).unwrap();
            assert_eq!(Format::Postcard.encode(&value).unwrap(), whole);
            let next = Format::Postcard.encode_message(&value).unwrap();
            assert_eq!(next.into_bytes(), whole);
        }
    }

    #[test]
    fn large_blobs_are_parts_of_their_own_and_the_message_decodes_whole() {
        use crate::Blob;
        let big =
            |n: usize, seed: u8| Blob::from((0..n).map(|i| seed ^ i as u8).collect::<Vec<u8>>());
        type Value = (Blob, u32, Blob, String, Blob);
        let value: Value = (
            big(SPLICE_FROM, 1),
            7,
            big(100_000, 2),
            "tail".to_owned(),
            big(SPLICE_FROM - 1, 3),
        );
        for format in [Format::Postcard, Format::MessagePack] {
            let message = format.encode_message(&value).unwrap();
            let parts: Vec<&[u8]> = message.parts().collect();
            // Head, first blob, the bytes between, second blob, the rest (the short blob copied).
            assert_eq!(parts.len(), 5, "{format:?}: {message:?}");
            assert_eq!(
                parts[1].as_ptr(),
                value.0.as_ptr(),
                "{format:?}: not copied"
            );
            assert_eq!(
                parts[3].as_ptr(),
                value.2.as_ptr(),
                "{format:?}: not copied"
            );
            let whole = format.encode(&value).unwrap();
            assert_eq!(message.len(), whole.len());
            assert_eq!(message.clone().into_bytes(), whole, "{format:?}");
            assert_eq!(format.decode::<Value>(&whole).unwrap(), value);
        }
    }

    #[test]
    fn a_message_of_several_parts_compresses_to_what_decompresses_whole() {
        let text: Vec<u8> = b"coherent ".iter().copied().cycle().take(300_000).collect();
        let value = (
            crate::Blob::from(text.clone()),
            5u8,
            crate::Blob::from(text),
        );
        let message = Format::Postcard.encode_message(&value).unwrap();
        assert!(message.parts().count() > 1);
        let whole = message.clone().into_bytes();
        for c in [Compression::Lz4, Compression::Zstd] {
            let packed = compress_message(c, &message).expect("text compresses");
            assert!(packed.len() < whole.len() / 10, "{c:?}");
            let back = decompress(c, Bytes::from(packed), 1 << 20).unwrap();
            assert_eq!(back, whole, "{c:?}");
        }
        // Bytes that do not compress are sent as they are.
        let message = Format::Postcard
            .encode_message(&(crate::Blob::from(noise(200_000, 1)), 1u8))
            .unwrap();
        assert!(compress_message(Compression::Zstd, &message).is_none());
        assert!(compress_message(Compression::Lz4, &message).is_none());
    }

    #[test]
    fn bytes_that_do_not_shrink_before_bytes_that_do_still_compress() {
        let value = (
            crate::Blob::from(noise(2 << 20, 7)),
            7u8,
            crate::Blob::from(vec![0u8; 8 << 20]),
        );
        let message = Format::Postcard.encode_message(&value).unwrap();
        assert!(message.parts().count() > 1);
        let packed = compress_message(Compression::Zstd, &message).expect("the zeros shrink");
        assert!(packed.len() < message.len() / 3);
        let back = decompress(Compression::Zstd, Bytes::from(packed), 16 << 20).unwrap();
        assert_eq!(back, message.into_bytes());
    }

    #[test]
    fn a_panicking_serializer_withdraws_the_offer() {
        let blob = crate::Blob::from(vec![1u8; SPLICE_FROM]);
        let caught = std::panic::catch_unwind(|| {
            offer_blob(&blob.clone().into_bytes(), || {
                panic!("the serializer fails")
            })
        });
        assert!(caught.is_err());
        assert!(
            OFFER.with(|o| o.borrow().is_none()),
            "no buffer stays pinned"
        );
    }

    #[test]
    fn a_blob_serialized_by_another_serializer_leaves_no_offer_behind() {
        let blob = crate::Blob::from(vec![4u8; SPLICE_FROM * 2]);
        let encoded = postcard::to_allocvec(&blob).unwrap();
        assert_eq!(postcard::from_bytes::<crate::Blob>(&encoded).unwrap(), blob);
        assert!(OFFER.with(|o| o.borrow().is_none()));
        // Nor does `encode`, which copies every blob.
        let whole = Format::Postcard.encode(&blob).unwrap();
        assert_eq!(whole.len(), encoded.len());
        assert!(OFFER.with(|o| o.borrow().is_none()));
    }

    #[test]
    fn messages_sharing_a_chunk_each_decode_to_their_own_value() {
        for format in [Format::Postcard, Format::MessagePack] {
            // Sizes around and beyond the chunk and the room left in it.
            let values: Vec<(u32, Vec<u8>)> = (0..2_000u32)
                .map(|i| {
                    (
                        i,
                        vec![i as u8; [0, 1, 200, 300, 5_000, 40_000][i as usize % 6]],
                    )
                })
                .collect();
            let encoded: Vec<Bytes> = values.iter().map(|v| format.encode(v).unwrap()).collect();
            for (value, bytes) in values.iter().zip(&encoded) {
                assert_eq!(&format.decode::<(u32, Vec<u8>)>(bytes).unwrap(), value);
            }
        }
    }
}
