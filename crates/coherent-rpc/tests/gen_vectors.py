#!/usr/bin/env python3
"""Writes vectors.json from PROTOCOL.md's rules, independently of the Rust code.

The Rust tests (tests/it/vectors.rs) check the implementation against this file; a
second implementation (e.g. TypeScript) should load the same file.
Run: python3 crates/coherent-rpc/tests/gen_vectors.py
"""
import json, os, struct

KINDS = {"Hello": 1, "HelloAck": 2, "Call": 3, "OneWay": 4, "Ok": 5, "Error": 6, "Cancel": 7,
         "StreamItem": 8, "StreamEnd": 9, "StreamAck": 10, "Ping": 11, "Pong": 12, "Close": 13,
         "StreamBatch": 14}
COMP = {"None": 0, "Lz4": 1, "Zstd": 2}


def fnv1a(s):
    h = 0x811C9DC5
    for b in s.encode():
        h ^= b
        h = (h * 0x01000193) & 0xFFFFFFFF
    return h


def varint(v):
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v == 0:
            out.append(b)
            return bytes(out)
        out.append(b | 0x80)


def frame(kind, call_id, method_id, payload, comp="None", upload=False):
    return (bytes([KINDS[kind] | (COMP[comp] << 4) | (0x40 if upload else 0)]) + varint(call_id)
            + struct.pack("<II", method_id, len(payload)) + payload)


def zigzag(v):
    return (v << 1) ^ (v >> 31)


def hello(fmt, decodes, max_msg, max_calls, window, token):
    t = token.encode()
    return (b"CRPC" + bytes([1, fmt, decodes, 0]) + struct.pack("<IIIH", max_msg, max_calls, window, len(t)) + t)


def err(code, msg):
    return struct.pack("<H", code) + msg.encode()


sum_id = fnv1a("Calc.sum")
frames = []


def add(name, kind, call_id, method_id, payload, comp="None", note="", upload=False):
    frames.append({"name": name, "kind": kind, "compression": comp, "call_id": str(call_id),
                   "method_id": method_id, "payload": payload.hex(), "upload": upload,
                   "bytes": frame(kind, call_id, method_id, payload, comp, upload).hex(), "note": note})


h = hello(0, 3, 4 << 20, 1024, 64, "secret")
add("hello with a bearer token", "Hello", 0, 0, h)
add("hello ack", "HelloAck", 0, 0, hello(0, 3, 4 << 20, 1024, 64, ""))
add("call Calc.sum(2, 40) in postcard", "Call", 1, sum_id, bytes([zigzag(2), zigzag(40)]),
    note="postcard encodes the argument tuple (2i32, 40i32) as zigzag varints")
add("its reply 42", "Ok", 1, 0, bytes([zigzag(42)]))
add("call id 300 takes two varint bytes", "Call", 300, sum_id, bytes([zigzag(-1), zigzag(1)]))
add("one-way call", "OneWay", 7, fnv1a("Calc.record"), bytes([5]))
add("unknown method error", "Error", 9, 0, err(1, "no such method"))
add("cancel", "Cancel", 1, 0, b"")
add("stream item", "StreamItem", 2, 0, bytes([0, 1, 0x61]))
add("stream batch of three items", "StreamBatch", 2, 0,
    bytes([3, 2, 1, 0x62]) + bytes([0]) + varint(130) + bytes([4]) + varint(127) + b"c" * 127,
    note="items of 3, 0 and 130 bytes, each after its varint length")
add("stream end", "StreamEnd", 2, 0, b"")
add("an upload's item", "StreamItem", 4, 0, bytes([zigzag(21)]), upload=True,
    note="bit 6: the caller's stream of call 4, which the receiver serves")
add("an upload's end", "StreamEnd", 4, 0, b"", upload=True)
add("credits for an upload", "StreamAck", 4, 0, struct.pack("<I", 8), upload=True)
add("stream ack of 32 credits", "StreamAck", 2, 0, struct.pack("<I", 32))
add("ping", "Ping", 0, 0, b"")
add("close for a protocol error", "Close", 0, 0, err(9, "unknown frame kind 15"))
add("largest call id", "Cancel", 2**64 - 1, 0, b"")
add("lz4 flag", "Ok", 3, 0, bytes([4, 0, 0, 0, 0x40, 1, 2, 3, 4]), comp="Lz4",
    note="payload: u32 LE uncompressed size, then an LZ4 block (here 4 literals)")

