// Fuzzing the connection: a fake WebSocket that answers the handshake, then delivers random
// frames and random bytes, split anywhere. Nothing may escape as an exception, the
// connection either stays open or closes with an RpcError naming the reason (after sending
// `Close`), and every call waiting on it settles.
import assert from "node:assert/strict";
import { test } from "node:test";

import fc from "fast-check";

import { Connection, type WebSocketLike } from "../src/connection.js";
import { RpcError } from "../src/errors.js";
import { encodeFrame, encodeHello, Kind } from "../src/frame.js";

class FakeSocket implements WebSocketLike {
  static last: FakeSocket | undefined;
  binaryType = "arraybuffer";
  readyState = 0;
  bufferedAmount = 0;
  onopen: ((ev: unknown) => void) | null = null;
  onmessage: ((ev: { data: unknown }) => void) | null = null;
  onclose: ((ev: { code: number; reason: string }) => void) | null = null;
  onerror: ((ev: unknown) => void) | null = null;
  sent: Uint8Array[] = [];
  closedWith: { code: number | undefined; reason: string | undefined } | undefined;

  constructor(_url: string) {
    FakeSocket.last = this;
    queueMicrotask(() => {
      this.readyState = 1;
      this.onopen?.({});
    });
  }
  send(data: Uint8Array): void {
    this.sent.push(data.slice());
  }
  close(code?: number, reason?: string): void {
    if (this.closedWith) return;
    this.closedWith = { code, reason };
    this.readyState = 3;
    this.onclose?.({ code: code ?? 1005, reason: reason ?? "" });
  }
  deliver(bytes: Uint8Array): void {
    const copy = bytes.slice();
    this.onmessage?.({ data: copy.buffer });
  }
}

const ack = encodeFrame(
  Kind.HelloAck,
  0,
  0,
  encodeHello({ version: 1, format: 1, decodes: 0, maxMessageSize: 1 << 20, maxInboundCalls: 8, streamWindow: 4, token: "" }),
);

async function open(maxMessageSize: number): Promise<[Connection, FakeSocket]> {
  const pending = Connection.open("ws://fake", { WebSocket: FakeSocket, maxMessageSize, keepAliveMs: 1e9, idleTimeoutMs: 1e9 });
  await new Promise((r) => setTimeout(r, 0));
  const socket = FakeSocket.last!;
  socket.deliver(ack);
  return [await pending, socket];
}

const kinds = Object.values(Kind);
const randomFrame = fc
  .record({
    kind: fc.constantFrom(...kinds),
    upload: fc.boolean(),
    callId: fc.nat({ max: 6 }),
    methodId: fc.constantFrom(0, 1, 0x12345678),
    payload: fc.uint8Array({ maxLength: 40 }),
  })
  .map((f) =>
    encodeFrame(
      f.kind,
      f.callId,
      f.methodId,
      f.payload,
      f.upload && [Kind.StreamItem, Kind.StreamEnd, Kind.StreamAck, Kind.StreamBatch].includes(f.kind as 8),
    ),
  );
const chunk = fc.oneof(randomFrame, fc.uint8Array({ minLength: 1, maxLength: 30 }));

test("random frames and bytes after the handshake never escape, and close with a reason", async () => {
  await fc.assert(
    fc.asyncProperty(fc.array(chunk, { minLength: 1, maxLength: 12 }), fc.nat({ max: 7 }), async (chunks, cut) => {
      const [conn, socket] = await open(1024);
      const calls = [
        conn.call(1, new Uint8Array([0xc0])).then(
          () => "ok",
          (e: unknown) => e,
        ),
        (async () => {
          try {
            for await (const _ of conn.stream(2, new Uint8Array([0xc0]))) {
              // consume
            }
            return "ended";
          } catch (e) {
            return e;
          }
        })(),
      ];
      await new Promise((r) => setTimeout(r, 0));
      const all = Buffer.concat(chunks);
      const step = cut + 1;
      for (let i = 0; i < all.length && conn.isOpen; i += step) socket.deliver(all.subarray(i, i + step));
      await new Promise((r) => setTimeout(r, 0));
      if (conn.isOpen) {
        conn.close();
      } else {
        const why = await conn.closed;
        assert.ok(why instanceof RpcError, String(why));
        assert.ok(socket.closedWith, "the WebSocket is closed");
        const closeFrames = socket.sent.filter((b) => b[0] === Kind.Close);
        // Either this side found the fault (and said so) or the peer closed (Close frame).
        assert.ok(closeFrames.length <= 1);
      }
      // Every waiting call settles, with an answer or an error.
      const settled = await Promise.race([
        Promise.all(calls),
        new Promise((r) => setTimeout(() => r("stuck"), 1000)),
      ]);
      assert.notEqual(settled, "stuck", "a call was left waiting");
      for (const r of settled as unknown[]) assert.ok(r === "ok" || r === "ended" || r instanceof RpcError, String(r));
    }),
    { numRuns: 300 },
  );
});

