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
/// A `Blob` that is decoded some other way (e.g. `serde_json`) owns a copy. Holding a
/// decoded `Blob` keeps the buffer it came in alive; [`Blob::detach`] copies it out.
#[derive(Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Blob(Bytes);

impl Blob {
    /// An empty blob.
    pub const fn new() -> Self {
        Self(Bytes::new())
    }

    /// The blob as `Bytes` (no copy).
    pub fn into_bytes(self) -> Bytes {
        self.0
    }

    /// A copy that shares no buffer with anything else.
    pub fn detach(&self) -> Self {
        Self(Bytes::copy_from_slice(&self.0))
    }
}

impl Deref for Blob {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl AsRef<[u8]> for Blob {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for Blob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Blob({} bytes)", self.0.len())
    }
}

impl From<Bytes> for Blob {
    fn from(b: Bytes) -> Self {
        Self(b)
    }
}

impl From<Vec<u8>> for Blob {
    fn from(v: Vec<u8>) -> Self {
        Self(Bytes::from(v))
    }
}

impl From<&'static [u8]> for Blob {
    fn from(s: &'static [u8]) -> Self {
        Self(Bytes::from_static(s))
    }
}

impl From<Blob> for Bytes {
    fn from(b: Blob) -> Self {
        b.0
    }
}

impl Serialize for Blob {
    #[inline]
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // A large blob that a connection encodes is sent from its own buffer, not copied.
        crate::codec::offer_blob(&self.0, || s.serialize_bytes(&self.0))
    }
}

impl<'de> Deserialize<'de> for Blob {
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

    fn visit_borrowed_bytes<E: de::Error>(self, v: &'de [u8]) -> Result<Blob, E> {
        if v.len() < SHARE_FROM {
            return Ok(Blob(Bytes::copy_from_slice(v)));
        }
        Ok(Blob(
            shared_slice(v).unwrap_or_else(|| Bytes::copy_from_slice(v)),
        ))
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Blob, E> {
        Ok(Blob(Bytes::copy_from_slice(v)))
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
    fn a_blob_decoded_elsewhere_owns_a_copy() {
        let encoded = postcard::to_allocvec(&Blob::from(vec![9u8; 4])).unwrap();
        let blob: Blob = postcard::from_bytes(&encoded).unwrap();
        assert_eq!(&blob[..], &[9u8; 4]);
        let json: Blob = serde_json::from_str("[1,2]").unwrap();
        assert_eq!(&json[..], &[1u8, 2]);
    }
}
