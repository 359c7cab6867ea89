//! What a host process records: every write that returned and every read, with the times
//! they started and ended on the machine's monotonic clock (one clock for every process
//! of the machine), in a file of fixed-size records that a killed process leaves readable
//! up to its last flush.

use std::io::{self, Write as _};

/// Nanoseconds on `CLOCK_MONOTONIC`: the same clock in every process of the machine, and
/// unaffected by a skewed wall clock.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

/// A command that returned: after it, every read of `key` on any host sees `version` or
/// a later one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Write {
    /// The register.
    pub key: u32,
    /// The version it wrote (versions of one key grow in commit order).
    pub version: i64,
    /// When the call began.
    pub start: u64,
    /// When it returned.
    pub end: u64,
}

/// A read of a register on a host (through its cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Read {
    /// The register.
    pub key: u32,
    /// The version it answered.
    pub seen: i64,
    /// When the call began.
    pub start: u64,
    /// When it answered.
    pub end: u64,
    /// Which reader of the host (a task).
    pub reader: u32,
}

/// One host process's history.
#[derive(Debug, Clone, Default)]
pub struct History {
    /// The host's id (in the log).
    pub host: String,
    /// Its writes that returned.
    pub writes: Vec<Write>,
    /// Its reads that answered a value.
    pub reads: Vec<Read>,
}

const WRITE: u8 = b'W';
const READ: u8 = b'R';
/// Bytes of one record: a tag, then five little-endian fields.
pub const RECORD: usize = 1 + 4 + 8 + 8 + 8 + 4;

/// Appends one record.
pub fn encode_write(out: &mut impl io::Write, w: &Write) -> io::Result<()> {
    let mut b = [0u8; RECORD];
    b[0] = WRITE;
    b[1..5].copy_from_slice(&w.key.to_le_bytes());
    b[5..13].copy_from_slice(&w.version.to_le_bytes());
    b[13..21].copy_from_slice(&w.start.to_le_bytes());
    b[21..29].copy_from_slice(&w.end.to_le_bytes());
    out.write_all(&b)
}

/// Appends one record.
pub fn encode_read(out: &mut impl io::Write, r: &Read) -> io::Result<()> {
    let mut b = [0u8; RECORD];
    b[0] = READ;
    b[1..5].copy_from_slice(&r.key.to_le_bytes());
    b[5..13].copy_from_slice(&r.seen.to_le_bytes());
    b[13..21].copy_from_slice(&r.start.to_le_bytes());
    b[21..29].copy_from_slice(&r.end.to_le_bytes());
    b[29..33].copy_from_slice(&r.reader.to_le_bytes());
    out.write_all(&b)
}

/// A history from its file's bytes. A torn last record (the process was killed while
/// writing it) is ignored; any other malformed record is an error.
pub fn decode(host: &str, bytes: &[u8]) -> io::Result<History> {
    let mut h = History {
        host: host.to_owned(),
        ..History::default()
    };
    for b in bytes.chunks_exact(RECORD) {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        match b[0] {
            WRITE => h.writes.push(Write {
                key: u32_at(1),
                version: u64_at(5) as i64,
                start: u64_at(13),
                end: u64_at(21),
            }),
            READ => h.reads.push(Read {
                key: u32_at(1),
                seen: u64_at(5) as i64,
                start: u64_at(13),
                end: u64_at(21),
                reader: u32_at(29),
            }),
            tag => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("history of {host}: a record tagged {tag:#x}"),
                ))
            }
        }
    }
    Ok(h)
}

/// Records of a host process, buffered and written to its file by whoever calls
/// [`flush`](Self::flush) (a task every few milliseconds, and at the end).
pub struct Recorder {
    buffer: std::sync::Mutex<Vec<u8>>,
    file: std::sync::Mutex<std::fs::File>,
}

impl Recorder {
    /// Records into `path` (created or truncated).
    pub fn create(path: &std::path::Path) -> io::Result<Self> {
        Ok(Self {
            buffer: std::sync::Mutex::new(Vec::with_capacity(1 << 16)),
            file: std::sync::Mutex::new(std::fs::File::create(path)?),
        })
    }

    /// Records a write that returned.
    pub fn write(&self, w: &Write) {
        let _ = encode_write(&mut *self.buffer.lock().unwrap(), w);
    }

    /// Records a read.
    pub fn read(&self, r: &Read) {
        let _ = encode_read(&mut *self.buffer.lock().unwrap(), r);
    }

    /// Writes what is buffered to the file.
    pub fn flush(&self) -> io::Result<()> {
        let mut file = self.file.lock().unwrap();
        let taken = std::mem::take(&mut *self.buffer.lock().unwrap());
        file.write_all(&taken)?;
        file.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_a_torn_tail_is_ignored() {
        let mut out = Vec::new();
        let w = Write {
            key: 3,
            version: 7,
            start: 10,
            end: 20,
        };
        let r = Read {
            key: 3,
            seen: 7,
            start: 21,
            end: 22,
            reader: 1,
        };
        encode_write(&mut out, &w).unwrap();
        encode_read(&mut out, &r).unwrap();
        out.extend_from_slice(&[READ, 1, 2]);
        let h = decode("h", &out).unwrap();
        assert_eq!(h.writes, vec![w]);
        assert_eq!(h.reads, vec![r]);
        out[0] = b'X';
        assert!(decode("h", &out).is_err());
    }
}
