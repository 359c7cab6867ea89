/**
 * Frames (PROTOCOL.md section 2), stream batches (section 5) and the handshake (section 3):
 * encoding, and decoding of hostile bytes, which answers a {@link FrameError} and never
 * allocates more than the announced limit.
 * @module
 */

import { ErrorCode, RpcError } from "./errors.js";

/** Frame kinds (bits 0-3 of the first byte). */
export const Kind = {
  Hello: 1,
  HelloAck: 2,
  Call: 3,
  OneWay: 4,
  Ok: 5,
  Error: 6,
  Cancel: 7,
  StreamItem: 8,
  StreamEnd: 9,
  StreamAck: 10,
  Ping: 11,
  Pong: 12,
  Close: 13,
  StreamBatch: 14,
} as const;

/** A frame kind. */
export type Kind = (typeof Kind)[keyof typeof Kind];

const KIND_NAMES: Record<number, string> = Object.fromEntries(
  Object.entries(Kind).map(([name, value]) => [value, name]),
);

/** The name of a kind, as the test vectors spell it. */
export function kindName(kind: Kind): string {
  return KIND_NAMES[kind] ?? String(kind);
}

/** Payload compression (bits 4-5). This client decodes none, so it never receives any. */
export const Compression = { None: 0, Lz4: 1, Zstd: 2 } as const;

/** A compression value. */
export type Compression = (typeof Compression)[keyof typeof Compression];

/** A call id: a number while it is a safe integer, a bigint above 2^53 - 1. */
export type CallId = number | bigint;

/** One frame. */
export interface Frame {
  kind: Kind;
  compression: Compression;
  /** Bit 6: a stream frame of the caller's upload. */
  upload: boolean;
  callId: CallId;
  methodId: number;
  payload: Uint8Array;
}

/** Why bytes are not a frame: the names of the test vectors' errors. */
export type FrameErrorKind = "UnknownKind" | "BadFlags" | "BadVarint" | "TooLarge" | "BadBatch";

/** Bytes that are not a frame: the connection closes with `Protocol` (`TooLarge` for sizes). */
export class FrameError extends RpcError {
  readonly kind: FrameErrorKind;

  constructor(kind: FrameErrorKind, message: string) {
    super(kind === "TooLarge" ? ErrorCode.TooLarge : ErrorCode.Protocol, message);
    this.name = "FrameError";
    this.kind = kind;
  }
}

/** The longest frame envelope: kind, a 10-byte varint, method id, length. */
export const MAX_HEADER = 19;

/** Writes `value` as a minimal unsigned LEB128 varint at `out[at]`; answers the new offset. */
export function writeVarint(out: Uint8Array, at: number, value: CallId): number {
  if (typeof value === "number") {
    if (!Number.isSafeInteger(value) || value < 0) {
      throw new RangeError(`a varint holds an unsigned integer, not ${value}`);
    }
    while (value >= 0x80) {
      out[at++] = (value % 0x80) | 0x80;
      value = Math.floor(value / 0x80);
    }
    out[at++] = value;
    return at;
  }
  if (value < 0n || value > 0xffff_ffff_ffff_ffffn) {
    throw new RangeError(`a varint holds a u64, not ${value}`);
  }
  while (value >= 0x80n) {
    out[at++] = Number(value & 0x7fn) | 0x80;
    value >>= 7n;
  }
  out[at++] = Number(value);
  return at;
}

/** The bytes of `value` as a minimal varint. */
export function encodeVarint(value: CallId): Uint8Array {
  const out = new Uint8Array(10);
  return out.slice(0, writeVarint(out, 0, value));
}

/**
 * Reads a varint at `bytes[at]`: `undefined` when the bytes end inside it, `[value, next]`
 * otherwise. Throws `BadVarint` for one longer than 10 bytes, past 64 bits, or not minimal.
 */
export function readVarint(bytes: Uint8Array, at: number, end = bytes.length): [CallId, number] | undefined {
  let value = 0;
  let big: bigint | undefined;
  for (let i = 0; i < 10; i++) {
    if (at + i >= end) return undefined;
    const b = bytes[at + i]!;
    if (i === 9 && b > 1) throw new FrameError("BadVarint", "a varint past 64 bits");
    if (i >= 7 || big !== undefined) {
      // Past 49 bits: continue exactly in bigint.
      big ??= BigInt(value);
      big |= BigInt(b & 0x7f) << BigInt(7 * i);
    } else {
      value += (b & 0x7f) * 2 ** (7 * i);
    }
    if (b < 0x80) {
      if (b === 0 && i > 0) throw new FrameError("BadVarint", "a varint that is not minimal");
      if (big === undefined) return [value, at + i + 1];
      return [big <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(big) : big, at + i + 1];
    }
  }
  throw new FrameError("BadVarint", "a varint longer than 10 bytes");
}

const STREAM_KINDS = new Set<number>([Kind.StreamItem, Kind.StreamEnd, Kind.StreamAck, Kind.StreamBatch]);

