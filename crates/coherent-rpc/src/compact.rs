//! The default message format: postcard's wire format (postcard 1.x), encoded and decoded
//! here rather than through the `postcard` crate, because every call and every stream item
//! goes through it. The bytes are postcard's, bit for bit (the tests check both directions
//! against the crate); what differs is the cost: one-byte varints take a fast path, bytes
//! go straight into the connection's buffers, and nothing is copied through a temporary.
//!
//! The rules, as PROTOCOL.md section 4 states them: `u8`/`i8` are one raw byte, `bool`
//! one byte 0 or 1; the other integers are LEB128 varints, signed ones zigzagged first;
//! floats are little-endian IEEE 754; strings, byte strings and `char`s are a varint length
//! then the bytes; an `Option` is a byte 0 or 1 then the value; sequences and maps are a
//! varint count then their elements; structs and tuples are their fields in order; enum
//! variants are a varint index then their fields; unit values are nothing. Decoding accepts
//! what postcard accepts (including varints longer than needed), except values nested more
//! than `MAX_DEPTH` deep, more than `EMPTY_MAX` sequence or map elements that take no
//! bytes, and sequences and maps whose elements would take more memory than `memory_limit`
//! allows, and refuses the rest with an error, never a panic; trailing bytes after a value
//! are ignored, as postcard does.

use std::fmt;

use serde::de::{self, DeserializeSeed, IntoDeserializer, Visitor};
use serde::ser::{self, Serialize};

use crate::codec::Sink;

/// Why a value could not be encoded or decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Error {
    /// The input ended inside a value.
    End,
    /// A varint too long for its type, or whose last byte overflows it.
    BadVarint,
    /// A `bool` byte other than 0 or 1.
    BadBool,
    /// An `Option` tag other than 0 or 1.
    BadOption,
    /// A `char` that is not one UTF-8 character of at most 4 bytes.
    BadChar,
    /// A string that is not UTF-8.
    BadUtf8,
    /// A sequence or map whose length the encoder could not know up front.
    LengthUnknown,
    /// Values nested deeper than `MAX_DEPTH`: a recursive type fed hostile bytes would
    /// otherwise recurse until the stack overflows.
    TooDeep,
    /// More than `EMPTY_MAX` sequence or map elements that take no bytes (`()`, unit
    /// structs): a count of billions in a few bytes would otherwise keep the decoder busy
    /// for minutes.
    TooManyEmpty,
    /// Sequence or map elements that would take more memory than `memory_limit` allows
    /// for the input's length: `None`s of a large type take a byte each on the wire and
    /// their whole size in memory.
    TooMuchMemory,
    /// A self-describing request (`deserialize_any`, identifiers, ignored values), which
    /// this format cannot answer.
    NotSelfDescribing,
    /// An error raised by a `Serialize` or `Deserialize` implementation.
    Custom(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::End => "the input ended inside a value",
            Self::BadVarint => "a malformed varint",
            Self::BadBool => "a bool byte other than 0 or 1",
            Self::BadOption => "an option tag other than 0 or 1",
            Self::BadChar => "a malformed char",
            Self::BadUtf8 => "a string that is not UTF-8",
            Self::LengthUnknown => "a sequence or map of unknown length",
            Self::TooDeep => "values nested too deeply",
            Self::TooManyEmpty => "too many sequence elements that take no bytes",
            Self::TooMuchMemory => "sequences that would take too much memory once decoded",
            Self::NotSelfDescribing => "a type that needs a self-describing format",
            Self::Custom(m) => m,
        })
    }
}

impl std::error::Error for Error {}

impl ser::Error for Error {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Self::Custom(msg.to_string())
    }
}

impl de::Error for Error {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Self::Custom(msg.to_string())
    }
}

type Result<T, E = Error> = std::result::Result<T, E>;

/// Appends `value`'s encoding to `out`.
#[inline]
pub(crate) fn encode<T: Serialize + ?Sized, S: Sink>(value: &T, out: &mut S) -> Result<()> {
    value.serialize(&mut Encoder { out })
}

/// Decodes a `T` from the start of `bytes`.
#[inline]
pub(crate) fn decode<'de, T: de::Deserialize<'de>>(bytes: &'de [u8]) -> Result<T> {
    T::deserialize(&mut Decoder {
        rest: bytes,
        depth: 0,
        empty_left: EMPTY_MAX,
        memory_left: memory_limit(bytes.len()),
    })
}

