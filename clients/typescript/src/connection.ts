/**
 * One connection: a WebSocket carrying the protocol's byte stream. It runs the handshake,
 * numbers calls, matches answers, flow-controls server streams, serves the calls the server
 * makes (the replica layer's pushes), keeps the connection alive, and closes with a reason
 * on anything that breaks PROTOCOL.md. Payloads are bytes here; {@link Client} encodes them.
 * @module
 */

import { ErrorCode, RpcError } from "./errors.js";
import {
  type CallId,
  type Frame,
  FrameError,
  FrameReader,
  Kind,
  MAX_HEADER,
  decodeBatch,
  decodeError,
  decodeHello,
  encodeError,
  encodeFrame,
  encodeHello,
  type Hello,
  kindName,
  writeFrame,
} from "./frame.js";

/** What a `WebSocket` constructor must offer: the browser's, Node 22's, or the `ws` package's. */
export interface WebSocketLike {
  binaryType: string;
  readonly readyState: number;
  readonly bufferedAmount: number;
  onopen: ((ev: unknown) => void) | null;
  onmessage: ((ev: { data: unknown }) => void) | null;
  onclose: ((ev: { code: number; reason: string }) => void) | null;
  onerror: ((ev: unknown) => void) | null;
  send(data: Uint8Array): void;
  close(code?: number, reason?: string): void;
}

/** A `WebSocket` constructor. */
export type WebSocketFactory = new (url: string) => WebSocketLike;

/** Settings of a connection; every field has a default. */
export interface ConnectionOptions {
  /** The bearer token of the handshake (empty: none). */
  token?: string;
  /** The largest payload this side accepts (default 16 MiB). */
  maxMessageSize?: number;
  /** How many calls from the server this side runs at once (default 64). */
  maxInboundCalls?: number;
  /** Stream items the server may send ahead of this side's acks (default 64). */
  streamWindow?: number;
  /** How long the handshake may take (default 10 s). */
  handshakeTimeoutMs?: number;
  /** A `Ping` goes out after this long without sending (default 20 s). */
  keepAliveMs?: number;
  /** The connection closes after this long without receiving (default 60 s). */
  idleTimeoutMs?: number;
  /** The WebSocket implementation (default: the global `WebSocket`). */
  WebSocket?: WebSocketFactory;
}

/** Options of one call. */
export interface CallOptions {
  /** Aborting it cancels the call: the server is sent `Cancel`, the promise rejects `Cancelled`. */
  signal?: AbortSignal;
  /** The call's deadline, in ms from now: past it the call is cancelled and rejects `DeadlineExceeded`. */
  timeoutMs?: number;
}

/** Serves a call the server makes to this side; answers the encoded result. */
export type Handler = (payload: Uint8Array) => Uint8Array | Promise<Uint8Array>;

const FORMAT_MESSAGEPACK = 1;
const EARLY_LIMIT = 64 * 1024;
/**
 * Frames queued in one turn go out together up to this many bytes, then in a new message:
 * a server refuses a WebSocket message over its own limit (the Rust endpoint's is its
 * message limit plus a header, at least 1 MiB), and closes the connection.
 */
const BATCH_LIMIT = 1 << 20;
const OPEN = 1;

interface Pending {
  resolve(payload: Uint8Array): void;
  reject(e: RpcError): void;
  stream?: StreamState;
  cleanup?: () => void;
}

interface StreamState {
  items: Uint8Array[];
  ended: boolean;
  error?: RpcError;
  wake?: () => void;
  unacked: number;
}

const DEFAULTS = {
  token: "",
  maxMessageSize: 16 * 1024 * 1024,
  maxInboundCalls: 64,
  streamWindow: 64,
  handshakeTimeoutMs: 10_000,
  keepAliveMs: 20_000,
  idleTimeoutMs: 60_000,
};

function globalWebSocket(): WebSocketFactory {
  const ws = (globalThis as { WebSocket?: WebSocketFactory }).WebSocket;
  if (ws === undefined) {
    throw new TypeError(
      "no global WebSocket here (Node before 22): pass one, e.g. `{ WebSocket }` from the `ws` package",
    );
  }
  return ws;
}

