//! A decoder of PostgreSQL's `pgoutput` messages, protocol version 1: the logical
//! replication stream of a publication, one message per row of
//! `pg_logical_slot_peek_binary_changes`.
//!
//! The messages are PostgreSQL's own ("Logical Replication Message Formats" in its
//! documentation); the decoder reads the ones a version-1 stream of a publication carries
//! (`Begin`, `Commit`, `Origin`, `Relation`, `Type`, `Insert`, `Update`, `Delete`,
//! `Truncate`, and `Message` when asked for) and refuses anything else with an error: it
//! reads bytes that the database sent, but a decoder that panics or allocates what a length
//! field claims is one a malformed stream could take down, so every length is checked
//! against the bytes left and against the named limits below (fuzzed: `fuzz/fuzz_targets/
//! pgoutput.rs`). Values stay borrowed from the message: nothing is copied until a change is
//! kept.

use std::fmt;

/// PostgreSQL's limit on the columns of a table (`MaxHeapAttributeNumber`): a relation or a
/// tuple claiming more is refused.
pub const MAX_COLUMNS: usize = 1_600;

/// A message that does not decode: what was wrong, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError {
    /// The byte offset in the message where decoding stopped.
    pub at: usize,
    /// What was expected there.
    pub what: &'static str,
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pgoutput message: {} at byte {}", self.what, self.at)
    }
}

impl std::error::Error for DecodeError {}

/// One column's value in a tuple, as pgoutput sends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value<'a> {
    /// SQL `NULL`.
    Null,
    /// A TOASTed value that did not change (an update that left it alone): not sent.
    Unchanged,
    /// The value in PostgreSQL's text format.
    Text(&'a [u8]),
    /// The value in binary format (only when the stream was asked for it).
    Binary(&'a [u8]),
}

/// A tuple: the values of a row, one per column of its relation, in column order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tuple<'a>(pub Vec<Value<'a>>);

/// A column of a relation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column<'a> {
    /// Part of the replica identity (the primary key, by default): sent in the old image of
    /// an update that changed it, and of every delete.
    pub key: bool,
    /// The column's name.
    pub name: &'a str,
    /// The oid of its type.
    pub type_oid: u32,
    /// Its type modifier (`-1`: none).
    pub type_modifier: i32,
}

/// A message of the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message<'a> {
    /// A transaction's first message.
    Begin {
        /// The LSN of the transaction's commit record.
        final_lsn: u64,
        /// Microseconds since 2000-01-01 (PostgreSQL's epoch).
        timestamp: i64,
        /// The transaction's id.
        xid: u32,
    },
    /// A transaction's last message.
    Commit {
        /// Unused by PostgreSQL so far.
        flags: u8,
        /// The LSN of the commit record.
        commit_lsn: u64,
        /// The LSN just past the commit record: where a slot stands once this transaction is
        /// consumed.
        end_lsn: u64,
        /// Microseconds since 2000-01-01.
        timestamp: i64,
    },
    /// The origin of a transaction replicated from elsewhere.
    Origin {
        /// The LSN of the commit on the origin.
        lsn: u64,
        /// The origin's name.
        name: &'a str,
    },
    /// A relation's description, sent before its first change in a stream.
    Relation {
        /// The relation's id (its oid): what changes name it by.
        id: u32,
        /// Its schema.
        namespace: &'a str,
        /// Its name.
        name: &'a str,
        /// `d` default (the primary key), `n` nothing, `f` full, `i` an index.
        replica_identity: u8,
        /// Its columns, in order.
        columns: Vec<Column<'a>>,
    },
    /// A type's description.
    Type {
        /// The type's oid.
        oid: u32,
        /// Its schema.
        namespace: &'a str,
        /// Its name.
        name: &'a str,
    },
    /// A row inserted.
    Insert {
        /// The relation's id.
        relation: u32,
        /// The new row.
        new: Tuple<'a>,
    },
    /// A row updated.
    Update {
        /// The relation's id.
        relation: u32,
        /// The old image: its key columns (`K`, when the key changed) or the whole row
        /// (`O`, with `REPLICA IDENTITY FULL`); absent when the key did not change.
        old: Option<Tuple<'a>>,
        /// The row after the update.
        new: Tuple<'a>,
    },
    /// A row deleted.
    Delete {
        /// The relation's id.
        relation: u32,
        /// The key columns, or the whole row with `REPLICA IDENTITY FULL`.
        old: Tuple<'a>,
    },
    /// Tables truncated.
    Truncate {
        /// 1: `CASCADE`; 2: `RESTART IDENTITY`.
        options: u8,
        /// The relations' ids.
        relations: Vec<u32>,
    },
    /// A message written with `pg_logical_emit_message` (when the stream asked for them).
    Message {
        /// Written in a transaction (else at once).
        transactional: bool,
        /// Its LSN.
        lsn: u64,
        /// The prefix it was written with.
        prefix: &'a str,
        /// Its bytes.
        content: &'a [u8],
    },
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn fail<T>(&self, what: &'static str) -> Result<T, DecodeError> {
        Err(DecodeError { at: self.at, what })
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
        match self.bytes.get(self.at..).and_then(|rest| rest.get(..n)) {
            Some(bytes) => {
                self.at += n;
                Ok(bytes)
            }
            None => self.fail(what),
        }
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(self.take(1, what)?[0])
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        let b = self.take(2, what)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        let b = self.take(4, what)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        let b = self.take(8, what)?;
        let mut a = [0; 8];
        a.copy_from_slice(b);
        Ok(u64::from_be_bytes(a))
    }

    /// A NUL-terminated string, in UTF-8 (a database whose encoding is not is refused here).
    fn str(&mut self, what: &'static str) -> Result<&'a str, DecodeError> {
        let rest = self.bytes.get(self.at..).unwrap_or_default();
        let Some(end) = rest.iter().position(|&b| b == 0) else {
            return self.fail(what);
        };
        let Ok(s) = std::str::from_utf8(&rest[..end]) else {
            return self.fail("a name in UTF-8");
        };
        self.at += end + 1;
        Ok(s)
    }

    fn columns(&mut self) -> Result<usize, DecodeError> {
        let n = self.u16("a column count")? as usize;
        if n > MAX_COLUMNS {
            return self.fail("at most 1,600 columns");
        }
        Ok(n)
    }

    fn tuple(&mut self) -> Result<Tuple<'a>, DecodeError> {
        let n = self.columns()?;
        // Each column takes at least a byte: a count beyond the bytes left is refused before
        // anything is allocated for it.
        if n > self.bytes.len() - self.at {
            return self.fail("a column per byte left at most");
        }
        let mut values = Vec::with_capacity(n);
        for _ in 0..n {
            values.push(match self.u8("a column's kind")? {
                b'n' => Value::Null,
                b'u' => Value::Unchanged,
                b't' => {
                    let len = self.u32("a value's length")? as usize;
                    Value::Text(self.take(len, "a value of its length")?)
                }
                b'b' => {
                    let len = self.u32("a value's length")? as usize;
                    Value::Binary(self.take(len, "a value of its length")?)
                }
                _ => return self.fail("a column kind of n, u, t or b"),
            });
        }
        Ok(Tuple(values))
    }

    fn end(self) -> Result<(), DecodeError> {
        if self.at == self.bytes.len() {
            Ok(())
        } else {
            self.fail("the end of the message")
        }
    }
}

