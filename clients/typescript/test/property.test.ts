// Round trips on random frames (fast-check): whatever the kind, flags, id, method and payload,
// and however the bytes are split into WebSocket messages, the reader gives back the frames.
import assert from "node:assert/strict";
import { test } from "node:test";

import fc from "fast-check";

import { decodeFrame, encodeFrame, FrameError, FrameReader, Kind } from "../src/frame.js";

const kinds = Object.values(Kind);
const streamKinds = new Set<number>([Kind.StreamItem, Kind.StreamEnd, Kind.StreamAck, Kind.StreamBatch]);

const frameArb = fc
  .record({
    kind: fc.constantFrom(...kinds),
    upload: fc.boolean(),
    callId: fc.oneof(fc.nat(), fc.bigInt({ min: 0n, max: 0xffff_ffff_ffff_ffffn })),
    methodId: fc.nat({ max: 0xffff_ffff }),
    payload: fc.uint8Array({ maxLength: 300 }),
  })
  .map((f) => ({
    ...f,
    upload: f.upload && streamKinds.has(f.kind),
    callId: typeof f.callId === "bigint" && f.callId <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(f.callId) : f.callId,
  }));

test("random frames round-trip through any split", () => {
  fc.assert(
    fc.property(fc.array(frameArb, { minLength: 1, maxLength: 20 }), fc.array(fc.integer({ min: 1, max: 50 })), (frames, cuts) => {
      const bytes = frames.map((f) => encodeFrame(f.kind, f.callId, f.methodId, f.payload, f.upload));
      const all = Buffer.concat(bytes);
      const reader = new FrameReader(1 << 20);
      const got = [];
      let at = 0;
      let i = 0;
      while (at < all.length) {
        const n = cuts.length > 0 ? cuts[i++ % cuts.length]! : all.length;
        got.push(...reader.push(all.subarray(at, at + n)));
        at += n;
      }
      assert.equal(got.length, frames.length);
      got.forEach((g, j) => {
        const f = frames[j]!;
        assert.equal(g.kind, f.kind);
        assert.equal(g.upload, f.upload);
        assert.equal(g.callId, f.callId);
        assert.equal(g.methodId, f.methodId);
        assert.deepEqual(Buffer.from(g.payload), Buffer.from(f.payload));
      });
    }),
    { numRuns: 500 },
  );
});

test("random bytes never throw anything but a FrameError", () => {
  fc.assert(
    fc.property(fc.uint8Array({ maxLength: 64 }), fc.nat({ max: 1 << 16 }), (bytes, max) => {
      try {
        const r = decodeFrame(bytes, max);
        if (r !== undefined) assert.ok(r[0].payload.length <= max);
      } catch (e) {
        assert.ok(e instanceof FrameError, String(e));
      }
    }),
    { numRuns: 5000 },
  );
});
