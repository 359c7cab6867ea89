// The TypeScript codec against crates/coherent-rpc/tests/vectors.json: the same vectors the
// Rust codec passes (frames, handshakes, stream batches, MessagePack payloads).
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";

import { decode, encode, encodeWide } from "../src/codec.js";
import { ErrorCode, errorCodeName, RpcError } from "../src/errors.js";
import {
  Compression,
  decodeBatch,
  decodeFrame,
  decodeHello,
  encodeFrame,
  encodeHello,
  encodeVarint,
  FrameError,
  FrameReader,
  Kind,
  kindName,
  readVarint,
} from "../src/frame.js";
import { methodId, valueHash } from "../src/hash.js";

const root = new URL("../../../../", import.meta.url);
const v = JSON.parse(readFileSync(new URL("crates/coherent-rpc/tests/vectors.json", root), "utf8"));

const hex = (s: string) => Uint8Array.from(s.match(/../g) ?? [], (b) => parseInt(b, 16));
const toHex = (b: Uint8Array) => Buffer.from(b).toString("hex");
const bigOrNumber = (s: string) => (BigInt(s) <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(s) : BigInt(s));
const COMPRESSION: Record<string, number> = Compression;

test("method ids match the vectors", () => {
  for (const m of v.method_ids) assert.equal(methodId(m.name), m.id, m.name);
});

test("varints match the vectors both ways", () => {
  for (const x of v.varints) {
    const value = bigOrNumber(x.value);
    assert.equal(toHex(encodeVarint(value)), x.bytes, x.value);
    assert.deepEqual(readVarint(hex(x.bytes), 0), [value, x.bytes.length / 2], x.value);
  }
});

test("frames encode and decode to the vectors", () => {
  for (const f of v.frames) {
    const bytes = hex(f.bytes);
    const callId = bigOrNumber(f.call_id);
    const kind = Kind[f.kind as keyof typeof Kind];
    if (f.compression === "None") {
      assert.equal(toHex(encodeFrame(kind, callId, f.method_id, hex(f.payload), f.upload)), f.bytes, f.name);
    }
    const decoded = decodeFrame(bytes, 1 << 20);
    assert.ok(decoded, f.name);
    const [frame, end] = decoded;
    assert.equal(end, bytes.length, f.name);
    assert.equal(kindName(frame.kind), f.kind, f.name);
    assert.equal(frame.compression, COMPRESSION[f.compression], f.name);
    assert.equal(frame.upload, f.upload, f.name);
    assert.equal(frame.callId, callId, f.name);
    assert.equal(frame.methodId, f.method_id, f.name);
    assert.equal(toHex(frame.payload), f.payload, f.name);
  }
});

test("invalid frames are refused with the vector's error", () => {
  for (const f of v.invalid_frames) {
    assert.throws(
      () => decodeFrame(hex(f.bytes), f.max_len ?? 1 << 20),
      (e: unknown) => e instanceof FrameError && e.kind === f.error,
      f.name,
    );
  }
});

test("incomplete frames ask for more bytes", () => {
  for (const f of v.incomplete_frames) assert.equal(decodeFrame(hex(f.bytes), 1 << 20), undefined, f.name);
});

test("every frame survives any split into messages", () => {
  const all = v.frames.map((f: { bytes: string }) => hex(f.bytes));
  const stream = new Uint8Array(all.reduce((n: number, b: Uint8Array) => n + b.length, 0));
  let at = 0;
  for (const b of all) {
    stream.set(b, at);
    at += b.length;
  }
  for (const size of [1, 2, 3, 7, 19, 64, stream.length]) {
    const reader = new FrameReader(1 << 20);
    const got: string[] = [];
    for (let i = 0; i < stream.length; i += size) {
      for (const f of reader.push(stream.subarray(i, i + size))) got.push(kindName(f.kind) + toHex(f.payload));
    }
    assert.deepEqual(
      got,
      v.frames.map((f: { kind: string; payload: string }) => f.kind + f.payload),
      `chunks of ${size}`,
    );
    assert.equal(reader.pending, 0);
  }
});