/// Decodes one message (one row's `data` of `pg_logical_slot_peek_binary_changes`).
pub fn decode(bytes: &[u8]) -> Result<Message<'_>, DecodeError> {
    let mut r = Reader { bytes, at: 0 };
    let message = match r.u8("a message kind")? {
        b'B' => Message::Begin {
            final_lsn: r.u64("the final LSN")?,
            timestamp: r.u64("the commit time")? as i64,
            xid: r.u32("the transaction id")?,
        },
        b'C' => Message::Commit {
            flags: r.u8("the flags")?,
            commit_lsn: r.u64("the commit LSN")?,
            end_lsn: r.u64("the end LSN")?,
            timestamp: r.u64("the commit time")? as i64,
        },
        b'O' => Message::Origin {
            lsn: r.u64("the origin's LSN")?,
            name: r.str("the origin's name")?,
        },
        b'R' => {
            let id = r.u32("the relation id")?;
            let namespace = r.str("the namespace")?;
            let name = r.str("the relation's name")?;
            let replica_identity = r.u8("the replica identity")?;
            let n = r.columns()?;
            // A column takes at least 10 bytes (flags, an empty name, type, modifier).
            if n > (r.bytes.len() - r.at) / 10 {
                return r.fail("ten bytes per column at least");
            }
            let mut columns = Vec::with_capacity(n);
            for _ in 0..n {
                columns.push(Column {
                    key: r.u8("a column's flags")? & 1 == 1,
                    name: r.str("a column's name")?,
                    type_oid: r.u32("a column's type")?,
                    type_modifier: r.u32("a column's type modifier")? as i32,
                });
            }
            Message::Relation {
                id,
                namespace,
                name,
                replica_identity,
                columns,
            }
        }
        b'Y' => Message::Type {
            oid: r.u32("the type's oid")?,
            namespace: r.str("the type's namespace")?,
            name: r.str("the type's name")?,
        },
        b'I' => {
            let relation = r.u32("the relation id")?;
            if r.u8("N")? != b'N' {
                return r.fail("N before the new tuple");
            }
            Message::Insert {
                relation,
                new: r.tuple()?,
            }
        }
        b'U' => {
            let relation = r.u32("the relation id")?;
            let mut old = None;
            let mut tag = r.u8("K, O or N")?;
            if tag == b'K' || tag == b'O' {
                old = Some(r.tuple()?);
                tag = r.u8("N")?;
            }
            if tag != b'N' {
                return r.fail("N before the new tuple");
            }
            Message::Update {
                relation,
                old,
                new: r.tuple()?,
            }
        }
        b'D' => {
            let relation = r.u32("the relation id")?;
            match r.u8("K or O")? {
                b'K' | b'O' => {}
                _ => return r.fail("K or O before the old tuple"),
            }
            Message::Delete {
                relation,
                old: r.tuple()?,
            }
        }
        b'T' => {
            let n = r.u32("the relation count")? as usize;
            let options = r.u8("the options")?;
            if n > (r.bytes.len() - r.at) / 4 {
                return r.fail("four bytes per relation");
            }
            let mut relations = Vec::with_capacity(n);
            for _ in 0..n {
                relations.push(r.u32("a relation id")?);
            }
            Message::Truncate { options, relations }
        }
        b'M' => {
            let transactional = r.u8("the flags")? & 1 == 1;
            let lsn = r.u64("the message's LSN")?;
            let prefix = r.str("the prefix")?;
            let len = r.u32("the content's length")? as usize;
            let content = r.take(len, "content of its length")?;
            Message::Message {
                transactional,
                lsn,
                prefix,
                content,
            }
        }
        _ => return r.fail("a message kind of protocol version 1"),
    };
    r.end()?;
    Ok(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn relation() -> Vec<u8> {
        let mut m = vec![b'R'];
        m.extend(16384u32.to_be_bytes());
        m.extend(b"public\0users\0");
        m.push(b'd');
        m.extend(2u16.to_be_bytes());
        for (key, name, oid) in [(1u8, "id", 20u32), (0, "name", 25)] {
            m.push(key);
            m.extend(name.as_bytes());
            m.push(0);
            m.extend(oid.to_be_bytes());
            m.extend((-1i32).to_be_bytes());
        }
        m
    }

    fn tuple(values: &[Option<&str>]) -> Vec<u8> {
        let mut m = (values.len() as u16).to_be_bytes().to_vec();
        for v in values {
            match v {
                None => m.push(b'n'),
                Some(v) => {
                    m.push(b't');
                    m.extend((v.len() as u32).to_be_bytes());
                    m.extend(v.as_bytes());
                }
            }
        }
        m
    }

    #[test]
    fn a_relation_names_its_key_columns() {
        let bytes = relation();
        let Message::Relation {
            id,
            namespace,
            name,
            columns,
            ..
        } = decode(&bytes).unwrap()
        else {
            panic!("not a relation");
        };
        assert_eq!((id, namespace, name), (16384, "public", "users"));
        assert_eq!(columns.len(), 2);
        assert!(columns[0].key && !columns[1].key);
        assert_eq!((columns[0].name, columns[1].type_oid), ("id", 25));
    }

    #[test]
    fn an_update_carries_the_old_key_when_it_changed() {
        let mut m = vec![b'U'];
        m.extend(16384u32.to_be_bytes());
        m.push(b'K');
        m.extend(tuple(&[Some("7"), None]));
        m.push(b'N');
        m.extend(tuple(&[Some("8"), Some("Ann")]));
        let Message::Update { old, new, .. } = decode(&m).unwrap() else {
            panic!("not an update");
        };
        assert_eq!(old.unwrap().0[0], Value::Text(b"7"));
        assert_eq!(new.0, vec![Value::Text(b"8"), Value::Text(b"Ann")]);
    }

    #[test]
    fn every_cut_of_a_message_is_an_error_not_a_panic() {
        let mut update = vec![b'U'];
        update.extend(1u32.to_be_bytes());
        update.push(b'N');
        update.extend(tuple(&[Some("1"), None]));
        let mut truncate = vec![b'T'];
        truncate.extend(2u32.to_be_bytes());
        truncate.push(0);
        truncate.extend(1u32.to_be_bytes());
        truncate.extend(2u32.to_be_bytes());
        for whole in [relation(), update, truncate] {
            assert!(decode(&whole).is_ok());
            for cut in 0..whole.len() {
                assert!(decode(&whole[..cut]).is_err(), "cut at {cut}");
            }
            let mut longer = whole.clone();
            longer.push(0);
            assert!(decode(&longer).is_err());
        }
    }

    #[test]
    fn a_count_beyond_the_bytes_is_refused_before_anything_is_allocated() {
        let mut m = vec![b'T'];
        m.extend(u32::MAX.to_be_bytes());
        m.push(0);
        assert_eq!(decode(&m).unwrap_err().what, "four bytes per relation");
        let mut m = vec![b'I'];
        m.extend(1u32.to_be_bytes());
        m.push(b'N');
        m.extend(1600u16.to_be_bytes());
        assert!(decode(&m).is_err());
        let mut m = vec![b'I'];
        m.extend(1u32.to_be_bytes());
        m.push(b'N');
        m.extend(1601u16.to_be_bytes());
        assert_eq!(decode(&m).unwrap_err().what, "at most 1,600 columns");
    }
}