/// How deeply values may nest (options, sequences, maps, tuples, structs and enum variants
/// each count one level), as serde_json's limit: postcard has none, a legitimate message
/// nests far less, and a recursive type's frames on a 2 MiB worker stack stay well within it.
const MAX_DEPTH: u32 = 128;

/// How many sequence or map elements that take no bytes one message may hold, in all. Every
/// other element takes a byte at least, so the input's length bounds the decoder's work;
/// these alone are bounded by their declared count, which costs the sender a few bytes.
/// Postcard has no limit; a legitimate message holds a handful such elements at most.
const EMPTY_MAX: u32 = 1 << 16;

/// How many bytes of memory the elements of a message's sequences and maps may take, in
/// all (each counted at its type's size; what it owns on the heap is counted by its own
/// elements): 64 times the message's length, and 64 MiB at least. A varint or a `None`
/// takes a byte on the wire; a legitimate message grows far less than 64 times, and a
/// hostile one of a few MiB could otherwise ask for gigabytes.
fn memory_limit(input: usize) -> usize {
    input.saturating_mul(64).saturating_add(64 << 20)
}

struct Encoder<'a, S> {
    out: &'a mut S,
}

impl<S: Sink> Encoder<'_, S> {
    #[inline]
    fn varint(&mut self, v: u64) {
        if v < 0x80 {
            self.out.push(v as u8);
        } else if v < 0x4000 {
            self.out.extend(&[v as u8 | 0x80, (v >> 7) as u8]);
        } else {
            self.long_varint(u128::from(v));
        }
    }

    #[inline(never)]
    fn long_varint(&mut self, mut v: u128) {
        let mut buf = [0u8; 19];
        let mut n = 0;
        loop {
            let byte = (v & 0x7F) as u8;
            v >>= 7;
            if v == 0 {
                buf[n] = byte;
                n += 1;
                break;
            }
            buf[n] = byte | 0x80;
            n += 1;
        }
        self.out.extend(&buf[..n]);
    }

    #[inline]
    fn bytes(&mut self, v: &[u8]) {
        self.varint(v.len() as u64);
        self.out.extend(v);
    }
}

fn zigzag(v: i128) -> u128 {
    ((v << 1) ^ (v >> 127)) as u128
}