invalid = [
    {"name": "kind 0", "bytes": "00010000000000000000", "error": "UnknownKind"},
    {"name": "kind 15", "bytes": "0f010000000000000000", "error": "UnknownKind"},
    {"name": "compression value 3", "bytes": "33010000000000000000", "error": "BadFlags"},
    {"name": "upload bit 6 on a call", "bytes": "43010000000000000000", "error": "BadFlags"},
    {"name": "reserved bit 7", "bytes": "88010000000000000000", "error": "BadFlags"},
    {"name": "overlong varint", "bytes": "0380000000000000000000", "error": "BadVarint"},
    {"name": "varint past 64 bits", "bytes": "03ffffffffffffffffff02", "error": "BadVarint"},
    {"name": "varint past 10 bytes", "bytes": "03ffffffffffffffffffff", "error": "BadVarint"},
    {"name": "length over the limit", "bytes": frame("Call", 1, 0, b"")[:-4].hex() + "01001000",
     "error": "TooLarge", "max_len": 1 << 20},
]
incomplete = [
    {"name": "empty", "bytes": ""},
    {"name": "kind only", "bytes": "03"},
    {"name": "unterminated varint", "bytes": "0380"},
    {"name": "no length yet", "bytes": "0301aabbccdd0000"},
]
batches = [
    {"name": "three items", "payload": (bytes([3, 2, 1, 0x62, 0]) + varint(2) + b"ok").hex(),
     "items": ["020162", "", "6f6b"]},
    {"name": "one empty item", "payload": "00", "items": [""]},
    {"name": "empty payload", "payload": "", "error": "BadBatch"},
    {"name": "ends inside an item", "payload": "0301", "error": "BadBatch"},
    {"name": "ends inside a length", "payload": "0100ff", "error": "BadBatch"},
    {"name": "overlong length varint", "payload": "8000", "error": "BadBatch"},
]
hellos = [
    {"name": "postcard, lz4+zstd, 4 MiB, token", "bytes": h.hex(), "format": "Postcard", "decodes": 3,
     "max_message_size": 4 << 20, "max_inbound_calls": 1024, "stream_window": 64, "token": "secret"},
    {"name": "messagepack, no compression", "bytes": hello(1, 0, 10 << 20, 8, 30, "").hex(),
     "format": "MessagePack", "decodes": 0, "max_message_size": 10 << 20, "max_inbound_calls": 8,
     "stream_window": 30, "token": ""},
]
bad_hellos = [
    {"name": "wrong magic", "bytes": ("CRPX".encode() + h[4:]).hex(), "code": 9},
    {"name": "version 2", "bytes": (h[:4] + bytes([2]) + h[5:]).hex(), "code": 11},
    {"name": "unknown format", "bytes": (h[:5] + bytes([7]) + h[6:]).hex(), "code": 9},
    {"name": "token length past the end", "bytes": h[:-1].hex(), "code": 9},
    {"name": "zero stream window", "bytes": hello(0, 3, 1, 1, 0, "").hex(), "code": 9},
]


# MessagePack (format 1) as PROTOCOL.md section 4 says the Rust side writes it: integers in
# their smallest form, structs as maps keyed by field name, enums as the variant's name or a
# one-entry map, byte strings as bin, a Uuid as its string. Written by hand from the
# MessagePack spec; "value" is the JSON of the decoded value, with {"$bin": hex} for bytes
# and {"$u64": decimal} for integers past 2^53.
def mp(v):
    if v is None:
        return b"\xc0"
    if v is False:
        return b"\xc2"
    if v is True:
        return b"\xc3"
    if isinstance(v, int):
        if 0 <= v < 128:
            return bytes([v])
        if -32 <= v < 0:
            return struct.pack("b", v)
        if v > 0:
            for tag, fmt, lim in ((0xcc, "B", 2**8), (0xcd, ">H", 2**16), (0xce, ">I", 2**32), (0xcf, ">Q", 2**64)):
                if v < lim:
                    return bytes([tag]) + struct.pack(fmt, v)
        for tag, fmt, lim in ((0xd0, "b", 2**7), (0xd1, ">h", 2**15), (0xd2, ">i", 2**31), (0xd3, ">q", 2**63)):
            if -lim <= v:
                return bytes([tag]) + struct.pack(fmt, v)
    if isinstance(v, str):
        b = v.encode()
        if len(b) < 32:
            return bytes([0xa0 | len(b)]) + b
        return bytes([0xd9, len(b)]) + b
    if isinstance(v, (bytes, bytearray)):
        return bytes([0xc4, len(v)]) + bytes(v)
    if isinstance(v, list):
        assert len(v) < 16
        return bytes([0x90 | len(v)]) + b"".join(mp(x) for x in v)
    if isinstance(v, dict):
        assert len(v) < 16
        return bytes([0x80 | len(v)]) + b"".join(mp(k) + mp(x) for k, x in v.items())
    raise TypeError(v)