/** An open, handshaken connection. */
export class Connection {
  /** The server's handshake. */
  readonly peer: Hello;
  /** Settles (never rejects) with the reason once the connection is closed. */
  readonly closed: Promise<RpcError>;

  private readonly ws: WebSocketLike;
  private readonly reader: FrameReader;
  private readonly opts: typeof DEFAULTS;
  private readonly handlers: Map<number, Handler>;
  private readonly calls = new Map<number, Pending>();
  private nextId = 1;
  private inbound = 0;
  private closeReason: RpcError | undefined;
  private settleClosed!: (e: RpcError) => void;
  private queue: Uint8Array[] = [];
  private queued = 0;
  private flushScheduled = false;
  private lastReceived = Date.now();
  private lastSent = Date.now();
  private timer: ReturnType<typeof setInterval> | undefined;

  private constructor(ws: WebSocketLike, reader: FrameReader, peer: Hello, opts: typeof DEFAULTS, handlers: Map<number, Handler>) {
    this.ws = ws;
    this.reader = reader;
    this.peer = peer;
    this.opts = opts;
    this.handlers = handlers;
    this.closed = new Promise((resolve) => (this.settleClosed = resolve));
  }

  /**
   * Opens a WebSocket to `url` and runs the handshake. Rejects with the server's reason
   * (`Unauthenticated`, `UnsupportedVersion`, ...) or `Disconnected`.
   * `handlers` serve the server's calls to this side, by method id.
   */
  static open(url: string, options: ConnectionOptions = {}, handlers = new Map<number, Handler>()): Promise<Connection> {
    const opts = { ...DEFAULTS, ...definedOnly(options) };
    const WS = options.WebSocket ?? globalWebSocket();
    return new Promise((resolve, reject) => {
      let ws: WebSocketLike;
      try {
        ws = new WS(url);
      } catch (e) {
        reject(new RpcError(ErrorCode.Disconnected, `cannot open ${url}: ${(e as Error).message}`, { cause: e }));
        return;
      }
      ws.binaryType = "arraybuffer";
      const reader = new FrameReader(opts.maxMessageSize);
      let done = false;
      const fail = (e: RpcError, code = 1000) => {
        if (done) return;
        done = true;
        clearTimeout(timeout);
        ws.onopen = ws.onmessage = ws.onclose = null;
        // Not `null`: the `ws` package answers a close before the connection opened (a
        // handshake that timed out while connecting) with an "error" event a tick later,
        // and an event emitter with no listener for it throws, ending the Node process.
        ws.onerror = () => {};
        try {
          ws.close(code, closeText(e));
        } catch {
          // already closed
        }
        reject(e);
      };
      const timeout = setTimeout(
        () => fail(new RpcError(ErrorCode.Disconnected, `no handshake answer in ${opts.handshakeTimeoutMs} ms`)),
        opts.handshakeTimeoutMs,
      );
      ws.onopen = () => {
        const hello = encodeHello({
          version: 1,
          format: FORMAT_MESSAGEPACK,
          decodes: 0,
          maxMessageSize: opts.maxMessageSize,
          maxInboundCalls: opts.maxInboundCalls,
          streamWindow: opts.streamWindow,
          token: opts.token,
        });
        ws.send(encodeFrame(Kind.Hello, 0, 0, hello));
      };
      ws.onerror = () => {
        // The close event follows with what little a WebSocket says.
      };
      ws.onclose = (ev) =>
        fail(new RpcError(ErrorCode.Disconnected, `the WebSocket closed before the handshake (${ev.code}${ev.reason ? `: ${ev.reason}` : ""})`));
      ws.onmessage = (ev) => {
        if (done) return;
        let frames: Frame[];
        try {
          frames = reader.push(bytesOf(ev.data));
        } catch (e) {
          fail(asRpcError(e), 1002);
          return;
        }
        if (frames.length === 0) return;
        const [first, ...rest] = frames as [Frame, ...Frame[]];
        if (first.kind === Kind.Close) {
          fail(decodeError(first.payload));
          return;
        }
        if (first.kind !== Kind.HelloAck) {
          fail(new RpcError(ErrorCode.Protocol, `a ${kindName(first.kind)} frame before the handshake's answer`), 1002);
          return;
        }
        let peer: Hello;
        try {
          peer = decodeHello(first.payload);
          if (peer.format !== FORMAT_MESSAGEPACK) {
            throw new RpcError(ErrorCode.Protocol, `the server chose format ${peer.format}, not MessagePack`);
          }
        } catch (e) {
          fail(asRpcError(e), 1002);
          return;
        }
        done = true;
        clearTimeout(timeout);
        const conn = new Connection(ws, reader, peer, opts, handlers);
        conn.attach();
        resolve(conn);
        // Frames that came in the same message as the answer.
        conn.dispatchAll(rest);
      };
    });
  }