test("stream batches split as the vectors say", () => {
  for (const b of v.stream_batches) {
    if (b.error) {
      assert.throws(
        () => decodeBatch(hex(b.payload)),
        (e: unknown) => e instanceof FrameError && e.kind === b.error,
        b.name,
      );
    } else {
      assert.deepEqual(decodeBatch(hex(b.payload)).map(toHex), b.items, b.name);
    }
  }
});

test("handshakes encode and decode to the vectors", () => {
  for (const h of v.hellos) {
    const hello = {
      version: 1,
      format: h.format === "Postcard" ? 0 : 1,
      decodes: h.decodes,
      maxMessageSize: h.max_message_size,
      maxInboundCalls: h.max_inbound_calls,
      streamWindow: h.stream_window,
      token: h.token,
    };
    assert.equal(toHex(encodeHello(hello)), h.bytes, h.name);
    assert.deepEqual(decodeHello(hex(h.bytes)), hello, h.name);
  }
});

test("invalid handshakes are refused with the vector's code", () => {
  for (const h of v.invalid_hellos) {
    assert.throws(
      () => decodeHello(hex(h.bytes)),
      (e: unknown) => e instanceof RpcError && e.code === h.code,
      h.name,
    );
  }
});

test("error codes match the vectors", () => {
  for (const e of v.errors) {
    assert.equal(ErrorCode[e.name as keyof typeof ErrorCode], e.code);
    assert.equal(errorCodeName(e.code), e.name);
  }
  assert.equal(errorCodeName(4242), "Unknown(4242)");
});

/** The vectors' JSON form of a value: {"$bin": hex} for bytes, {"$u64": decimal} past 2^53. */
function fromJson(x: unknown): unknown {
  if (Array.isArray(x)) return x.map(fromJson);
  if (x !== null && typeof x === "object") {
    const o = x as Record<string, unknown>;
    if (typeof o.$bin === "string") return hex(o.$bin);
    if (typeof o.$u64 === "string") return BigInt(o.$u64);
    return Object.fromEntries(Object.entries(o).map(([k, y]) => [k, fromJson(y)]));
  }
  return x;
}

test("MessagePack payloads match the vectors both ways", () => {
  for (const m of v.messagepack) {
    const value = fromJson(m.value);
    const wide = JSON.stringify(m.value).includes("$u64");
    assert.equal(toHex(wide ? encodeWide(value) : encode(value)), m.bytes, `${m.name}: encoding`);
    // Integers past 2^53 decode as numbers (rounded); compare what a number can hold.
    const widen = (x: unknown): unknown =>
      typeof x === "bigint" ? Number(x) : Array.isArray(x) ? x.map(widen) : x;
    assert.deepEqual(decode(hex(m.bytes)), widen(value), `${m.name}: decoding`);
  }
});

test("the value hash is 64-bit FNV-1a", () => {
  assert.equal(valueHash(new Uint8Array()), 0xcbf29ce484222325n);
  // Reference values of FNV-1a 64.
  assert.equal(valueHash(new TextEncoder().encode("a")), 0xaf63dc4c8601ec8cn);
  assert.equal(valueHash(new TextEncoder().encode("foobar")), 0x85944171f73967e8n);
  // Against a bigint reference on many bytes.
  const bytes = Uint8Array.from({ length: 1000 }, (_, i) => (i * 131 + 7) & 0xff);
  let h = 0xcbf29ce484222325n;
  for (const b of bytes) h = ((h ^ BigInt(b)) * 0x100000001b3n) & 0xffffffffffffffffn;
  assert.equal(valueHash(bytes), h);
});

test("a decode failure is a BadArguments error", () => {
  assert.throws(() => decode(hex("92")), (e: unknown) => e instanceof RpcError && e.code === ErrorCode.BadArguments);
});