impl<S: Sink> ser::Serializer for &mut Encoder<'_, S> {
    type Ok = ();
    type Error = Error;
    type SerializeSeq = Self;
    type SerializeTuple = Self;
    type SerializeTupleStruct = Self;
    type SerializeTupleVariant = Self;
    type SerializeMap = Self;
    type SerializeStruct = Self;
    type SerializeStructVariant = Self;

    fn is_human_readable(&self) -> bool {
        false
    }

    #[inline]
    fn serialize_bool(self, v: bool) -> Result<()> {
        self.out.push(u8::from(v));
        Ok(())
    }

    #[inline]
    fn serialize_i8(self, v: i8) -> Result<()> {
        self.out.push(v as u8);
        Ok(())
    }

    #[inline]
    fn serialize_i16(self, v: i16) -> Result<()> {
        self.serialize_i64(i64::from(v))
    }

    #[inline]
    fn serialize_i32(self, v: i32) -> Result<()> {
        self.serialize_i64(i64::from(v))
    }

    #[inline]
    fn serialize_i64(self, v: i64) -> Result<()> {
        // Zigzag keeps the value's width, so it is the same varint whatever the type.
        self.varint(((v << 1) ^ (v >> 63)) as u64);
        Ok(())
    }

    fn serialize_i128(self, v: i128) -> Result<()> {
        self.long_varint(zigzag(v));
        Ok(())
    }

    #[inline]
    fn serialize_u8(self, v: u8) -> Result<()> {
        self.out.push(v);
        Ok(())
    }

    #[inline]
    fn serialize_u16(self, v: u16) -> Result<()> {
        self.varint(u64::from(v));
        Ok(())
    }

    #[inline]
    fn serialize_u32(self, v: u32) -> Result<()> {
        self.varint(u64::from(v));
        Ok(())
    }

    #[inline]
    fn serialize_u64(self, v: u64) -> Result<()> {
        self.varint(v);
        Ok(())
    }

    fn serialize_u128(self, v: u128) -> Result<()> {
        self.long_varint(v);
        Ok(())
    }

    #[inline]
    fn serialize_f32(self, v: f32) -> Result<()> {
        self.out.extend(&v.to_bits().to_le_bytes());
        Ok(())
    }

    #[inline]
    fn serialize_f64(self, v: f64) -> Result<()> {
        self.out.extend(&v.to_bits().to_le_bytes());
        Ok(())
    }

    fn serialize_char(self, v: char) -> Result<()> {
        self.bytes(v.encode_utf8(&mut [0; 4]).as_bytes());
        Ok(())
    }

    #[inline]
    fn serialize_str(self, v: &str) -> Result<()> {
        self.bytes(v.as_bytes());
        Ok(())
    }

    #[inline]
    fn serialize_bytes(self, v: &[u8]) -> Result<()> {
        self.bytes(v);
        Ok(())
    }

    #[inline]
    fn serialize_none(self) -> Result<()> {
        self.out.push(0);
        Ok(())
    }

    #[inline]
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<()> {
        self.out.push(1);
        value.serialize(self)
    }

    #[inline]
    fn serialize_unit(self) -> Result<()> {
        Ok(())
    }

    #[inline]
    fn serialize_unit_struct(self, _: &'static str) -> Result<()> {
        Ok(())
    }

    #[inline]
    fn serialize_unit_variant(self, _: &'static str, index: u32, _: &'static str) -> Result<()> {
        self.varint(u64::from(index));
        Ok(())
    }

    #[inline]
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        value: &T,
    ) -> Result<()> {
        value.serialize(self)
    }

    #[inline]
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        index: u32,
        _: &'static str,
        value: &T,
    ) -> Result<()> {
        self.varint(u64::from(index));
        value.serialize(self)
    }

    #[inline]
    fn serialize_seq(self, len: Option<usize>) -> Result<Self> {
        self.varint(len.ok_or(Error::LengthUnknown)? as u64);
        Ok(self)
    }

    #[inline]
    fn serialize_tuple(self, _: usize) -> Result<Self> {
        Ok(self)
    }

    #[inline]
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Self> {
        Ok(self)
    }

    #[inline]
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        index: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self> {
        self.varint(u64::from(index));
        Ok(self)
    }

    #[inline]
    fn serialize_map(self, len: Option<usize>) -> Result<Self> {
        self.varint(len.ok_or(Error::LengthUnknown)? as u64);
        Ok(self)
    }

    #[inline]
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Self> {
        Ok(self)
    }

    #[inline]
    fn serialize_struct_variant(
        self,
        _: &'static str,
        index: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self> {
        self.varint(u64::from(index));
        Ok(self)
    }

    fn collect_str<T: fmt::Display + ?Sized>(self, value: &T) -> Result<()> {
        self.bytes(value.to_string().as_bytes());
        Ok(())
    }
}

/// The compound forms: each element is simply the next value.
macro_rules! compound {
    ($($trait:ident :: $method:ident ($($key:ident)?)),* $(,)?) => {$(
        impl<S: Sink> ser::$trait for &mut Encoder<'_, S> {
            type Ok = ();
            type Error = Error;

            #[inline]
            fn $method<T: Serialize + ?Sized>(
                &mut self,
                $($key: &'static str,)?
                value: &T,
            ) -> Result<()> {
                $(let _ = $key;)?
                value.serialize(&mut **self)
            }

            #[inline]
            fn end(self) -> Result<()> {
                Ok(())
            }
        }
    )*};
}

compound!(
    SerializeSeq::serialize_element(),
    SerializeTuple::serialize_element(),
    SerializeTupleStruct::serialize_field(),
    SerializeTupleVariant::serialize_field(),
    SerializeStruct::serialize_field(key),
    SerializeStructVariant::serialize_field(key),
);

impl<S: Sink> ser::SerializeMap for &mut Encoder<'_, S> {
    type Ok = ();
    type Error = Error;

    #[inline]
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<()> {
        key.serialize(&mut **self)
    }

    #[inline]
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        value.serialize(&mut **self)
    }

    #[inline]
    fn end(self) -> Result<()> {
        Ok(())
    }
}

struct Decoder<'de> {
    rest: &'de [u8],
    depth: u32,
    /// What is left of `EMPTY_MAX`.
    empty_left: u32,
    /// What is left of `memory_limit`.
    memory_left: usize,
}