  /** Whether the connection is still open. */
  get isOpen(): boolean {
    return this.closeReason === undefined;
  }

  /** Calls `methodId` with the encoded argument tuple; resolves with the encoded result. */
  call(methodId: number, args: Uint8Array, options: CallOptions = {}): Promise<Uint8Array> {
    return new Promise((resolve, reject) => {
      const id = this.start(methodId, args, reject, options);
      if (id === undefined) return;
      const pending = this.calls.get(id)!;
      pending.resolve = (p) => {
        pending.cleanup?.();
        resolve(p);
      };
    });
  }

  /** Sends a one-way call: no answer of any kind. */
  oneway(methodId: number, args: Uint8Array): void {
    if (!this.isOpen) return;
    this.checkSize(args);
    this.send(Kind.OneWay, this.nextId++, methodId, args);
  }

  /**
   * Calls a method that answers a stream: its items, encoded, as they arrive. Credits go back
   * as items are consumed, so a slow consumer holds the server back to the stream window.
   * Leaving the loop early (`break`, `return`) cancels the stream.
   */
  stream(methodId: number, args: Uint8Array, options: CallOptions = {}): AsyncIterableIterator<Uint8Array> {
    const state: StreamState = { items: [], ended: false, unacked: 0 };
    let failure: RpcError | undefined;
    const id = this.start(methodId, args, (e) => (failure = e), options, state);
    const half = Math.ceil(this.opts.streamWindow / 2);
    const self = this;
    const finish = () => {
      if (id !== undefined && self.calls.has(id)) {
        self.calls.get(id)!.cleanup?.();
        self.calls.delete(id);
        self.send(Kind.Cancel, id, 0, EMPTY);
      }
    };
    return {
      [Symbol.asyncIterator]() {
        return this;
      },
      async next(): Promise<IteratorResult<Uint8Array>> {
        for (;;) {
          // Items that arrived before an error are still delivered.
          const item = state.items.shift();
          if (item !== undefined) {
            if (++state.unacked >= half && id !== undefined && self.calls.has(id)) {
              const credits = new Uint8Array(4);
              new DataView(credits.buffer).setUint32(0, state.unacked, true);
              self.send(Kind.StreamAck, id, 0, credits);
              state.unacked = 0;
            }
            return { value: item, done: false };
          }
          if (failure !== undefined) throw failure;
          if (state.error !== undefined) throw state.error;
          if (state.ended) return { value: undefined, done: true };
          await new Promise<void>((wake) => (state.wake = wake));
        }
      },
      async return(): Promise<IteratorResult<Uint8Array>> {
        finish();
        state.ended = true;
        state.items.length = 0;
        // A `next()` still waiting ends too.
        state.wake?.();
        return { value: undefined, done: true };
      },
    };
  }

  /** Closes the connection, telling the server why (`Close` with `code` and `message`). */
  close(code: number = ErrorCode.Disconnected, message = "the client closed the connection"): void {
    this.shutdown(new RpcError(code, message), true);
  }

