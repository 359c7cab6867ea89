//! `Blob`: bytes that a connection decodes without copying them. A `Blob` field of a
//! received message is a slice of the buffer the message arrived in, where a `Vec<u8>` or
//! a `bytes::Bytes` field is copied out of it.

use std::cell::RefCell;
use std::fmt;
use std::ops::{Deref, Range};

use bytes::Bytes;
use serde::de::{self, Deserialize, Deserializer, SeqAccess, Visitor};
use serde::{Serialize, Serializer};

thread_local! {
    /// The buffer being decoded on this thread, while `decode_in` runs.
    static SOURCE: RefCell<Option<Bytes>> = const { RefCell::new(None) };
}

/// Immutable bytes that serialize as a byte string and deserialize without a copy when
/// the connection decodes them: a `Blob` of 512 bytes or more then shares the received
/// buffer (as a [`Bytes`] slice) instead of owning a copy (shorter ones are cheaper to
/// copy). Use it for payloads: a 10 MB argument is then never copied on the receiving side,
/// and a `Blob` of 32 KiB or more in a call's arguments or a unary answer goes to the socket
/// from its own buffer instead of being copied into the message (stream items are encoded
/// into their batch, so a blob in one is copied there).
///
/// A blob of up to 22 bytes made from a `Vec<u8>` or decoded is kept inline, in the `Blob`
/// itself: no allocation to make or free it, no reference count to touch when it is cloned.
///
/// A `Blob` that is decoded some other way (e.g. `serde_json`) owns a copy. Holding a
/// decoded `Blob` keeps the buffer it came in alive; [`Blob::detach`] copies it out.
pub struct Blob(Repr);

/// The longest blob kept inline.
const INLINE: usize = 22;

enum Repr {
    Inline { len: u8, data: [u8; INLINE] },
    Shared(Bytes),
}

impl Blob {
    /// An empty blob.
    pub const fn new() -> Self {
        Self(Repr::Inline {
            len: 0,
            data: [0; INLINE],
        })
    }

    /// A copy of `bytes`: inline if short, else in a buffer of its own.
    #[inline(always)]
    fn copy_from(bytes: &[u8]) -> Self {
        if bytes.len() <= INLINE {
            Self(Repr::Inline {
                len: bytes.len() as u8,
                data: inline(bytes),
            })
        } else {
            Self(Repr::Shared(Bytes::copy_from_slice(bytes)))
        }
    }

    /// The blob as `Bytes` (no copy, except for a short blob kept inline).
    pub fn into_bytes(self) -> Bytes {
        match self.0 {
            Repr::Inline { len, data } => Bytes::copy_from_slice(&data[..usize::from(len)]),
            Repr::Shared(b) => b,
        }
    }

    /// A copy that shares no buffer with anything else.
    pub fn detach(&self) -> Self {
        Self::copy_from(self)
    }

    /// The shared buffer, if the blob is not inline.
    pub(crate) fn shared(&self) -> Option<&Bytes> {
        match &self.0 {
            Repr::Inline { .. } => None,
            Repr::Shared(b) => Some(b),
        }
    }
}

/// `bytes` (at most `INLINE` of them) padded with zeros, read as a few whole words that
/// overlap where `bytes` is not a multiple of their size. A byte-wise copy into the array
/// would be read back as wider words right after, which stalls the CPU on every short blob.
#[inline]
fn inline(bytes: &[u8]) -> [u8; INLINE] {
    let n = bytes.len();
    debug_assert!(n <= INLINE);
    let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let half = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    // The first 16 bytes as `lo`, the rest as `hi`.
    let (lo, hi): (u128, u64) = match n {
        0 => (0, 0),
        1..=3 => {
            let b = |i: usize| u32::from(bytes[i]) << (8 * i);
            (u128::from(b(0) | b(n / 2) | b(n - 1)), 0)
        }
        4..=7 => {
            // Shifted in 64 bits: by 32 at most, for 4 bytes, whose tail is their head.
            let tail = u64::from(half(n - 4)) >> (8 * (8 - n));
            (u128::from(u64::from(half(0)) | tail << 32), 0)
        }
        8..=15 => {
            let tail = u128::from(word(n - 8)) >> (8 * (16 - n));
            (u128::from(word(0)) | tail << 64, 0)
        }
        _ => {
            let lo = u128::from(word(0)) | u128::from(word(8)) << 64;
            (lo, (u128::from(word(n - 8)) >> (8 * (24 - n))) as u64)
        }
    };
    let mut data = [0; INLINE];
    data[..16].copy_from_slice(&lo.to_le_bytes());
    data[16..].copy_from_slice(&hi.to_le_bytes()[..INLINE - 16]);
    data
}

