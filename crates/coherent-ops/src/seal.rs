//! Seals: a MAC on every message the hosts of a cluster send each other through the
//! notifier (notices, acknowledgements, the rejoin's hellos and welcomes, pings,
//! farewells, the change feed's hints), under a key the cluster keeps in its database.
//!
//! The notifier is not the cluster's own: on PostgreSQL any role that can connect may
//! `NOTIFY` on any channel (and `LISTEN` to it), and on NATS any client the server lets in
//! may publish on the hosts' subjects. Unsealed, such a stranger could acknowledge an
//! operation in a host's name (its command returns before that host invalidated: a read
//! there after the answer is stale), welcome a rejoining host before its peers did, say
//! that a live host stopped (no longer waited for), or extend a host's lease with a ping.
//! Sealed, a message counts only when its MAC checks out under the key, which only the
//! roles that can read the cluster's `coherent_secrets` table know.
//!
//! A sealed message is the message's JSON with one more field at its end:
//! `{...,"mac":"<32 hex digits>"}`. The MAC (HMAC-SHA-256, the first 128 bits) is of the
//! JSON as it was before the field went in, byte for byte: nothing is re-serialized to
//! check it, and a release that does not know seals reads the message as before (serde
//! ignores the field).

use hmac::{KeyInit, Mac};

type Hmac = hmac::Hmac<sha2::Sha256>;

/// What a seal adds to a message: `,"mac":"` (8 bytes), 32 hex digits, `"` (the closing
/// `}` was there already).
pub(crate) const SEAL_LEN: usize = 8 + TAG_HEX + 1;

/// Hex digits of a tag: 128 bits.
const TAG_HEX: usize = 32;

const FIELD: &[u8] = b",\"mac\":\"";

/// The key's bytes taken, so that a MAC of this and of any other use of the key differ.
const CONTEXT: &[u8] = b"coherent-ops seal v1\0";

/// Seals and checks the cluster's messages under its key. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Seal {
    /// Keyed, the context already in: cloned for each message.
    keyed: std::sync::Arc<Hmac>,
}

/// What [`Seal::open`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Opened {
    /// Sealed under this cluster's key.
    Sealed,
    /// Without a seal (a release before seals, or a stranger).
    Unsealed,
    /// A seal that does not check out: forged, altered, or of another cluster's key.
    Forged,
}

impl std::fmt::Debug for Seal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Seal(..)")
    }
}

impl Seal {
    pub(crate) fn new(key: &[u8]) -> Self {
        let mut keyed = <Hmac as KeyInit>::new_from_slice(key).expect("HMAC takes any key");
        keyed.update(CONTEXT);
        Self {
            keyed: std::sync::Arc::new(keyed),
        }
    }

    /// Seals a message's JSON (an object: it ends with `}`) where it lies.
    pub(crate) fn seal(&self, json: &mut Vec<u8>) {
        let end = self.end(json);
        json.pop();
        json.extend_from_slice(&end);
    }

    /// [`seal`](Self::seal) for a message held as text.
    pub(crate) fn seal_string(&self, json: &mut String) {
        let end = self.end(json.as_bytes());
        json.pop();
        json.extend(end.iter().map(|&b| char::from(b)));
    }

    /// What takes the place of `json`'s closing `}`: the seal's field, then the `}`.
    fn end(&self, json: &[u8]) -> [u8; SEAL_LEN + 1] {
        debug_assert_eq!(json.last(), Some(&b'}'), "a JSON object");
        let mut mac = Hmac::clone(&self.keyed);
        mac.update(json);
        let tag = mac.finalize().into_bytes();
        let mut end = [0u8; SEAL_LEN + 1];
        end[..FIELD.len()].copy_from_slice(FIELD);
        hex_into(
            &tag[..TAG_HEX / 2],
            &mut end[FIELD.len()..FIELD.len() + TAG_HEX],
        );
        end[SEAL_LEN - 1..].copy_from_slice(b"\"}");
        end
    }