  private start(
    methodId: number,
    args: Uint8Array,
    reject: (e: RpcError) => void,
    options: CallOptions,
    stream?: StreamState,
  ): number | undefined {
    if (this.closeReason !== undefined) {
      reject(new RpcError(ErrorCode.Disconnected, this.closeReason.reason));
      return undefined;
    }
    try {
      this.checkSize(args);
    } catch (e) {
      reject(e as RpcError);
      return undefined;
    }
    if (options.signal?.aborted) {
      reject(new RpcError(ErrorCode.Cancelled, "the call was cancelled before it was sent"));
      return undefined;
    }
    const id = this.nextId++;
    const pending: Pending = {
      resolve: () => {},
      reject: (e) => {
        pending.cleanup?.();
        if (stream) {
          stream.error = e;
          stream.wake?.();
        }
        reject(e);
      },
    };
    if (stream) pending.stream = stream;
    const abandon = (e: RpcError) => {
      if (!this.calls.delete(id)) return;
      this.send(Kind.Cancel, id, 0, EMPTY);
      pending.reject(e);
    };
    let timer: ReturnType<typeof setTimeout> | undefined;
    if (options.timeoutMs !== undefined) {
      timer = setTimeout(
        () => abandon(new RpcError(ErrorCode.DeadlineExceeded, `no answer within ${options.timeoutMs} ms`)),
        options.timeoutMs,
      );
    }
    const onAbort = () => abandon(new RpcError(ErrorCode.Cancelled, "the call was cancelled"));
    options.signal?.addEventListener("abort", onAbort, { once: true });
    if (timer !== undefined || options.signal !== undefined) {
      pending.cleanup = () => {
        if (timer !== undefined) clearTimeout(timer);
        options.signal?.removeEventListener("abort", onAbort);
      };
    }
    this.calls.set(id, pending);
    this.send(Kind.Call, id, methodId, args);
    return id;
  }

  private checkSize(args: Uint8Array): void {
    if (args.length > this.peer.maxMessageSize) {
      throw new RpcError(
        ErrorCode.TooLarge,
        `arguments of ${args.length} bytes, over the server's limit of ${this.peer.maxMessageSize}`,
      );
    }
  }

  /** Queues a frame; frames queued in one turn of the event loop go out as one message. */
  private send(kind: Kind, id: CallId, methodId: number, payload: Uint8Array): void {
    if (this.closeReason !== undefined) return;
    if (payload.length > EARLY_LIMIT) {
      this.flush();
      this.write(encodeFrame(kind, id, methodId, payload));
      return;
    }
    const frame = new Uint8Array(MAX_HEADER + payload.length);
    const end = writeFrame(frame, 0, kind, id, methodId, payload);
    this.queue.push(frame.subarray(0, end));
    this.queued += end;
    if (this.queued >= BATCH_LIMIT) {
      this.flush();
      return;
    }
    if (!this.flushScheduled) {
      this.flushScheduled = true;
      queueMicrotask(() => this.flush());
    }
  }

  private flush(): void {
    this.flushScheduled = false;
    if (this.queue.length === 0) return;
    const q = this.queue;
    let out: Uint8Array;
    if (q.length === 1) {
      out = q[0]!;
    } else {
      out = new Uint8Array(this.queued);
      let at = 0;
      for (const f of q) {
        out.set(f, at);
        at += f.length;
      }
    }
    this.queue = [];
    this.queued = 0;
    this.write(out);
  }

  private write(bytes: Uint8Array): void {
    if (this.ws.readyState !== OPEN) return;
    this.lastSent = Date.now();
    this.ws.send(bytes);
  }

  private attach(): void {
    this.ws.onmessage = (ev) => {
      this.lastReceived = Date.now();
      let frames: Frame[];
      try {
        frames = this.reader.push(bytesOf(ev.data));
      } catch (e) {
        this.shutdown(asRpcError(e), true);
        return;
      }
      this.dispatchAll(frames);
    };
    this.ws.onclose = (ev) =>
      this.shutdown(
        new RpcError(ErrorCode.Disconnected, `the WebSocket closed (${ev.code}${ev.reason ? `: ${ev.reason}` : ""})`),
        false,
      );
    this.ws.onerror = () => {};
    const tick = Math.max(10, Math.min(this.opts.keepAliveMs, this.opts.idleTimeoutMs / 2));
    this.timer = setInterval(() => this.keepAlive(), tick);
    (this.timer as { unref?: () => void }).unref?.();
  }