impl Clone for Blob {
    #[inline(always)]
    fn clone(&self) -> Self {
        fn plain<T: Copy>(_: &T) {}
        match &self.0 {
            Repr::Inline { len, data } => {
                // The inline form's fields are `Copy` (a field that is not fails here).
                plain(len);
                plain(data);
                // SAFETY: `Repr` is `Inline`, whose fields are all `Copy` (checked above):
                // plain bytes, no pointer, nothing to drop, so a bitwise copy of the `Repr`
                // is a clone of it; `Blob` holds nothing else (`Self(..)` names its one
                // field). Copied whole, in the value's own words, rather than field by field
                // through a temporary whose overlapping stores the next wide load cannot be
                // forwarded from (a stall on every clone).
                Self(unsafe { std::ptr::read(&self.0) })
            }
            Repr::Shared(b) => Self(Repr::Shared(b.clone())),
        }
    }
}

impl Default for Blob {
    fn default() -> Self {
        Self::new()
    }
}

impl Deref for Blob {
    type Target = [u8];

    #[inline]
    fn deref(&self) -> &[u8] {
        match &self.0 {
            Repr::Inline { len, data } => &data[..usize::from(*len)],
            Repr::Shared(b) => b,
        }
    }
}

impl AsRef<[u8]> for Blob {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl PartialEq for Blob {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for Blob {}

impl PartialOrd for Blob {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Blob {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (**self).cmp(&**other)
    }
}

impl std::hash::Hash for Blob {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (**self).hash(state);
    }
}

impl fmt::Debug for Blob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Blob({} bytes)", self.len())
    }
}

impl From<Bytes> for Blob {
    fn from(b: Bytes) -> Self {
        Self(Repr::Shared(b))
    }
}

impl From<Vec<u8>> for Blob {
    fn from(v: Vec<u8>) -> Self {
        if v.len() <= INLINE {
            Self::copy_from(&v)
        } else {
            Self(Repr::Shared(Bytes::from(v)))
        }
    }
}

impl From<&'static [u8]> for Blob {
    fn from(s: &'static [u8]) -> Self {
        Self(Repr::Shared(Bytes::from_static(s)))
    }
}

impl From<Blob> for Bytes {
    fn from(b: Blob) -> Self {
        b.into_bytes()
    }
}

impl Serialize for Blob {
    #[inline]
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // A large blob that a connection encodes is sent from its own buffer, not copied.
        match self.shared() {
            Some(b) => crate::codec::offer_blob(b, || s.serialize_bytes(b)),
            None => s.serialize_bytes(self),
        }
    }
}

impl<'de> Deserialize<'de> for Blob {
    /// Always inlined, as are the visitor and the copy: a blob that a call returns goes
    /// through memory, written in 16-byte halves, and a caller that reads it back in
    /// 8-byte words stalls where the processor cannot forward a half's upper word (AMD
    /// Zen); inlined into the deserializer, it takes fewer stores and reloads. An item of
    /// a stream of 1-byte blobs took about a quarter more processor time before.
    #[inline(always)]
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_bytes(BlobVisitor)
    }
}

/// Blobs shorter than this are copied even from a published buffer: sharing costs an
/// atomic increment on the buffer's reference count, which the connection's reader
/// touches from another thread, and that costs more than copying a few hundred bytes.
pub(crate) const SHARE_FROM: usize = 512;

struct BlobVisitor;