impl<'de> Decoder<'de> {
    /// Runs `f` one nesting level deeper.
    #[inline]
    fn nested<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if self.depth >= MAX_DEPTH {
            return Err(Error::TooDeep);
        }
        self.depth += 1;
        let out = f(self);
        self.depth -= 1;
        out
    }

    #[inline]
    fn byte(&mut self) -> Result<u8> {
        let (&b, rest) = self.rest.split_first().ok_or(Error::End)?;
        self.rest = rest;
        Ok(b)
    }

    #[inline]
    fn take(&mut self, n: usize) -> Result<&'de [u8]> {
        if n > self.rest.len() {
            return Err(Error::End);
        }
        let (taken, rest) = self.rest.split_at(n);
        self.rest = rest;
        Ok(taken)
    }

    /// A varint of a type `bits` wide.
    #[inline]
    fn varint(&mut self, bits: u32) -> Result<u64> {
        // One and two bytes are valid for every type of 16 bits or more.
        match *self.rest {
            [b, ref rest @ ..] if b < 0x80 => {
                self.rest = rest;
                Ok(u64::from(b))
            }
            [b0, b1, ref rest @ ..] if b1 < 0x80 => {
                self.rest = rest;
                Ok(u64::from(b0 & 0x7F) | u64::from(b1) << 7)
            }
            _ => self.long_varint(bits).map(|v| v as u64),
        }
    }

    /// Postcard's rule: at most `ceil(bits / 7)` bytes, and the last one may not carry bits
    /// beyond the type.
    #[inline(never)]
    fn long_varint(&mut self, bits: u32) -> Result<u128> {
        let max = bits.div_ceil(7);
        let last_max = (1u32 << (bits - 7 * (max - 1))) - 1;
        let mut v = 0u128;
        for i in 0..max {
            let b = self.byte()?;
            v |= u128::from(b & 0x7F) << (7 * i);
            if b & 0x80 == 0 {
                if i == max - 1 && u32::from(b) > last_max {
                    return Err(Error::BadVarint);
                }
                return Ok(v);
            }
        }
        Err(Error::BadVarint)
    }

    #[inline]
    fn signed(&mut self, bits: u32) -> Result<i64> {
        let v = self.varint(bits)?;
        Ok(((v >> 1) as i64) ^ -((v & 1) as i64))
    }

    #[inline]
    fn len(&mut self) -> Result<usize> {
        Ok(self.varint(usize::BITS)? as usize)
    }

    #[inline]
    fn bytes(&mut self) -> Result<&'de [u8]> {
        let n = self.len()?;
        self.take(n)
    }

    fn str(&mut self) -> Result<&'de str> {
        std::str::from_utf8(self.bytes()?).map_err(|_| Error::BadUtf8)
    }
}

/// A sequence's or map's elements (or a tuple's or struct's fields): `left` more to come.
struct Elements<'a, 'de> {
    de: &'a mut Decoder<'de>,
    left: usize,
    /// Whether the count came from the input (a sequence or map, not a tuple or struct):
    /// then each element counts against `memory_limit`, and one that takes no bytes
    /// against `EMPTY_MAX` too.
    counted: bool,
    /// A map entry's first byte: where its key started.
    entry: usize,
}

impl<'a, 'de> Elements<'a, 'de> {
    /// The count, as a hint only where the input could hold that many elements (every
    /// element takes a byte at least, mostly): a declared count is not trusted for
    /// reserving memory.
    fn hint(&self) -> Option<usize> {
        (self.left <= self.de.rest.len()).then_some(self.left)
    }

    fn new(de: &'a mut Decoder<'de>, left: usize, counted: bool) -> Self {
        Self {
            de,
            left,
            counted,
            entry: 0,
        }
    }

    #[inline]
    fn next<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>> {
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        if self.counted {
            self.reserve::<T::Value>()?;
        }
        seed.deserialize(&mut *self.de).map(Some)
    }

    /// Counts a sequence's or map's element of type `T` against `memory_limit`, before it
    /// is decoded.
    #[inline]
    fn reserve<T>(&mut self) -> Result<()> {
        self.de.memory_left = self
            .de
            .memory_left
            .checked_sub(std::mem::size_of::<T>())
            .ok_or(Error::TooMuchMemory)?;
        Ok(())
    }

    /// Counts an element that started with `rest_before` bytes of input left, if it took
    /// none of them.
    #[inline]
    fn charge(&mut self, rest_before: usize) -> Result<()> {
        if self.counted && self.de.rest.len() == rest_before {
            self.de.empty_left = self
                .de
                .empty_left
                .checked_sub(1)
                .ok_or(Error::TooManyEmpty)?;
        }
        Ok(())
    }
}

impl<'de> de::SeqAccess<'de> for Elements<'_, 'de> {
    type Error = Error;

    #[inline]
    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>> {
        let before = self.de.rest.len();
        let v = self.next(seed)?;
        if v.is_some() {
            self.charge(before)?;
        }
        Ok(v)
    }