  private keepAlive(): void {
    const now = Date.now();
    if (now - this.lastReceived > this.opts.idleTimeoutMs) {
      this.shutdown(new RpcError(ErrorCode.Disconnected, `nothing received for ${this.opts.idleTimeoutMs} ms`), true);
    } else if (now - this.lastSent >= this.opts.keepAliveMs) {
      this.send(Kind.Ping, 0, 0, EMPTY);
    }
  }

  private dispatchAll(frames: Frame[]): void {
    for (const f of frames) {
      if (this.closeReason !== undefined) return;
      try {
        this.dispatch(f);
      } catch (e) {
        this.shutdown(asRpcError(e), true);
        return;
      }
    }
  }

  private dispatch(f: Frame): void {
    if (f.compression !== 0) {
      throw new RpcError(ErrorCode.Protocol, "a compressed payload, though this client decodes no compression");
    }
    switch (f.kind) {
      case Kind.Ok:
      case Kind.Error:
      case Kind.StreamItem:
      case Kind.StreamBatch:
      case Kind.StreamEnd:
        if (f.upload) throw new RpcError(ErrorCode.Protocol, "an upload frame, though this client makes no uploads");
        this.answer(f);
        return;
      case Kind.Call:
      case Kind.OneWay:
        this.serve(f);
        return;
      case Kind.Cancel:
        // Inbound calls run to completion here; their answers are then dropped by the server.
        return;
      case Kind.StreamAck:
        if (f.payload.length !== 4) throw new RpcError(ErrorCode.Protocol, "a StreamAck whose payload is not 4 bytes");
        return;
      case Kind.Ping:
        this.send(Kind.Pong, 0, 0, f.payload.slice());
        return;
      case Kind.Pong:
        return;
      case Kind.Close: {
        const why = decodeError(f.payload);
        this.shutdown(new RpcError(why.code === ErrorCode.Disconnected ? why.code : ErrorCode.Disconnected, `the server closed the connection: ${why.message}`), false, why);
        return;
      }
      case Kind.Hello:
      case Kind.HelloAck:
        throw new RpcError(ErrorCode.Protocol, `a second ${kindName(f.kind)}`);
    }
  }

  private answer(f: Frame): void {
    if (typeof f.callId !== "number") return;
    const pending = this.calls.get(f.callId);
    // An answer that crossed our Cancel: the id is forgotten.
    if (pending === undefined) return;
    const stream = pending.stream;
    switch (f.kind) {
      case Kind.Ok:
        // (The call stays in the table, so that closing fails it with the reason.)
        if (stream) throw new RpcError(ErrorCode.Protocol, "an Ok frame for a stream");
        this.calls.delete(f.callId);
        pending.resolve(f.payload);
        return;
      case Kind.Error:
        this.calls.delete(f.callId);
        pending.reject(decodeError(f.payload));
        return;
      case Kind.StreamEnd:
        if (!stream) throw new RpcError(ErrorCode.Protocol, "a StreamEnd for a unary call");
        this.calls.delete(f.callId);
        pending.cleanup?.();
        stream.ended = true;
        stream.wake?.();
        return;
      default: {
        if (!stream) throw new RpcError(ErrorCode.Protocol, `a ${kindName(f.kind)} for a unary call`);
        // Never more than the window: a batch is cut off past it, not decoded whole.
        const room = this.opts.streamWindow - stream.items.length;
        if (f.kind === Kind.StreamItem) stream.items.push(f.payload);
        else for (const item of decodeBatch(f.payload, room + 1)) stream.items.push(item);
        if (stream.items.length > this.opts.streamWindow) {
          throw new RpcError(
            ErrorCode.Protocol,
            `the server sent ${stream.items.length} stream items unconsumed, past the window of ${this.opts.streamWindow}`,
          );
        }
        stream.wake?.();
      }
    }
  }