def js(v):
    if isinstance(v, (bytes, bytearray)):
        return {"$bin": bytes(v).hex()}
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 2**53 - 1:
        return {"$u64": str(v)}
    if isinstance(v, list):
        return [js(x) for x in v]
    if isinstance(v, dict):
        return {k: js(x) for k, x in v.items()}
    return v


sum_args = mp([2, 40])
uuid = "0190f3c4-5a6b-7c8d-9e0f-a1b2c3d4e5f6"
messagepack = [{"name": n, "rust": r, "value": js(v), "bytes": mp(v).hex()} for n, r, v in [
    ("Calc.sum's arguments", "(i32, i32)", [2, 40]),
    ("negative and wide integers", "(i8, i16, i64, u32)", [-1, -300, -2**40, 2**32 - 1]),
    ("a u64 past 2^53", "(u64,)", [2**63 + 5]),
    ("a string and bytes", "(String, Blob)", ["héllo", bytes([0, 1, 255])]),
    ("an Option", "(Option<u32>, Option<u32>)", [None, 7]),
    ("a struct is a map by field name", "Item { id: Uuid, title: String, done: bool, tag: Option<String> }",
     {"id": uuid, "title": "Write the spec", "done": False, "tag": None}),
    ("a unit variant is its name", "Status::Open", "Open"),
    ("a variant with data is a one-entry map", "Shape::Square(u32)",
     {"Square": 3}),
    ("ReplicaHost.fetch's arguments", "(u32, Blob, u64)", [sum_id, sum_args, 7]),
    ("ReplicaHost.fetch's answer: Ok", "Result<Blob, Failure>", {"Ok": mp(42)}),
    ("ReplicaHost.fetch's answer: a Failure", "Result<Blob, Failure>", {"Err": {"BadArguments": "expected 2 arguments"}}),
    ("ReplicaHost.revalidate's arguments", "(Vec<Held>,) with Held as a tuple",
     [[[3, sum_id, sum_args, 0xCBF29CE484222325]]]),
    ("ReplicaHost.revalidate's answer", "Vec<u64>", [3]),
    ("ReplicaSink.invalidated's arguments", "(Vec<u64>,)", [[1, 2, 300]]),
    ("ReplicaSink.invalidated's answer", "()", None),
]]

out = {
    "comment": "Test vectors of the Coherent RPC wire format (PROTOCOL.md). Hex strings are bytes; 64-bit values are decimal strings.",
    "method_ids": [{"name": n, "id": fnv1a(n)} for n in
                   ["Calc.sum", "Calc.get_user", "Calc.record", "Greeter.say_hello", ""]],
    "varints": [{"value": str(v), "bytes": varint(v).hex()} for v in
                [0, 1, 127, 128, 300, 16383, 16384, 2**32 - 1, 2**63, 2**64 - 1]],
    "frames": frames,
    "invalid_frames": invalid,
    "incomplete_frames": incomplete,
    "stream_batches": batches,
    "hellos": hellos,
    "invalid_hellos": bad_hellos,
    "messagepack": messagepack,
    "errors": [{"code": c, "name": n} for c, n in
               [(1, "UnknownMethod"), (2, "BadArguments"), (3, "DeadlineExceeded"), (4, "Disconnected"),
                (5, "TooLarge"), (6, "Unauthenticated"), (7, "Overloaded"), (8, "Cancelled"),
                (9, "Protocol"), (10, "Internal"), (11, "UnsupportedVersion")]],
}
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vectors.json")
with open(path, "w") as f:
    json.dump(out, f, indent=1)
    f.write("\n")
