/**
 * Payloads in format 1, MessagePack (PROTOCOL.md section 4), as the Rust side writes them:
 * structs are maps keyed by field name, enums are a variant's name or a one-entry map
 * `{Variant: data}`, byte strings are `Uint8Array`, `Option` is `null` or the value.
 * @module
 */

import { Decoder, Encoder } from "@msgpack/msgpack";

import { ErrorCode, RpcError } from "./errors.js";

// Numbers that are safe integers are written as integers in their smallest form, as the
// Rust side writes them (an i64 of microseconds is a uint 64). Decoding answers numbers,
// exact up to 2^53.
const encoder = new Encoder({ useBigInt64: false });
// For messages whose only integers past 2^32 are bigints (the replica layer's hashes): this
// encoder writes a bigint as a 64-bit integer, but a number past 2^32 as a float.
const wideEncoder = new Encoder({ useBigInt64: true });
// A hostile length claims at most what a payload can hold: every element takes a byte.
const MAX_LEN = 1 << 28;
const decoder = new Decoder({
  useBigInt64: false,
  maxStrLength: MAX_LEN,
  maxBinLength: MAX_LEN,
  maxArrayLength: MAX_LEN,
  maxMapLength: MAX_LEN,
  maxExtLength: MAX_LEN,
});

/**
 * The MessagePack bytes of `value` (a copy the caller owns). Integers must be safe integers
 * (a `bigint` is refused: the protocol's values past 2^53 are hashes, which the client
 * writes itself).
 */
export function encode(value: unknown): Uint8Array {
  try {
    return encoder.encode(value);
  } catch (e) {
    throw new RpcError(ErrorCode.BadArguments, `cannot encode: ${(e as Error).message}`, { cause: e });
  }
}

/** @internal The MessagePack bytes of a value whose integers are bigints or below 2^32. */
export function encodeWide(value: unknown): Uint8Array {
  return wideEncoder.encode(value);
}

/** The value of MessagePack `bytes`; throws an {@link RpcError} `BadArguments` when they do not decode. */
export function decode(bytes: Uint8Array): unknown {
  try {
    return decoder.decode(bytes);
  } catch (e) {
    throw new RpcError(ErrorCode.BadArguments, `cannot decode: ${(e as Error).message}`, { cause: e });
  }
}

/**
 * The MessagePack bytes of an argument tuple: an array of the arguments, except that a
 * method without arguments takes Rust's `()`, which is nil (PROTOCOL.md section 4).
 */
export function encodeArgs(args: readonly unknown[]): Uint8Array {
  return encode(args.length === 0 ? null : args);
}