    fn size_hint(&self) -> Option<usize> {
        self.hint()
    }
}

impl<'de> de::MapAccess<'de> for Elements<'_, 'de> {
    type Error = Error;

    #[inline]
    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>> {
        // A map's entries count as its elements: the key takes one, its value follows.
        self.entry = self.de.rest.len();
        self.next(seed)
    }

    #[inline]
    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value> {
        self.reserve::<V::Value>()?;
        let v = seed.deserialize(&mut *self.de)?;
        self.charge(self.entry)?;
        Ok(v)
    }

    fn size_hint(&self) -> Option<usize> {
        self.hint()
    }
}

impl<'de> de::Deserializer<'de> for &mut Decoder<'de> {
    type Error = Error;

    fn is_human_readable(&self) -> bool {
        false
    }

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value> {
        Err(Error::NotSelfDescribing)
    }

    #[inline]
    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        match self.byte()? {
            0 => visitor.visit_bool(false),
            1 => visitor.visit_bool(true),
            _ => Err(Error::BadBool),
        }
    }

    #[inline]
    fn deserialize_i8<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        visitor.visit_i8(self.byte()? as i8)
    }

    #[inline]
    fn deserialize_i16<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        visitor.visit_i16(self.signed(16)? as i16)
    }

    #[inline]
    fn deserialize_i32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        visitor.visit_i32(self.signed(32)? as i32)
    }

    #[inline]
    fn deserialize_i64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        visitor.visit_i64(self.signed(64)?)
    }

    fn deserialize_i128<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        let v = self.long_varint(128)?;
        visitor.visit_i128(((v >> 1) as i128) ^ -((v & 1) as i128))
    }

    #[inline]
    fn deserialize_u8<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        visitor.visit_u8(self.byte()?)
    }

    #[inline]
    fn deserialize_u16<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        visitor.visit_u16(self.varint(16)? as u16)
    }

    #[inline]
    fn deserialize_u32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        visitor.visit_u32(self.varint(32)? as u32)
    }

    #[inline]
    fn deserialize_u64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        visitor.visit_u64(self.varint(64)?)
    }

    fn deserialize_u128<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        visitor.visit_u128(self.long_varint(128)?)
    }

    #[inline]
    fn deserialize_f32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        let b = self.take(4)?;
        visitor.visit_f32(f32::from_le_bytes(b.try_into().expect("4 bytes")))
    }

    #[inline]
    fn deserialize_f64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        let b = self.take(8)?;
        visitor.visit_f64(f64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    fn deserialize_char<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        let n = self.len()?;
        if n > 4 {
            return Err(Error::BadChar);
        }
        // As postcard (1.2 and later): UTF-8 bytes that hold exactly one character. Postcard
        // 1.1 took the first character of any UTF-8 bytes, so two byte forms decoded alike.
        let mut chars = std::str::from_utf8(self.take(n)?)
            .map_err(|_| Error::BadChar)?
            .chars();
        match (chars.next(), chars.next()) {
            (Some(c), None) => visitor.visit_char(c),
            _ => Err(Error::BadChar),
        }
    }

    #[inline]
    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        visitor.visit_borrowed_str(self.str()?)
    }

    #[inline]
    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.deserialize_str(visitor)
    }

    #[inline]
    fn deserialize_bytes<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        visitor.visit_borrowed_bytes(self.bytes()?)
    }

    #[inline]
    fn deserialize_byte_buf<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.deserialize_bytes(visitor)
    }

    #[inline]
    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        match self.byte()? {
            0 => visitor.visit_none(),
            1 => self.nested(|de| visitor.visit_some(de)),
            _ => Err(Error::BadOption),
        }
    }

    #[inline]
    fn deserialize_unit<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        visitor.visit_unit()
    }

    #[inline]
    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        visitor: V,
    ) -> Result<V::Value> {
        visitor.visit_unit()
    }

    #[inline]
    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        visitor: V,
    ) -> Result<V::Value> {
        self.nested(|de| visitor.visit_newtype_struct(de))
    }

    #[inline]
    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        let left = self.len()?;
        self.nested(|de| visitor.visit_seq(Elements::new(de, left, true)))
    }

    #[inline]
    fn deserialize_tuple<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value> {
        self.nested(|de| visitor.visit_seq(Elements::new(de, len, false)))
    }

    #[inline]
    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        len: usize,
        visitor: V,
    ) -> Result<V::Value> {
        self.deserialize_tuple(len, visitor)
    }

    #[inline]
    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        let left = self.len()?;
        self.nested(|de| visitor.visit_map(Elements::new(de, left, true)))
    }

    #[inline]
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value> {
        self.deserialize_tuple(fields.len(), visitor)
    }

    #[inline]
    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value> {
        self.nested(|de| visitor.visit_enum(de))
    }

    fn deserialize_identifier<V: Visitor<'de>>(self, _: V) -> Result<V::Value> {
        Err(Error::NotSelfDescribing)
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value> {
        Err(Error::NotSelfDescribing)
    }
}