    /// Whether `payload` is sealed under this key. The payload is read as it is (the seal's
    /// field among the others): a check never copies it.
    pub(crate) fn open(&self, payload: &[u8]) -> Opened {
        let Some(cut) = payload.len().checked_sub(SEAL_LEN + 1) else {
            return Opened::Unsealed;
        };
        let (body, tail) = payload.split_at(cut);
        let Some(hex) = tail
            .strip_prefix(FIELD)
            .and_then(|t| t.strip_suffix(b"\"}"))
        else {
            return Opened::Unsealed;
        };
        let mut tag = [0u8; TAG_HEX / 2];
        for (i, pair) in hex.chunks_exact(2).enumerate() {
            let (Some(hi), Some(lo)) = (unhex(pair[0]), unhex(pair[1])) else {
                return Opened::Forged;
            };
            tag[i] = hi << 4 | lo;
        }
        let mut mac = Hmac::clone(&self.keyed);
        mac.update(body);
        mac.update(b"}");
        // In constant time.
        match mac.verify_truncated_left(&tag) {
            Ok(()) => Opened::Sealed,
            Err(_) => Opened::Forged,
        }
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn unhex(d: u8) -> Option<u8> {
    match d {
        b'0'..=b'9' => Some(d - b'0'),
        b'a'..=b'f' => Some(d - b'a' + 10),
        _ => None,
    }
}

/// `bytes` as lowercase hex digits into `out` (twice as long).
fn hex_into(bytes: &[u8], out: &mut [u8]) {
    for (b, pair) in bytes.iter().zip(out.chunks_exact_mut(2)) {
        pair[0] = HEX[usize::from(b >> 4)];
        pair[1] = HEX[usize::from(b & 15)];
    }
}

/// A new key for a cluster: 32 random bytes of `rand`'s thread generator (a CSPRNG
/// seeded by the operating system), as 64 hex digits.
pub(crate) fn new_key() -> String {
    let bytes: [u8; 32] = rand::random();
    let mut hex = [0u8; 64];
    hex_into(&bytes, &mut hex);
    hex.iter().map(|&b| char::from(b)).collect()
}

#[cfg(test)]
mod tests {
    use super::{Opened, Seal, SEAL_LEN};
    use crate::host::Ack;

    #[test]
    fn a_sealed_message_opens_and_reads_as_before() {
        let seal = Seal::new(b"the cluster's key");
        let ack = Ack {
            from: "host-1".into(),
            ids: vec![7, 8],
            ..Ack::default()
        };
        let json = serde_json::to_vec(&ack).unwrap();
        let mut sealed = json.clone();
        seal.seal(&mut sealed);
        assert_eq!(sealed.len(), json.len() + SEAL_LEN);
        assert_eq!(seal.open(&sealed), Opened::Sealed);
        // A reader that knows nothing of seals (serde ignores the field) reads the same.
        let read: Ack = serde_json::from_slice(&sealed).unwrap();
        assert_eq!((read.from.as_str(), read.ids), ("host-1", vec![7, 8]));
        assert_eq!(seal.open(&json), Opened::Unsealed);
        let mut text = String::from_utf8(json).unwrap();
        seal.seal_string(&mut text);
        assert_eq!(text.as_bytes(), sealed);
    }

    /// Any byte changed, the seal cut short or moved, another key: not sealed by this one.
    #[test]
    fn an_altered_message_does_not_open() {
        let seal = Seal::new(b"k1");
        let mut sealed = br#"{"from":"b","ids":[3]}"#.to_vec();
        seal.seal(&mut sealed);
        for i in 0..sealed.len() {
            for flip in [1u8, 0x20, 0x80] {
                let mut altered = sealed.clone();
                altered[i] ^= flip;
                assert_ne!(seal.open(&altered), Opened::Sealed, "byte {i} ^ {flip}");
            }
        }
        for cut in 0..sealed.len() {
            assert_ne!(seal.open(&sealed[..cut]), Opened::Sealed, "cut at {cut}");
        }
        assert_eq!(Seal::new(b"k2").open(&sealed), Opened::Forged);
        let upper = String::from_utf8(sealed.clone()).unwrap().to_uppercase();
        assert_ne!(seal.open(upper.as_bytes()), Opened::Sealed);
        assert_eq!(seal.open(b""), Opened::Unsealed);
        assert_eq!(seal.open(b"}"), Opened::Unsealed);
    }

    #[test]
    fn keys_are_new_each_time() {
        let (a, b) = (super::new_key(), super::new_key());
        assert_eq!(a.len(), 64);
        assert_ne!(a, b);
    }
}