impl<'de> Visitor<'de> for BlobVisitor {
    type Value = Blob;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a byte string")
    }

    #[inline(always)]
    fn visit_borrowed_bytes<E: de::Error>(self, v: &'de [u8]) -> Result<Blob, E> {
        if v.len() < SHARE_FROM {
            return Ok(Blob::copy_from(v));
        }
        Ok(shared_slice(v).map_or_else(|| Blob::copy_from(v), Blob::from))
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Blob, E> {
        Ok(Blob::copy_from(v))
    }

    fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Blob, E> {
        Ok(Blob::from(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Blob, A::Error> {
        // Formats without a byte string type send a sequence of numbers. Its declared
        // length is a hint from the other side: never reserve more than a little up front.
        let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(b) = seq.next_element::<u8>()? {
            v.push(b);
        }
        Ok(Blob::from(v))
    }
}

/// `v` as a slice of the buffer being decoded on this thread, if it lies within it.
fn shared_slice(v: &[u8]) -> Option<Bytes> {
    SOURCE
        .try_with(|source| {
            let source = source.try_borrow().ok()?;
            let src = source.as_ref()?;
            let (start, end) = (src.as_ptr() as usize, src.as_ptr() as usize + src.len());
            let (v_start, v_end) = (v.as_ptr() as usize, v.as_ptr() as usize + v.len());
            (v_start >= start && v_end <= end && !v.is_empty())
                .then(|| src.slice(v_start - start..v_end - start))
        })
        .ok()
        .flatten()
}

/// Runs `decode` on `src[range]` with `src` published to this thread's [`Blob`]s, so that
/// the blobs it decodes share `src`. `src` is moved in and back out, not cloned: no
/// reference count changes unless a blob is made.
#[inline]
pub(crate) fn decode_in<T>(
    src: &mut Bytes,
    range: Range<usize>,
    decode: impl FnOnce(&[u8]) -> T,
) -> T {
    if range.len() < SHARE_FROM {
        // No blob in so few bytes would share them: no need to publish.
        return decode(&src[range]);
    }
    SOURCE.with(|source| {
        let Ok(mut slot) = source.try_borrow_mut() else {
            // A decode inside a decode (a `Deserialize` impl that decodes a message):
            // the inner one copies its blobs.
            return decode(&src[range]);
        };
        let previous = slot.replace(std::mem::take(src));
        drop(slot);
        let out = {
            let slot = source.borrow();
            let bytes = slot.as_ref().expect("just published");
            decode(&bytes[range])
        };
        let mut slot = source.borrow_mut();
        *src = std::mem::replace(&mut *slot, previous).expect("still published");
        out
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blob_decoded_from_a_published_buffer_shares_it() {
        let encoded = postcard::to_allocvec(&(7u32, Blob::from(vec![5u8; 600]))).unwrap();
        let mut src = Bytes::from(encoded);
        let start = src.as_ptr() as usize;
        let len = src.len();
        let (n, blob): (u32, Blob) =
            decode_in(&mut src, 0..len, |b| postcard::from_bytes(b).unwrap());
        assert_eq!((n, &blob[..]), (7, &[5u8; 600][..]));
        let at = blob.as_ptr() as usize;
        assert!(
            at > start && at < start + len,
            "the blob points into the buffer"
        );
        assert_eq!(src.len(), len, "the buffer came back");
    }

    #[test]
    fn a_short_blob_is_copied_even_from_a_published_buffer() {
        let encoded = postcard::to_allocvec(&Blob::from(vec![5u8; 20])).unwrap();
        let mut src = Bytes::from(encoded);
        let (start, len) = (src.as_ptr() as usize, src.len());
        let blob: Blob = decode_in(&mut src, 0..len, |b| postcard::from_bytes(b).unwrap());
        assert_eq!(&blob[..], &[5u8; 20]);
        let at = blob.as_ptr() as usize;
        assert!(at < start || at >= start + len, "the blob owns a copy");
    }

    #[test]
    fn a_short_blob_is_kept_inline_and_equals_a_shared_one() {
        use std::hash::{BuildHasher, RandomState};
        let inline = Blob::from(vec![3u8; INLINE]);
        assert!(inline.shared().is_none());
        let shared = Blob::from(Bytes::from(vec![3u8; INLINE]));
        assert!(shared.shared().is_some());
        assert_eq!(inline, shared);
        let hasher = RandomState::new();
        assert_eq!(hasher.hash_one(&inline), hasher.hash_one(&shared));
        assert_eq!(inline.clone().into_bytes(), shared.clone().into_bytes());
        assert!(Blob::from(vec![3u8; INLINE + 1]).shared().is_some());
        assert!(Blob::new().is_empty());
        assert!(Blob::from(vec![1u8]) > Blob::from(vec![0u8; 5]));

        for len in 0..=INLINE {
            let bytes: Vec<u8> = (1..=len as u8).collect();
            let blob = Blob::from(bytes.clone());
            assert_eq!(&blob[..], &bytes[..], "{len} bytes");
            let Repr::Inline { data, .. } = blob.0 else {
                panic!("{len} bytes are inline")
            };
            assert!(
                data[len..].iter().all(|&b| b == 0),
                "zeros after {len} bytes"
            );
        }

        // Decoded: inline up to `INLINE` bytes, whatever the buffer.
        for len in [0, 1, INLINE, INLINE + 1] {
            let encoded = postcard::to_allocvec(&Blob::from(vec![8u8; len])).unwrap();
            let mut src = Bytes::from(encoded);
            let n = src.len();
            let blob: Blob = decode_in(&mut src, 0..n, |b| postcard::from_bytes(b).unwrap());
            assert_eq!(&blob[..], &vec![8u8; len][..]);
            assert_eq!(blob.shared().is_none(), len <= INLINE, "{len} bytes");
        }
    }

    #[test]
    fn a_clone_holds_the_same_bytes_and_shares_only_a_shared_buffer() {
        for len in [0, 1, 7, 8, 15, 16, INLINE] {
            let bytes: Vec<u8> = (1..=len as u8).collect();
            let blob = Blob::from(bytes.clone());
            let copy = blob.clone();
            drop(blob);
            assert_eq!(&copy[..], &bytes[..], "{len} bytes");
            assert!(copy.shared().is_none(), "{len} bytes stay inline");
        }
        let shared = Blob::from(Bytes::from(vec![4u8; 600]));
        let copy = shared.clone();
        assert_eq!(
            copy.as_ptr(),
            shared.as_ptr(),
            "the buffer is shared, not copied"
        );
        drop(shared);
        assert_eq!(&copy[..], &[4u8; 600][..]);
    }

    #[test]
    fn a_blob_decoded_elsewhere_owns_a_copy() {
        let encoded = postcard::to_allocvec(&Blob::from(vec![9u8; 4])).unwrap();
        let blob: Blob = postcard::from_bytes(&encoded).unwrap();
        assert_eq!(&blob[..], &[9u8; 4]);
        let json: Blob = serde_json::from_str("[1,2]").unwrap();
        assert_eq!(&json[..], &[1u8, 2]);
    }
}