/** Encodes a frame's envelope and payload into one buffer. */
export function encodeFrame(
  kind: Kind,
  callId: CallId,
  methodId: number,
  payload: Uint8Array,
  upload = false,
): Uint8Array {
  const out = new Uint8Array(MAX_HEADER + payload.length);
  const end = writeFrame(out, 0, kind, callId, methodId, payload, upload);
  return end === out.length ? out : out.subarray(0, end);
}

/** Writes a frame at `out[at]` (room: {@link MAX_HEADER} + the payload); answers the end. */
export function writeFrame(
  out: Uint8Array,
  at: number,
  kind: Kind,
  callId: CallId,
  methodId: number,
  payload: Uint8Array,
  upload = false,
): number {
  out[at] = kind | (upload ? 0x40 : 0);
  at = writeVarint(out, at + 1, callId);
  writeU32(out, at, methodId);
  writeU32(out, at + 4, payload.length);
  out.set(payload, at + 8);
  return at + 8 + payload.length;
}

function writeU32(out: Uint8Array, at: number, v: number): void {
  out[at] = v & 0xff;
  out[at + 1] = (v >>> 8) & 0xff;
  out[at + 2] = (v >>> 16) & 0xff;
  out[at + 3] = (v >>> 24) & 0xff;
}

function readU32(b: Uint8Array, at: number): number {
  return (b[at]! | (b[at + 1]! << 8) | (b[at + 2]! << 16) | (b[at + 3]! << 24)) >>> 0;
}

/**
 * Decodes one frame from the start of `bytes` (up to `end`): `undefined` when more bytes are
 * needed, otherwise the frame and the offset after it. The payload is a view into `bytes`.
 * A length above `maxLen` is refused as soon as it is read, before its payload arrives.
 */
export function decodeFrame(
  bytes: Uint8Array,
  maxLen: number,
  start = 0,
  end = bytes.length,
): [Frame, number] | undefined {
  if (start >= end) return undefined;
  const first = bytes[start]!;
  const kind = first & 0x0f;
  if (kind < Kind.Hello || kind > Kind.StreamBatch) {
    throw new FrameError("UnknownKind", `unknown frame kind ${kind}`);
  }
  const compression = (first >> 4) & 0x03;
  const upload = (first & 0x40) !== 0;
  if (compression === 3) throw new FrameError("BadFlags", "compression value 3");
  if (first & 0x80) throw new FrameError("BadFlags", "the reserved bit 7 is set");
  if (upload && !STREAM_KINDS.has(kind)) {
    throw new FrameError("BadFlags", `the upload bit on a ${kindName(kind as Kind)} frame`);
  }
  const id = readVarint(bytes, start + 1, end);
  if (id === undefined) return undefined;
  const [callId, at] = id;
  if (at + 8 > end) return undefined;
  const methodId = readU32(bytes, at);
  const len = readU32(bytes, at + 4);
  if (len > maxLen) {
    throw new FrameError("TooLarge", `a payload of ${len} bytes, over the limit of ${maxLen}`);
  }
  if (at + 8 + len > end) return undefined;
  const payload = bytes.subarray(at + 8, at + 8 + len);
  return [{ kind: kind as Kind, compression: compression as Compression, upload, callId, methodId, payload }, at + 8 + len];
}

/**
 * Reassembles frames from a byte stream whose chunks (WebSocket messages) have boundaries
 * that mean nothing. Holds at most one frame's worth of bytes beyond what it hands out.
 */
export class FrameReader {
  private buf = new Uint8Array(64 * 1024);
  private start = 0;
  private end = 0;

  /** @param maxLen the largest payload accepted (this side's `max_message_size`). */
  constructor(public maxLen: number) {}

  /** Appends a chunk and answers the frames it completes, in order. Throws a {@link FrameError}. */
  push(chunk: Uint8Array): Frame[] {
    const frames: Frame[] = [];
    if (this.start === this.end) {
      // Nothing buffered: decode straight from the chunk, and keep only its tail.
      let at = 0;
      for (;;) {
        const next = decodeFrame(chunk, this.maxLen, at);
        if (next === undefined) break;
        frames.push(next[0]);
        at = next[1];
      }
      this.start = this.end = 0;
      if (at < chunk.length) this.append(chunk.subarray(at));
      return frames;
    }
    this.append(chunk);
    for (;;) {
      const next = decodeFrame(this.buf, this.maxLen, this.start, this.end);
      if (next === undefined) break;
      // The buffer is reused: copy the payload out.
      next[0].payload = next[0].payload.slice();
      frames.push(next[0]);
      this.start = next[1];
    }
    if (this.start === this.end) this.start = this.end = 0;
    return frames;
  }

  /** Bytes received that do not make a whole frame yet. */
  get pending(): number {
    return this.end - this.start;
  }

  private append(bytes: Uint8Array): void {
    const len = this.end - this.start;
    if (this.end + bytes.length > this.buf.length) {
      if (len + bytes.length <= this.buf.length && this.start > 0) {
        this.buf.copyWithin(0, this.start, this.end);
      } else {
        const grown = new Uint8Array(Math.max(this.buf.length * 2, len + bytes.length));
        grown.set(this.buf.subarray(this.start, this.end));
        this.buf = grown;
      }
      this.start = 0;
      this.end = len;
    }
    this.buf.set(bytes, this.end);
    this.end += bytes.length;
  }
}