  private serve(f: Frame): void {
    const oneway = f.kind === Kind.OneWay;
    const id = f.callId;
    const handler = this.handlers.get(f.methodId);
    if (handler === undefined) {
      if (!oneway) {
        this.send(Kind.Error, id, 0, encodeError(ErrorCode.UnknownMethod, `this client serves no method ${f.methodId}`));
      }
      return;
    }
    if (!oneway && this.inbound >= this.opts.maxInboundCalls) {
      this.send(Kind.Error, id, 0, encodeError(ErrorCode.Overloaded, "too many calls running"));
      return;
    }
    this.inbound++;
    const done = (kind: Kind, payload: Uint8Array) => {
      this.inbound--;
      if (!oneway) this.send(kind, id, 0, payload);
    };
    try {
      const result = handler(f.payload);
      if (result instanceof Uint8Array) done(Kind.Ok, result);
      else
        result.then(
          (r) => done(Kind.Ok, r),
          (e) => done(Kind.Error, encodeError(asRpcError(e).code, asRpcError(e).reason)),
        );
    } catch (e) {
      const err = asRpcError(e);
      done(Kind.Error, encodeError(err.code === ErrorCode.BadArguments ? err.code : ErrorCode.Internal, err.reason));
    }
  }

  /**
   * Ends the connection once: fails every waiting call with `Disconnected` (naming why),
   * and, when this side found the fault, sends `Close` with the reason first.
   */
  private shutdown(reason: RpcError, sendClose: boolean, serverReason?: RpcError): void {
    if (this.closeReason !== undefined) return;
    this.closeReason = serverReason ?? reason;
    if (this.timer !== undefined) clearInterval(this.timer);
    if (sendClose && this.ws.readyState === OPEN) {
      this.queue = [];
      this.queued = 0;
      try {
        this.ws.send(encodeFrame(Kind.Close, 0, 0, encodeError(reason.code, reason.reason)));
      } catch {
        // the socket is going anyway
      }
    }
    try {
      this.ws.close(reason.code === ErrorCode.Protocol || reason.code === ErrorCode.TooLarge ? 1002 : 1000, closeText(reason));
    } catch {
      // already closed
    }
    const failure =
      reason.code === ErrorCode.Disconnected
        ? reason
        : new RpcError(ErrorCode.Disconnected, `the connection closed: ${reason.message}`, { cause: reason });
    const calls = [...this.calls.values()];
    this.calls.clear();
    for (const c of calls) c.reject(failure);
    this.settleClosed(this.closeReason);
  }
}

const EMPTY = new Uint8Array(0);

/** A WebSocket close reason is at most 123 bytes. */
function closeText(e: RpcError): string {
  const text = e.message;
  const bytes = new TextEncoder().encode(text);
  if (bytes.length <= 123) return text;
  return new TextDecoder().decode(bytes.subarray(0, 120)).replace(/\uFFFD$/, "") + "...";
}

function bytesOf(data: unknown): Uint8Array {
  if (data instanceof ArrayBuffer) return new Uint8Array(data);
  if (ArrayBuffer.isView(data)) return new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
  if (Array.isArray(data)) {
    // The `ws` package may hand fragments as an array of Buffers.
    const parts = data.map(bytesOf);
    const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
    let at = 0;
    for (const p of parts) {
      out.set(p, at);
      at += p.length;
    }
    return out;
  }
  // Text messages carry nothing in this protocol.
  return EMPTY;
}

/** Anything thrown, as an {@link RpcError}. */
export function asRpcError(e: unknown): RpcError {
  if (e instanceof RpcError) return e;
  if (e instanceof FrameError) return e;
  return new RpcError(ErrorCode.Internal, e instanceof Error ? e.message : String(e), { cause: e });
}

function definedOnly<T extends object>(o: T): Partial<T> {
  return Object.fromEntries(Object.entries(o).filter(([, v]) => v !== undefined)) as Partial<T>;
}