impl<'de> de::EnumAccess<'de> for &mut Decoder<'de> {
    type Error = Error;
    type Variant = Self;

    #[inline]
    fn variant_seed<V: DeserializeSeed<'de>>(self, seed: V) -> Result<(V::Value, Self)> {
        let index = self.varint(32)? as u32;
        let v = seed.deserialize(index.into_deserializer())?;
        Ok((v, self))
    }
}

impl<'de> de::VariantAccess<'de> for &mut Decoder<'de> {
    type Error = Error;

    #[inline]
    fn unit_variant(self) -> Result<()> {
        Ok(())
    }

    #[inline]
    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value> {
        seed.deserialize(self)
    }

    #[inline]
    fn tuple_variant<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value> {
        de::Deserializer::deserialize_tuple(self, len, visitor)
    }

    #[inline]
    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value> {
        de::Deserializer::deserialize_tuple(self, fields.len(), visitor)
    }
}

#[cfg(test)]
mod tests {
    //! The format is postcard's: every value here encodes to the bytes the `postcard` crate
    //! writes and decodes from them, and arbitrary bytes decode as postcard decodes them.

    use std::collections::{BTreeMap, HashMap};
    use std::fmt::Debug;

    use serde::{Deserialize, Serialize};

    use super::*;

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct Unit;

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct Newtype(u32);

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct Pair(i16, String);

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    enum Shape {
        Empty,
        Circle(f64),
        Rect(u32, u32),
        Named { name: String, sides: Option<u8> },
    }

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct Everything {
        flag: bool,
        small: i8,
        byte: u8,
        short: i16,
        ushort: u16,
        int: i32,
        uint: u32,
        long: i64,
        ulong: u64,
        huge: i128,
        uhuge: u128,
        single: f32,
        double: f64,
        letter: char,
        text: String,
        #[serde(with = "serde_bytes_compat")]
        raw: Vec<u8>,
        blob: crate::Blob,
        maybe: Option<Box<Everything>>,
        list: Vec<Shape>,
        map: BTreeMap<String, Vec<i64>>,
        unit: (),
        unit_struct: Unit,
        newtype: Newtype,
        pair: Pair,
        tuple: (u8, i64, Option<bool>),
        array: [u16; 3],
    }

    /// `Vec<u8>` as a byte string rather than a sequence of numbers.
    mod serde_bytes_compat {
        use serde::{Deserialize, Deserializer, Serializer};

        pub(super) fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(v)
        }

        pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
            Ok(crate::Blob::deserialize(d)?.to_vec())
        }
    }

    fn everything(seed: i64) -> Everything {
        Everything {
            flag: seed % 2 == 0,
            small: seed as i8,
            byte: seed.wrapping_mul(7) as u8,
            short: seed.wrapping_mul(131) as i16,
            ushort: seed.wrapping_mul(257) as u16,
            int: seed.wrapping_mul(65_537) as i32,
            uint: seed.wrapping_mul(1_000_003) as u32,
            long: seed.wrapping_mul(0x1234_5678_9abc),
            ulong: (seed as u64).wrapping_mul(0xfedc_ba98_7654_3211),
            huge: i128::from(seed) * i128::from(i64::MAX) * 3,
            uhuge: u128::from(seed as u64) << 70,
            single: seed as f32 / 3.0,
            double: -(seed as f64) / 7.0,
            letter: ['a', 'é', '€', '😀'][seed.rem_euclid(4) as usize],
            text: "ü".repeat(seed.rem_euclid(70) as usize),
            raw: vec![seed as u8; seed.rem_euclid(200) as usize],
            blob: crate::Blob::from(vec![3u8; seed.rem_euclid(40) as usize]),
            maybe: (seed % 3 == 0).then(|| Box::new(everything(seed + 1))),
            list: vec![
                Shape::Empty,
                Shape::Circle(seed as f64),
                Shape::Rect(seed as u32, 300),
                Shape::Named {
                    name: format!("n{seed}"),
                    sides: (seed % 2 == 1).then_some(seed as u8),
                },
            ],
            map: (0..seed.rem_euclid(5))
                .map(|i| (format!("k{i}"), vec![i, -i, i << 40]))
                .collect(),
            unit: (),
            unit_struct: Unit,
            newtype: Newtype(seed as u32),
            pair: Pair((seed as i16).wrapping_neg(), "pair".into()),
            tuple: (1, -seed, Some(seed > 0)),
            array: [0, seed as u16, u16::MAX],
        }
    }

    fn same<T>(value: &T)
    where
        T: Serialize + for<'de> Deserialize<'de> + PartialEq + Debug,
    {
        let theirs = postcard::to_allocvec(value).unwrap();
        let mut ours = Vec::new();
        encode(value, &mut ours).unwrap();
        assert_eq!(ours, theirs, "encoding of {value:?}");
        let back: T = decode(&theirs).unwrap();
        assert_eq!(&back, value);
    }

    #[test]
    fn values_encode_and_decode_as_postcard_does() {
        for seed in [
            0,
            1,
            -1,
            2,
            63,
            64,
            -64,
            -65,
            127,
            128,
            1000,
            -40_000,
            i64::MAX / 3,
        ] {
            same(&everything(seed));
        }
        for v in [
            0u64,
            1,
            127,
            128,
            16_383,
            16_384,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            same(&v);
            same(&(v as u32));
            same(&(v as u16));
        }
        for v in [0i64, -1, 1, 63, -64, 64, -65, i64::MIN, i64::MAX] {
            same(&v);
            same(&(v as i32));
            same(&(v as i16));
            same(&(v as i8));
        }
        for v in [0i128, -1, i128::MIN, i128::MAX] {
            same(&v);
            same(&(v as u128));
        }
        same(&f64::NAN.to_bits());
        same(&"x".repeat(300));
        same(&HashMap::from([(1u8, 'z')]));
        same(&Some(Some(())));
        same(&Vec::<Shape>::new());
    }

    #[test]
    fn arbitrary_bytes_decode_as_postcard_decodes_them() {
        // A small xorshift: the same inputs on every run.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let valid = postcard::to_allocvec(&everything(5)).unwrap();
        for round in 0..20_000 {
            let mut input: Vec<u8> = if round % 2 == 0 {
                // Mutations of a valid encoding reach deep into the value.
                let mut v = valid.clone();
                for _ in 0..1 + next() % 4 {
                    let at = (next() as usize) % v.len();
                    v[at] = next() as u8;
                }
                v.truncate(v.len() - (next() as usize % 4).min(v.len()));
                v
            } else {
                (0..next() % 40).map(|_| next() as u8).collect()
            };
            if round % 7 == 0 {
                // Long varints and lengths.
                input.splice(0..0, [0xff, 0xff, 0xff, 0xff, 0x0f]);
            }
            let theirs = postcard::from_bytes::<Everything>(&input);
            let ours = decode::<Everything>(&input);
            match (&ours, &theirs) {
                (Ok(a), Ok(b)) => assert_eq!(format!("{a:?}"), format!("{b:?}")),
                (Err(_), Err(_)) => {}
                _ => panic!("ours {ours:?}, postcard's {theirs:?}, input {input:?}"),
            }
            for (ours, theirs) in [
                (
                    decode::<Vec<Shape>>(&input).is_ok(),
                    postcard::from_bytes::<Vec<Shape>>(&input).is_ok(),
                ),
                (
                    decode::<(u16, i32, u64)>(&input).is_ok(),
                    postcard::from_bytes::<(u16, i32, u64)>(&input).is_ok(),
                ),
                (
                    decode::<(char, String)>(&input).is_ok(),
                    postcard::from_bytes::<(char, String)>(&input).is_ok(),
                ),
                (
                    decode::<(i128, u128)>(&input).is_ok(),
                    postcard::from_bytes::<(i128, u128)>(&input).is_ok(),
                ),
            ] {
                assert_eq!(ours, theirs, "input {input:?}");
            }
        }
    }

    #[test]
    fn errors_name_what_is_wrong() {
        // A char is UTF-8 bytes holding exactly one character, as postcard 1.2 decodes it.
        assert_eq!(decode::<char>(&[2, b'a', b'b']), Err(Error::BadChar));
        assert_eq!(decode::<char>(&[0]), Err(Error::BadChar));
        assert_eq!(decode::<char>(&[2, 0xc3, 0xa9]), Ok('é'));
        assert_eq!(decode::<u32>(&[0x80]), Err(Error::End));
        assert_eq!(
            decode::<u32>(&[0xff, 0xff, 0xff, 0xff, 0x10]),
            Err(Error::BadVarint)
        );
        assert_eq!(decode::<u32>(&[0xff, 0xff, 0xff, 0xff, 0x0f]), Ok(u32::MAX));
        assert_eq!(decode::<bool>(&[2]), Err(Error::BadBool));
        assert_eq!(decode::<Option<u8>>(&[2]), Err(Error::BadOption));
        assert_eq!(decode::<String>(&[1, 0xff]), Err(Error::BadUtf8));
        assert_eq!(
            decode::<char>(&[5, b'a', b'b', b'c', b'd', b'e']),
            Err(Error::BadChar)
        );
        assert_eq!(
            decode::<serde_json::Value>(&[0]).unwrap_err(),
            Error::NotSelfDescribing
        );
        struct Unsized;
        impl Serialize for Unsized {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                use serde::ser::SerializeSeq;
                s.serialize_seq(None)?.end()
            }
        }
        assert_eq!(encode(&Unsized, &mut Vec::new()), Err(Error::LengthUnknown));
        // A recursive type nested deeper than the limit fails instead of overflowing the stack.
        #[derive(Debug, PartialEq, Deserialize)]
        enum Tree {
            Leaf,
            Node(Box<Tree>),
        }
        let mut deep = vec![1u8; 100_000];
        deep.push(0);
        assert_eq!(decode::<Tree>(&deep), Err(Error::TooDeep));
        let mut fine = vec![1u8; 100];
        fine.push(0);
        assert!(decode::<Tree>(&fine).is_ok());
        assert_eq!(
            decode::<Vec<Option<Option<u8>>>>(&[1, 1, 1, 7]),
            Ok(vec![Some(Some(7))])
        );
        // Elements that take no bytes: as many as `EMPTY_MAX` in all, however they nest.
        let count = |n: u32| {
            let mut v = Vec::new();
            encode(&n, &mut v).unwrap();
            v
        };
        assert_eq!(
            decode::<Vec<()>>(&count(EMPTY_MAX)).map(|v| v.len()),
            Ok(EMPTY_MAX as usize)
        );
        assert_eq!(
            decode::<Vec<()>>(&count(EMPTY_MAX + 1)),
            Err(Error::TooManyEmpty)
        );
        assert_eq!(
            decode::<Vec<()>>(&count(u32::MAX)),
            Err(Error::TooManyEmpty)
        );
        let mut nested = count(3);
        for _ in 0..3 {
            nested.extend_from_slice(&count(EMPTY_MAX / 2));
        }
        assert_eq!(decode::<Vec<Vec<()>>>(&nested), Err(Error::TooManyEmpty));
        let mut units = count(2);
        units.extend_from_slice(&[0, 0]);
        assert_eq!(
            decode::<std::collections::BTreeMap<(), ()>>(&units).map(|m| m.len()),
            Ok(1)
        );
        // Elements that take a byte, and fields of a type, do not count.
        let big = vec![0u8; EMPTY_MAX as usize + 10];
        let mut seq = count(EMPTY_MAX + 10);
        seq.extend_from_slice(&big);
        assert!(decode::<Vec<((), u8, ())>>(&seq).is_ok());
        // Elements that take a byte on the wire and far more in memory: up to the limit.
        type Big = [[u64; 32]; 16];
        let nones = |n: u32| {
            let mut v = count(n);
            v.resize(v.len() + n as usize, 0);
            v
        };
        assert_eq!(
            decode::<Vec<Option<Big>>>(&nones(10_000)).map(|v| v.len()),
            Ok(10_000)
        );
        let many = nones(1 << 16);
        assert_eq!(decode::<Vec<Option<Big>>>(&many), Err(Error::TooMuchMemory));
        assert!(memory_limit(many.len()) < (1 << 16) * std::mem::size_of::<Option<Big>>());
        let mut map = count(1 << 16);
        for i in 0..1u32 << 16 {
            encode(&i, &mut map).unwrap();
            map.push(0);
        }
        assert_eq!(
            decode::<std::collections::BTreeMap<u32, Option<Big>>>(&map),
            Err(Error::TooMuchMemory)
        );
        // A count far beyond the input reserves nothing up front and fails at the end.
        assert_eq!(
            decode::<Vec<u64>>(&[0xff, 0xff, 0xff, 0xff, 0x0f, 1]),
            Err(Error::End)
        );
    }
}