test("a length over the limit closes at once, before its payload arrives", async () => {
  const [conn, socket] = await open(1024);
  const header = encodeFrame(Kind.Ok, 1, 0, new Uint8Array(0));
  header.set([0x01, 0x04, 0x00, 0x00], header.length - 4); // length 1025
  socket.deliver(header);
  const why = await conn.closed;
  assert.equal(why.codeName, "TooLarge");
  assert.ok(socket.sent.some((b) => b[0] === Kind.Close), "Close was sent with the reason");
});

test("more stream items than the window, unconsumed, is a protocol error", async () => {
  const [conn, socket] = await open(1 << 16);
  const items = conn.stream(7, new Uint8Array([0xc0]));
  const first = items.next();
  await new Promise((r) => setTimeout(r, 0));
  // The client's window is the default 64; the server sends 66 items in one batch.
  const batch = new Uint8Array(66 * 2);
  for (let i = 0; i < 66; i++) batch.set([1, i], i * 2);
  socket.deliver(encodeFrame(Kind.StreamBatch, 1, 0, batch));
  const why = await conn.closed;
  assert.equal(why.codeName, "Protocol");
  await first.then(
    () => {},
    () => {},
  );
});

test("frames queued in one turn go out in messages of at most about 1 MiB", async () => {
  const [conn, socket] = await open(1 << 20);
  socket.sent.length = 0;
  // 100 one-way calls of 48 KiB in one turn: 4.8 MB, which one message would carry whole.
  const payload = new Uint8Array(48 * 1024);
  for (let i = 0; i < 100; i++) conn.oneway(0x1234, payload);
  await new Promise((r) => setTimeout(r, 0));
  const total = socket.sent.reduce((n, m) => n + m.length, 0);
  assert.ok(total >= 100 * payload.length, `all sent: ${total}`);
  for (const m of socket.sent) assert.ok(m.length <= (1 << 20) + 64 * 1024, `a message of ${m.length} bytes`);
  assert.ok(socket.sent.length >= 5, `${socket.sent.length} messages`);
  conn.close();
});

/** A socket that never opens, and that answers a close while connecting as the `ws`
 * package does: with an "error" event a tick later, which nobody may leave unheard (an
 * event emitter with no listener for "error" throws, ending the process). */
class NeverOpens implements WebSocketLike {
  static last: NeverOpens | undefined;
  binaryType = "arraybuffer";
  readyState = 0;
  bufferedAmount = 0;
  onopen: ((ev: unknown) => void) | null = null;
  onmessage: ((ev: { data: unknown }) => void) | null = null;
  onclose: ((ev: { code: number; reason: string }) => void) | null = null;
  onerror: ((ev: unknown) => void) | null = null;
  unheardError = false;
  constructor(_url: string) {
    NeverOpens.last = this;
  }
  send(): void {
    throw new Error("not open");
  }
  close(): void {
    if (this.readyState !== 0) return;
    this.readyState = 2;
    setTimeout(() => {
      if (this.onerror) this.onerror(new Error("WebSocket was closed before the connection was established"));
      else this.unheardError = true;
      this.readyState = 3;
    }, 0);
  }
}

test("a handshake that times out while connecting rejects, and the socket's late error is heard", async () => {
  await assert.rejects(
    Connection.open("ws://fake", { WebSocket: NeverOpens, handshakeTimeoutMs: 20 }),
    (e: unknown) => e instanceof RpcError && /no handshake answer/.test(e.message),
  );
  await new Promise((r) => setTimeout(r, 10));
  assert.equal(NeverOpens.last!.readyState, 3);
  assert.equal(NeverOpens.last!.unheardError, false, "an error event with no listener would end a Node process");
});