/**
 * The items of a `StreamBatch` payload: each a varint length, then its bytes. Stops after
 * `maxItems` (the caller's room in its window, plus one to see that it overflows), so that
 * a hostile batch of millions of empty items costs nothing.
 */
export function decodeBatch(payload: Uint8Array, maxItems = Infinity): Uint8Array[] {
  if (payload.length === 0) throw new FrameError("BadBatch", "an empty stream batch");
  const items: Uint8Array[] = [];
  let at = 0;
  try {
    while (at < payload.length && items.length < maxItems) {
      const len = readVarint(payload, at);
      if (len === undefined) throw new FrameError("BadBatch", "a stream batch ends inside a length");
      const [n, next] = len;
      if (typeof n !== "number" || next + n > payload.length) {
        throw new FrameError("BadBatch", "a stream batch ends inside an item");
      }
      items.push(payload.subarray(next, next + n));
      at = next + n;
    }
  } catch (e) {
    if (e instanceof FrameError && e.kind === "BadVarint") throw new FrameError("BadBatch", e.reason);
    throw e;
  }
  return items;
}

/** The payload of `Hello` and `HelloAck`. */
export interface Hello {
  version: number;
  /** 0 postcard, 1 MessagePack. */
  format: number;
  /** Bit 0 LZ4, bit 1 zstd: the codecs this side decodes. */
  decodes: number;
  maxMessageSize: number;
  maxInboundCalls: number;
  streamWindow: number;
  token: string;
}

const MAGIC = [0x43, 0x52, 0x50, 0x43];
const utf8 = new TextEncoder();
const utf8Strict = new TextDecoder("utf-8", { fatal: true });

/** Encodes a handshake payload. */
export function encodeHello(h: Hello): Uint8Array {
  const token = utf8.encode(h.token);
  if (token.length > 4096) throw new RangeError("a bearer token is at most 4096 bytes");
  const out = new Uint8Array(22 + token.length);
  out.set(MAGIC, 0);
  out[4] = h.version;
  out[5] = h.format;
  out[6] = h.decodes;
  out[7] = 0;
  writeU32(out, 8, h.maxMessageSize);
  writeU32(out, 12, h.maxInboundCalls);
  writeU32(out, 16, h.streamWindow);
  out[20] = token.length & 0xff;
  out[21] = token.length >> 8;
  out.set(token, 22);
  return out;
}

/** Decodes a handshake payload; throws an {@link RpcError} (`Protocol`, `UnsupportedVersion`). */
export function decodeHello(b: Uint8Array): Hello {
  const bad = (why: string) => new RpcError(ErrorCode.Protocol, `bad handshake: ${why}`);
  if (b.length < 22) throw bad(`${b.length} bytes, fewer than 22`);
  if (MAGIC.some((m, i) => b[i] !== m)) throw bad("no CRPC magic");
  if (b[4] !== 1) {
    throw new RpcError(ErrorCode.UnsupportedVersion, `protocol version ${b[4]}, this client speaks 1`);
  }
  if (b[5] !== 0 && b[5] !== 1) throw bad(`unknown format ${b[5]}`);
  if ((b[6]! & ~0x03) !== 0 || b[7] !== 0) throw bad("reserved bits set");
  const streamWindow = readU32(b, 16);
  if (streamWindow === 0) throw bad("a stream window of 0");
  const t = b[20]! | (b[21]! << 8);
  if (t > 4096) throw bad(`a token of ${t} bytes`);
  if (b.length !== 22 + t) throw bad(`${b.length} bytes where the token length says ${22 + t}`);
  let token: string;
  try {
    token = utf8Strict.decode(b.subarray(22));
  } catch {
    throw bad("a token that is not UTF-8");
  }
  return {
    version: b[4]!,
    format: b[5]!,
    decodes: b[6]!,
    maxMessageSize: readU32(b, 8),
    maxInboundCalls: readU32(b, 12),
    streamWindow,
    token,
  };
}

const utf8Lossy = new TextDecoder();

/** Encodes an `Error` or `Close` payload. */
export function encodeError(code: number, message: string): Uint8Array {
  let text = utf8.encode(message);
  if (text.length > 1024) text = text.subarray(0, 1024);
  const out = new Uint8Array(2 + text.length);
  out[0] = code & 0xff;
  out[1] = code >> 8;
  out.set(text, 2);
  return out;
}

/** Decodes an `Error` or `Close` payload (invalid UTF-8 is replaced, as the protocol says). */
export function decodeError(b: Uint8Array): RpcError {
  if (b.length < 2) return new RpcError(ErrorCode.Protocol, "an error payload shorter than 2 bytes");
  return new RpcError(b[0]! | (b[1]! << 8), utf8Lossy.decode(b.subarray(2)));
}
