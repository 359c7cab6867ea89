/**
 * The FNV-1a hashes of the protocol: 32-bit method ids (section 4) and the 64-bit hash of a
 * replica's value bytes (section 9).
 * @module
 */

const encoder = new TextEncoder();

/** The id of a method: 32-bit FNV-1a of the UTF-8 of `"<Service>.<method>"`. */
export function methodId(name: string): number {
  let h = 0x811c9dc5;
  for (const b of encoder.encode(name)) {
    h ^= b;
    h = Math.imul(h, 0x01000193);
  }
  return h >>> 0;
}

/**
 * 64-bit FNV-1a of `bytes` (offset basis 0xCBF29CE484222325, prime 0x100000001B3), computed
 * on two 32-bit halves: what `ReplicaHost.revalidate` compares.
 */
export function valueHash(bytes: Uint8Array): bigint {
  // h = hi * 2^32 + lo; the prime is 2^40 + 0x1B3.
  let hi = 0xcbf29ce4;
  let lo = 0x84222325;
  for (let i = 0; i < bytes.length; i++) {
    lo ^= bytes[i]!;
    // (hi:lo) * 0x1B3 mod 2^64, plus lo * 2^40, which lands in the high half as lo << 8.
    const prod = (lo & 0xffff) * 0x1b3 + (lo >>> 16) * 0x1b3 * 0x10000; // < 2^42: exact
    const newLo = prod >>> 0;
    const carry = Math.floor(prod / 0x100000000);
    hi = (Math.imul(hi, 0x1b3) + carry + (lo << 8)) >>> 0;
    lo = newLo;
  }
  return (BigInt(hi) << 32n) | BigInt(lo);
}
