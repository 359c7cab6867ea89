/**
 * The client: a connection that comes back (reconnection with backoff and jitter), calls and
 * streams by method name, and replicas of a server's compute methods that stay current.
 * @module
 */

import { decode, encode, encodeArgs, encodeWide } from "./codec.js";
import { type CallOptions, Connection, type ConnectionOptions, type Handler, asRpcError } from "./connection.js";
import { ErrorCode, RpcError } from "./errors.js";
import { methodId, valueHash } from "./hash.js";
import { Listeners, type Observable, batch, track } from "./reactive.js";

/**
 * What a service's declarations (generated from Rust) say about its compute methods: for
 * each `"Service.method"`, its argument tuple and its result. With it, `client.replica` and
 * `client.compute` are type-checked against the server.
 */
export type ComputeMethods<S = Record<string, MethodShape>> = { [K in keyof S]: MethodShape };

/** One compute method in {@link ComputeMethods}. */
export interface MethodShape {
  args: readonly unknown[];
  result: unknown;
}

/** Where the client's connection stands. */
export type ClientState =
  /** The first connection is being made. */
  | "connecting"
  /** Connected, and every replica has been checked against the server. */
  | "live"
  /** The connection was lost; a new one is being made at once. */
  | "reconnecting"
  /** The server could not be reached; the client tries again after a backoff. */
  | "offline"
  /** {@link Client.close} was called. */
  | "closed";

/** How the client comes back after a lost connection. */
export interface ReconnectOptions {
  /** The first retry's delay (default 250 ms); each failure doubles it. */
  initialDelayMs?: number;
  /** The longest delay (default 10 s). */
  maxDelayMs?: number;
}

/** Settings of a client; every field has a default. */
export interface ClientOptions extends ConnectionOptions {
  /** How reconnection backs off (`false`: the client stays closed after a lost connection). */
  reconnect?: ReconnectOptions | false;
  /**
   * A replica nobody has watched for this long is dropped, and the server told to stop
   * watching it (default 5 s), so a page that navigates back finds it still current.
   */
  releaseDelayMs?: number;
  /**
   * How long the client answers from its replicas without hearing from the server (default
   * 2 s; `null`: as long as the connection is open). The client holds a lease: every quarter
   * of this (sooner when the server has less left) it calls `ReplicaHost.lease`, which a
   * server answers once the client applied every invalidation it had sent, with how long
   * its own caches may still answer; {@link Replica.get} answers from a replica only until
   * the renewal's send time plus the least of the two, and a connection that answered no
   * renewal sent in this long is closed (the client reconnects and revalidates). While
   * the lease is out on a live connection (the server's own caches fenced, say), `get()`
   * fetches the value again and answers with it, as a Rust client's read goes to the
   * server. So a client whose connection went half-open, or whose process was paused,
   * answers no value the server stopped vouching for: a write waits for a trusted client
   * (a Node.js tier) at most its delivery timeout (5 s), and the lease runs out before
   * that. A server that promises nothing to this connection (a browser's: writes never
   * wait for it) answers without bound, and the client stops renewing; one that predates
   * leases is asked with an empty `ReplicaHost.revalidate` instead, which bounds the
   * lease by this alone. At most 2^31 - 1 ms.
   */
  livenessMs?: number | null;
}

const REPLICA_HOST = {
  fetch: methodId("ReplicaHost.fetch"),
  call: methodId("ReplicaHost.call"),
  revalidate: methodId("ReplicaHost.revalidate"),
  release: methodId("ReplicaHost.release"),
  lease: methodId("ReplicaHost.lease"),
};
/** The shortest wait between two lease renewals (a server whose caches are fenced answers 0 left). */
const LEASE_RENEWAL_MIN_MS = 5;
/** Nanoseconds from which a lease answer means "no bound" (the server answers 2^64 - 1). */
const UNBOUNDED_NS = 2 ** 63;
/** The longest delay `setTimeout` keeps (a longer one fires at once). */
const MAX_TIMER_MS = 2 ** 31 - 1;
/** Monotonic milliseconds (they count a paused process's time too). */
const now = (): number => performance.now();
const INVALIDATED = methodId("ReplicaSink.invalidated");
const NIL = encode(null);

/** Where a replica stands. */
export type ReplicaStatus =
  /** No value yet: the first fetch is under way. */
  | "loading"
  /** The value is the server's current one (as far as a live connection knows). */
  | "current"
  /** The server said the value changed; a new one is fetched while it is watched. */
  | "invalidated"
  /** The server answered an error ({@link Replica.error}). */
  | "error";

/**
 * A replica of one compute method's result on the server: the value, kept current by the
 * server's invalidations. Reading {@link value} inside a `computed` records the dependency.
 * While something watches it (a subscriber, a watched computed, a React component), a new
 * value is fetched as soon as the server says the old one changed.
 */
export class Replica<T> implements Observable {
  /** The compute method, `"Service.method"`. */
  readonly method: string;
  /** Its arguments. */
  readonly args: readonly unknown[];

  /** @internal */ readonly key: string;
  /** @internal */ readonly methodId: number;
  /** @internal */ readonly argBytes: Uint8Array;
  /** @internal */ watchId: number | undefined;
  /** @internal */ hash: bigint | undefined;
  /** @internal */ invalidatedWhileLoading = false;
  /** @internal */ fetching = false;
  /** @internal */ releaseTimer: ReturnType<typeof setTimeout> | undefined;

  private current: T | undefined;
  private failure: RpcError | undefined;
  private state: ReplicaStatus = "loading";
  private changes = 0;
  private readonly client: Client<ComputeMethods>;
  private readonly listeners: Listeners;
  private waiters: Waiter<T>[] = [];

  /** @internal */
  constructor(client: Client<ComputeMethods>, method: string, args: readonly unknown[], key: string, argBytes: Uint8Array) {
    this.client = client;
    this.method = method;
    this.args = args;
    this.key = key;
    this.methodId = methodId(method);
    this.argBytes = argBytes;
    this.listeners = new Listeners(
      () => client.observed(this),
      () => client.unobserved(this),
    );
  }

  /** The last value received (while `invalidated`, the previous one); `undefined` while loading. */
  get value(): T | undefined {
    track(this);
    this.client.touch(this);
    return this.current;
  }

  /** Where it stands (recorded as a read, like {@link value}). */
  get status(): ReplicaStatus {
    track(this);
    return this.state;
  }

  /** The server's error, when {@link status} is `"error"`. */
  get error(): RpcError | undefined {
    track(this);
    return this.failure;
  }

  /** A count of its changes (value or status), not recorded as a read: a cheap snapshot. */
  get version(): number {
    return this.changes;
  }

  /** Whether something watches it (and so keeps it fetched). */
  get isWatched(): boolean {
    return this.listeners.size > 0;
  }

  /** Calls `listener` after each change of value or status. */
  subscribe(listener: () => void): () => void {
    return this.listeners.add(listener);
  }

  /**
   * The current value: at once when it is current, the client is live and its lease runs
   * ({@link ClientOptions.livenessMs}); otherwise once the client is live again and has
   * checked it (or renewed its lease), or after the fetch this starts. Rejects
   * with the server's error when the replica is in `"error"` (see {@link refresh}).
   */
  get(): Promise<T> {
    if (this.state === "error") return Promise.reject(this.failure);
    if (this.state === "current" && this.client.answersFromReplicas) return Promise.resolve(this.current as T);
    const p = new Promise<T>((resolve, reject) => this.waiters.push({ resolve, reject }));
    this.client.touch(this);
    return p;
  }

  /** @internal The waiters of `get()` now: those a fetch sent now may answer. */
  waitersNow(): readonly Waiter<T>[] {
    return this.waiters.slice();
  }

  /** @internal Answers those of `these` still waiting with `value`, fetched after they began. */
  answer(these: readonly Waiter<T>[], value: T): void {
    if (these.length === 0) return;
    const answered = new Set(these);
    const left: Waiter<T>[] = [];
    for (const w of this.waiters) {
      if (answered.has(w)) w.resolve(value);
      else left.push(w);
    }
    this.waiters = left;
  }

  /**
   * @internal Resolves the waiters of `get()` when the value is current, the client live
   * and its lease running.
   */
  confirm(): void {
    if (this.state !== "current" || !this.client.answersFromReplicas) return;
    const w = this.waiters;
    this.waiters = [];
    for (const x of w) x.resolve(this.current as T);
  }

  /** @internal A value arrived. */
  settle(value: T, hash: bigint, stillCurrent: boolean): void {
    this.current = value;
    this.hash = hash;
    this.failure = undefined;
    this.state = stillCurrent ? "current" : "invalidated";
    if (stillCurrent) this.confirm();
    this.changed();
  }

  /** @internal The server answered an error. */
  fail(error: RpcError): void {
    this.failure = error;
    this.state = "error";
    this.hash = undefined;
    this.abandon(error);
    this.changed();
  }

  /** @internal The server said the value changed. */
  invalidate(): void {
    if (this.state === "loading") return;
    this.state = "invalidated";
    this.changed();
  }

  private changed(): void {
    this.changes++;
    this.listeners.notify();
  }

  /** @internal The state as the client sees it (untracked). */
  get statusNow(): ReplicaStatus {
    return this.state;
  }

  /** @internal Whether anybody waits on {@link get}. */
  get hasWaiters(): boolean {
    return this.waiters.length > 0;
  }

  /** Fetches the value again after an error (an error stays until then, or a reconnect). */
  refresh(): void {
    if (this.state === "error") {
      this.state = "loading";
      this.changed();
      this.client.touch(this);
    }
  }

  /** @internal Dropped by the client: no longer watched by the server. */
  released(): void {
    this.fetching = false;
    this.watchId = undefined;
    if (this.state === "current" || this.state === "loading") {
      this.state = this.current === undefined ? "loading" : "invalidated";
      this.changed();
    }
  }

  /** @internal Rejects the waiters of `get()` (the server's error, or the client closed). */
  abandon(error: RpcError): void {
    const w = this.waiters;
    this.waiters = [];
    for (const x of w) x.reject(error);
  }
}

type Encoded<T> = { Ok: Uint8Array } | { Err: T };

/** A caller of {@link Replica.get} waiting for its answer. */
interface Waiter<T> {
  resolve(v: T): void;
  reject(e: RpcError): void;
}

/**
 * A Coherent client over a WebSocket. It connects at once and stays connected: after a lost
 * connection it reconnects with exponential backoff and jitter, then revalidates every
 * replica by hash before it says `live` again.
 *
 * ```ts
 * const client = new Client<TasksService>("ws://127.0.0.1:8080/rpc", { token });
 * const task = client.replica("TasksService.task", id);   // type-checked against Rust
 * effect(() => render(task.value));
 * ```
 */
export class Client<S extends ComputeMethods<S> = Record<string, MethodShape>> {
  /** The WebSocket URL. */
  readonly url: string;

  private readonly options: ClientOptions;
  private readonly releaseDelayMs: number;
  private conn: Connection | undefined;
  private waitingForConnection: { resolve(c: Connection): void; reject(e: RpcError): void }[] = [];
  private currentState: ClientState = "connecting";
  private readonly stateListeners = new Listeners();
  private lastFailure: RpcError | undefined;
  private closedByUser = false;
  private readonly replicas = new Map<string, Replica<unknown>>();
  private readonly watched = new Map<number, Replica<unknown>>();
  private nextReplicaId = 1;
  private toRelease: number[] = [];
  private wakeRetry: (() => void) | undefined;
  private readonly handlers = new Map<number, Handler>();
  private readonly livenessMs: number | null;
  /** Until when (monotonic ms) replicas may answer: `Infinity` when unbounded, 0 when out. */
  private leaseUntil = 0;
  /** Whether the last renewal granted time (a later lapse of it is a lease lost). */
  private leaseGranted = false;
  private lostLeases = 0;
  /** Connections to a server that predates leases (it answered `UnknownMethod`). */
  private readonly noLeaseCall = new WeakSet<Connection>();

  constructor(url: string, options: ClientOptions = {}) {
    this.url = url;
    this.options = options;
    this.releaseDelayMs = options.releaseDelayMs ?? 5_000;
    const liveness = options.livenessMs === undefined ? 2_000 : options.livenessMs;
    if (liveness !== null && !(liveness > 0 && liveness <= MAX_TIMER_MS)) {
      throw new RangeError(`livenessMs must be a number of milliseconds in (0, ${MAX_TIMER_MS}] or null, not ${liveness}`);
    }
    this.livenessMs = liveness;
    this.handlers.set(INVALIDATED, (payload) => this.onInvalidated(payload));
    void this.run();
  }

  /** Where the connection stands. */
  get state(): ClientState {
    track(this.stateSource);
    return this.currentState;
  }

  /** Why the last connection ended or the last attempt failed. */
  get lastError(): RpcError | undefined {
    return this.lastFailure;
  }

  /** Whether the client is `live` (read without recording a dependency). */
  get isLive(): boolean {
    return this.currentState === "live";
  }

  /**
   * Whether a current replica answers {@link Replica.get} at once: the client is live and
   * its lease runs ({@link ClientOptions.livenessMs}).
   */
  get answersFromReplicas(): boolean {
    return this.currentState === "live" && (this.livenessMs === null || now() < this.leaseUntil);
  }

  /** How many times a lease the server had granted ran out before it was renewed. */
  get leasesLost(): number {
    return this.lostLeases;
  }

  /** Calls `listener` after each change of {@link state}. */
  onStateChange(listener: (state: ClientState) => void): () => void {
    return this.stateListeners.add(() => listener(this.currentState));
  }

  private stateChanges = 0;

  /** The state as an observable, for `computed` and `useComputed`. */
  readonly stateSource: Observable = (() => {
    const self = this;
    return {
      subscribe: (l: () => void) => self.stateListeners.add(l),
      get version() {
        return self.stateChanges;
      },
    };
  })();

  /** Resolves once the client is `live` (rejects if it is closed first). */
  ready(): Promise<void> {
    if (this.currentState === "live") return Promise.resolve();
    if (this.currentState === "closed") return Promise.reject(new RpcError(ErrorCode.Disconnected, "the client is closed"));
    return new Promise((resolve, reject) => {
      const off = this.onStateChange((s) => {
        if (s === "live") {
          off();
          resolve();
        } else if (s === "closed") {
          off();
          reject(new RpcError(ErrorCode.Disconnected, "the client is closed"));
        }
      });
    });
  }

  /**
   * Calls an RPC method by name (`"Service.method"`) with its arguments; resolves with its
   * result. A call made while the client is reconnecting waits for the connection, within
   * its deadline. Errors are {@link RpcError}s with the protocol's codes.
   */
  async call<R = unknown>(method: string, args: readonly unknown[] = [], options: CallOptions = {}): Promise<R> {
    const bytes = encodeArgs(args);
    const deadline = options.timeoutMs === undefined ? undefined : Date.now() + options.timeoutMs;
    const conn = await this.connection(options);
    return decode(await conn.call(methodId(method), bytes, remaining(options, deadline))) as R;
  }

  /** Sends a one-way call (no answer; nothing is sent while disconnected). */
  oneway(method: string, args: readonly unknown[] = []): void {
    this.conn?.oneway(methodId(method), encodeArgs(args));
  }

  /** Calls a method that answers a stream; iterate it with `for await`. Breaking out cancels it. */
  async *stream<R = unknown>(method: string, args: readonly unknown[] = [], options: CallOptions = {}): AsyncGenerator<R> {
    const bytes = encodeArgs(args);
    const deadline = options.timeoutMs === undefined ? undefined : Date.now() + options.timeoutMs;
    const conn = await this.connection(options);
    const items = conn.stream(methodId(method), bytes, remaining(options, deadline));
    try {
      for await (const item of items) yield decode(item) as R;
    } finally {
      await items.return?.();
    }
  }

  /** Calls a compute method once (answered from the server's cache), without holding a replica. */
  async compute<M extends keyof S & string>(method: M, ...args: S[M]["args"]): Promise<S[M]["result"]> {
    const conn = await this.connection({});
    const answer = await conn.call(REPLICA_HOST.call, encode([methodId(method), encodeArgs(args)]));
    return decode(unwrap(decode(answer) as Encoded<unknown>)) as S[M]["result"];
  }

  /**
   * The replica of compute method `method` for `args`: one per method and arguments, shared
   * by everything that asks for it. It is fetched on first use and kept current.
   */
  replica<M extends keyof S & string>(method: M, ...args: S[M]["args"]): Replica<S[M]["result"]> {
    const argBytes = encodeArgs(args);
    const key = `${method}\u0000${hex(argBytes)}`;
    let r = this.replicas.get(key);
    if (r === undefined) {
      r = new Replica(this as Client<ComputeMethods>, method, args, key, argBytes);
      this.replicas.set(key, r);
      // One that is never read nor watched goes too.
      this.unobserved(r);
    }
    return r as Replica<S[M]["result"]>;
  }

  /** How many replicas the client holds. */
  get replicaCount(): number {
    return this.replicas.size;
  }

  /**
   * Drops the connection and connects again at once, revalidating every replica held, as
   * after any reconnect: what a page does after its user logged in or out, so that the
   * server sees the new login cookie on the new connection's upgrade. Calls made meanwhile
   * wait for the new connection; calls in flight on the old one fail with `Disconnected`.
   */
  reconnect(): void {
    if (this.closedByUser) return;
    this.conn?.close();
  }

  /** Closes the connection and stops reconnecting; waiting calls fail with `Disconnected`. */
  close(): void {
    if (this.closedByUser) return;
    this.closedByUser = true;
    this.conn?.close();
    this.wakeRetry?.();
    const e = new RpcError(ErrorCode.Disconnected, "the client is closed");
    for (const w of this.waitingForConnection.splice(0)) w.reject(e);
    for (const r of this.replicas.values()) {
      clearTimeout(r.releaseTimer);
      r.abandon(e);
    }
    this.setState("closed");
  }

  // ---- the connection's life ----

  private setState(s: ClientState): void {
    if (this.currentState === s || this.currentState === "closed") return;
    this.currentState = s;
    this.stateChanges++;
    this.stateListeners.notify();
    if (s === "live") {
      // Waiters of `get()` on replicas confirmed current by the revalidation.
      for (const r of [...this.replicas.values()]) if (r.hasWaiters) r.confirm();
    }
  }

  private connection(options: CallOptions): Promise<Connection> {
    if (this.conn?.isOpen) return Promise.resolve(this.conn);
    if (this.closedByUser) return Promise.reject(new RpcError(ErrorCode.Disconnected, "the client is closed"));
    return new Promise((resolve, reject) => {
      const waiter = { resolve, reject };
      this.waitingForConnection.push(waiter);
      const drop = (e: RpcError) => {
        const i = this.waitingForConnection.indexOf(waiter);
        if (i >= 0) {
          this.waitingForConnection.splice(i, 1);
          reject(e);
        }
      };
      if (options.timeoutMs !== undefined) {
        const t = setTimeout(
          () => drop(new RpcError(ErrorCode.DeadlineExceeded, `not connected within ${options.timeoutMs} ms`)),
          options.timeoutMs,
        );
        const done = waiter.resolve;
        waiter.resolve = (c) => {
          clearTimeout(t);
          done(c);
        };
      }
      const signal = options.signal;
      if (signal !== undefined) {
        const onAbort = () => drop(new RpcError(ErrorCode.Cancelled, "the call was cancelled"));
        signal.addEventListener("abort", onAbort, { once: true });
        const done = waiter.resolve;
        waiter.resolve = (c) => {
          signal.removeEventListener("abort", onAbort);
          done(c);
        };
      }
    });
  }

  private async run(): Promise<void> {
    const reconnect = this.options.reconnect;
    const initial = (reconnect && reconnect.initialDelayMs) || 250;
    const max = (reconnect && reconnect.maxDelayMs) || 10_000;
    let failures = 0;
    let everConnected = false;
    while (!this.closedByUser) {
      let conn: Connection;
      try {
        conn = await Connection.open(this.url, this.options, this.handlers);
      } catch (e) {
        this.lastFailure = asRpcError(e);
        if (this.closedByUser) return;
        // A refused token or version will be refused again: stop, as the Rust client does.
        const code = this.lastFailure.code;
        if (reconnect === false || code === ErrorCode.Unauthenticated || code === ErrorCode.UnsupportedVersion) {
          this.close();
          return;
        }
        failures++;
        this.setState("offline");
        // Exponential backoff with jitter: between half and all of the step.
        const step = Math.min(max, initial * 2 ** Math.min(failures - 1, 30));
        await this.sleep(step / 2 + Math.random() * (step / 2));
        continue;
      }
      if (this.closedByUser) {
        conn.close();
        return;
      }
      failures = 0;
      this.conn = conn;
      for (const w of this.waitingForConnection.splice(0)) w.resolve(conn);
      await this.revalidate(conn, everConnected);
      everConnected = true;
      if (this.livenessMs !== null && conn.isOpen) {
        // Live only under a lease: what it answers from now on was current when this was
        // sent. Unanswered for `livenessMs`, the connection is taken for dead.
        const left = await this.renewWithin(conn, this.livenessMs);
        void this.keepLease(conn, this.livenessMs, left);
      }
      if (conn.isOpen) this.setState("live");
      this.lastFailure = await conn.closed;
      this.conn = undefined;
      // Nothing tells the replicas of a write now: they answer nothing until revalidated.
      this.leaseUntil = 0;
      if (this.closedByUser) return;
      if (reconnect === false) {
        this.close();
        return;
      }
      this.setState("reconnecting");
    }
  }

  /**
   * Asks the server how long its caches may still answer (`ReplicaHost.lease`, answered once
   * this client applied every push the server queued before the call), and extends the lease
   * to the call's send time plus the least of that and `liveness`. Answers the milliseconds
   * granted (`Infinity`: no bound), 0 when the server granted none or refused the call, or
   * `undefined` when the connection closed.
   */
  private async renew(conn: Connection, liveness: number): Promise<number | undefined> {
    const sent = now();
    let left: number;
    try {
      if (this.noLeaseCall.has(conn)) throw new RpcError(ErrorCode.UnknownMethod, "ReplicaHost.lease");
      const answer = decode(await conn.call(REPLICA_HOST.lease, NIL));
      const ns = typeof answer === "bigint" ? Number(answer) : answer;
      if (typeof ns !== "number" || !(ns >= 0)) throw new RpcError(ErrorCode.Protocol, "a lease answer that is not a count of nanoseconds");
      left = ns >= UNBOUNDED_NS ? Infinity : ns / 1e6;
    } catch (e) {
      const err = asRpcError(e);
      if (!conn.isOpen || err.code === ErrorCode.Disconnected) return undefined;
      if (err.code !== ErrorCode.UnknownMethod) {
        // Refused (overloaded, say): the connection lives, the lease is not extended.
        return 0;
      }
      // A server that predates leases: an empty revalidation, answered after every frame
      // it sent before, bounds the lease by `liveness` alone (PROTOCOL.md section 9).
      this.noLeaseCall.add(conn);
      try {
        await conn.call(REPLICA_HOST.revalidate, encodeWide([[]]));
      } catch {
        return conn.isOpen ? 0 : undefined;
      }
      left = liveness;
    }
    if (left === Infinity) {
      this.leaseUntil = Infinity;
      this.leaseGranted = false;
    } else {
      const before = this.leaseUntil;
      if (this.leaseGranted && before !== 0 && now() > before) this.lostLeases++;
      this.leaseGranted = left > 0;
      this.leaseUntil = Math.max(before === Infinity ? 0 : before, sent + Math.min(left, liveness));
    }
    // `get()`s that waited for the lease.
    if (this.currentState === "live" && left > 0) {
      for (const r of this.replicas.values()) if (r.hasWaiters) r.confirm();
    }
    return left;
  }

  /** {@link renew}, closing the connection when no answer comes within `liveness`. */
  private async renewWithin(conn: Connection, liveness: number): Promise<number | undefined> {
    let timer: ReturnType<typeof setTimeout> | undefined;
    const late = new Promise<"late">((r) => {
      timer = setTimeout(() => r("late"), liveness);
    });
    const left = await Promise.race([this.renew(conn, liveness), late]);
    clearTimeout(timer);
    if (left !== "late") return left;
    conn.close(ErrorCode.Disconnected, `no answer to a lease renewal within ${liveness} ms: the server looks gone`);
    return undefined;
  }

  /**
   * Renews the lease on `conn` while it is open: every quarter of `liveness`, or at a third
   * of what the server granted when that is sooner; closes a connection that answered no
   * renewal sent in the last `liveness` (the lease ran out with it).
   */
  private async keepLease(conn: Connection, liveness: number, first: number | undefined): Promise<void> {
    if (first === undefined || first === Infinity) return;
    const quarter = liveness / 4;
    let wait = first > 0 ? Math.min(quarter, first / 3) : LEASE_RENEWAL_MIN_MS;
    // When the last answered renewal was sent.
    let answered = now();
    // The wait between renewals while the server answers that nothing is left.
    let idle = 0;
    while (conn.isOpen && !this.closedByUser) {
      await new Promise<void>((r) => {
        const t = setTimeout(r, wait);
        (t as { unref?: () => void }).unref?.();
      });
      if (!conn.isOpen || this.closedByUser) return;
      wait = quarter;
      const sent = now();
      const due = Math.max(LEASE_RENEWAL_MIN_MS, answered + liveness - sent);
      let timer: ReturnType<typeof setTimeout> | undefined;
      const late = new Promise<"late">((r) => {
        timer = setTimeout(() => r("late"), due);
      });
      const left = await Promise.race([this.renew(conn, liveness), late]);
      clearTimeout(timer);
      if (left === "late") {
        if (this.leaseGranted) {
          this.leaseGranted = false;
          this.lostLeases++;
        }
        conn.close(ErrorCode.Disconnected, `no answer to a lease renewal within ${liveness} ms: the server looks gone`);
        return;
      }
      if (left === undefined || left === Infinity) return;
      answered = sent;
      if (left === 0) {
        // The server's caches are fenced: ask again soon, backing off while they stay so.
        idle = Math.min(Math.max(idle * 2, LEASE_RENEWAL_MIN_MS), quarter);
        wait = idle;
      } else {
        idle = 0;
        wait = Math.min(wait, Math.max(left / 3, LEASE_RENEWAL_MIN_MS));
      }
    }
  }

  private sleep(ms: number): Promise<void> {
    return new Promise((resolve) => {
      const t = setTimeout(done, ms);
      function done() {
        clearTimeout(t);
        resolve();
      }
      this.wakeRetry = done;
    });
  }

  /**
   * After a reconnect: sends every replica it holds with its value's hash; the server
   * watches again those that still hash the same and names the others, which are
   * invalidated (and fetched again where watched). Replicas without a value are fetched.
   */
  private async revalidate(conn: Connection, reconnected: boolean): Promise<void> {
    const held: [number, number, Uint8Array, bigint][] = [];
    const refetch: Replica<unknown>[] = [];
    this.watched.clear();
    for (const r of this.replicas.values()) {
      r.fetching = false;
      if (reconnected && r.statusNow === "current" && r.hash !== undefined) {
        const id = this.nextReplicaId++;
        r.watchId = id;
        this.watched.set(id, r);
        held.push([id, r.methodId, r.argBytes, r.hash]);
      } else {
        r.watchId = undefined;
        if (r.isWatched || r.hasWaiters) refetch.push(r);
      }
    }
    if (held.length > 0) {
      let changed: number[];
      try {
        const answer = decode(await conn.call(REPLICA_HOST.revalidate, encodeWide([held])));
        if (!Array.isArray(answer)) throw new RpcError(ErrorCode.Protocol, "a revalidation answer that is not a list");
        changed = answer as number[];
      } catch {
        // The connection went again: the next one revalidates.
        if (!conn.isOpen) return;
        // Otherwise (Overloaded, TooLarge, a bad answer), none of them can be trusted.
        changed = held.map(([id]) => id);
      }
      // Ids released while the answer was on its way are watched again there: release them.
      const gone = held.map(([id]) => id).filter((id) => this.watched.get(id)?.watchId !== id);
      if (gone.length > 0) this.releaseIds(gone);
      // What changed while away and what had no value: fetched, and shown, together.
      this.invalidateIds(changed, refetch);
      return;
    }
    this.fetchAll(refetch);
  }

  // ---- replicas ----

  /** @internal A replica gained its first watcher. */
  observed(r: Replica<unknown>): void {
    clearTimeout(r.releaseTimer);
    r.releaseTimer = undefined;
    this.adopt(r);
    if (needsFetch(r)) this.fetch(r);
  }

  /** A replica object kept by its user after its release belongs to the client again. */
  private adopt(r: Replica<unknown>): void {
    if (!this.replicas.has(r.key)) this.replicas.set(r.key, r);
  }

  /** @internal A replica lost its last watcher. */
  unobserved(r: Replica<unknown>): void {
    clearTimeout(r.releaseTimer);
    r.releaseTimer = setTimeout(() => this.release(r), this.releaseDelayMs);
    (r.releaseTimer as { unref?: () => void }).unref?.();
  }

  /**
   * @internal A replica was read: fetch it if it has no current value, or if its value is
   * current but the lease is out (the read goes to the server, as a Rust client's does,
   * and the fetch answers it).
   */
  touch(r: Replica<unknown>): void {
    this.adopt(r);
    if (needsFetch(r) || (r.statusNow === "current" && r.hasWaiters && this.leaseLapsed())) this.fetch(r);
    if (!r.isWatched && r.releaseTimer === undefined) this.unobserved(r);
  }

  /** Live, and the lease granted on this connection ran out (not dropped by a disconnect). */
  private leaseLapsed(): boolean {
    return this.currentState === "live" && this.livenessMs !== null && this.leaseUntil !== 0 && now() >= this.leaseUntil;
  }

  private release(r: Replica<unknown>): void {
    r.releaseTimer = undefined;
    if (r.isWatched || r.hasWaiters) return;
    // Only this object: a newer replica of the same key may have taken its place.
    if (this.replicas.get(r.key) === r) this.replicas.delete(r.key);
    if (r.watchId !== undefined) {
      this.watched.delete(r.watchId);
      this.releaseIds([r.watchId]);
    }
    r.released();
  }

  /** Tells the server to stop watching `ids` (batched within a turn of the event loop). */
  private releaseIds(ids: readonly number[]): void {
    const first = this.toRelease.length === 0;
    this.toRelease.push(...ids);
    if (first) {
      queueMicrotask(() => {
        const batch = this.toRelease;
        this.toRelease = [];
        this.conn?.oneway(REPLICA_HOST.release, encode([batch]));
      });
    }
  }

  /**
   * Fetches `rs` as one group: their new values are applied together, once every answer is
   * in, so that what one change invalidated (a task leaving one list for another) never
   * shows half applied.
   */
  private fetchAll(rs: readonly Replica<unknown>[]): void {
    if (rs.length <= 1) {
      for (const r of rs) this.fetch(r);
      return;
    }
    const group: FetchGroup = { waiting: 0, ready: [] };
    for (const r of rs) if (this.fetch(r, group)) group.waiting++;
  }

  /** Starts fetching `r` (in `group`, whose answers are applied together); answers whether it did. */
  private fetch(r: Replica<unknown>, group?: FetchGroup): boolean {
    if (r.fetching || this.closedByUser) return false;
    const conn = this.conn;
    // Not connected: the reconnect fetches what is watched or awaited.
    if (conn === undefined || !conn.isOpen) return false;
    r.fetching = true;
    const id = this.nextReplicaId++;
    if (r.watchId !== undefined) {
      // A current value fetched again (its lease out): the server stops watching the old id.
      this.watched.delete(r.watchId);
      this.releaseIds([r.watchId]);
    }
    r.watchId = id;
    r.invalidatedWhileLoading = false;
    this.watched.set(id, r);
    // The callers waiting now began before this was sent: its answer answers them, unless
    // no lease stands on this connection at all (a value fetched then is answered only
    // under a renewal sent after it came, as the Rust client does).
    const waiting = r.waitersNow();
    // Applied at once, or when the last answer of the group is in.
    const then = (apply: () => void) => {
      if (group === undefined) return apply();
      group.ready.push(apply);
      if (group.ready.length === group.waiting) {
        const all = group.ready.splice(0);
        // Listeners see the whole group applied, never part of it.
        batch(() => {
          for (const f of all) f();
        });
      }
    };
    conn.call(REPLICA_HOST.fetch, encode([r.methodId, r.argBytes, id])).then(
      (answer) => then(() => {
        if (r.watchId !== id) {
          // Superseded or released meanwhile: the server may watch it now; stop that.
          this.watched.delete(id);
          this.releaseIds([id]);
          return;
        }
        r.fetching = false;
        let bytes: Uint8Array;
        try {
          bytes = unwrap(decode(answer) as Encoded<unknown>);
        } catch (e) {
          this.watched.delete(id);
          r.watchId = undefined;
          r.fail(asRpcError(e));
          return;
        }
        const stillCurrent = !r.invalidatedWhileLoading;
        if (!stillCurrent) {
          this.watched.delete(id);
          r.watchId = undefined;
        }
        let value: unknown;
        try {
          value = decode(bytes);
        } catch (e) {
          r.fail(asRpcError(e));
          return;
        }
        if (this.leaseUntil !== 0 && this.currentState === "live") r.answer(waiting, value);
        r.settle(value, valueHash(bytes), stillCurrent);
        // Callers that came while it was on its way, with the lease still out, read anew.
        if ((!stillCurrent && (r.isWatched || r.hasWaiters)) || (r.hasWaiters && this.leaseLapsed())) this.fetch(r);
      }),
      (e: unknown) => then(() => {
        if (r.watchId !== id) return;
        r.fetching = false;
        this.watched.delete(id);
        r.watchId = undefined;
        const err = asRpcError(e);
        // A lost connection is not the value's failure: the reconnect fetches it again.
        if (err.code !== ErrorCode.Disconnected) r.fail(err);
      }),
    );
    return true;
  }

  private onInvalidated(payload: Uint8Array): Uint8Array {
    const args = decode(payload);
    if (!Array.isArray(args) || !Array.isArray(args[0])) {
      throw new RpcError(ErrorCode.BadArguments, "ReplicaSink.invalidated takes a tuple of one list of ids");
    }
    this.invalidateIds(args[0] as number[]);
    return NIL;
  }

  private invalidateIds(ids: readonly number[], alsoFetch: readonly Replica<unknown>[] = []): void {
    batch(() => this.invalidateNow(ids, alsoFetch));
  }

  private invalidateNow(ids: readonly number[], alsoFetch: readonly Replica<unknown>[]): void {
    const refetch: Replica<unknown>[] = [...alsoFetch];
    for (const id of ids) {
      const r = this.watched.get(id);
      if (r === undefined || r.watchId !== id) continue;
      if (r.fetching) {
        // Pushed right behind the answer that is still being applied.
        r.invalidatedWhileLoading = true;
        continue;
      }
      this.watched.delete(id);
      r.watchId = undefined;
      r.invalidate();
      if (r.isWatched || r.hasWaiters) refetch.push(r);
    }
    this.fetchAll(refetch);
  }
}

/** Fetches whose answers are applied together. */
interface FetchGroup {
  /** How many were started. */
  waiting: number;
  /** The answers in, waiting to be applied. */
  ready: (() => void)[];
}

/** `options` with the time left before `deadline` (one deadline covers the wait and the call). */
function remaining(options: CallOptions, deadline: number | undefined): CallOptions {
  if (deadline === undefined) return options;
  return { ...options, timeoutMs: Math.max(0, deadline - Date.now()) };
}

/** Loading or invalidated, and no fetch under way (an error waits for `refresh`). */
function needsFetch(r: Replica<unknown>): boolean {
  const s = r.statusNow;
  return (s === "loading" || s === "invalidated") && !r.fetching;
}

/** A compute call's answer: the value's bytes, or the server's failure as an error. */
function unwrap(answer: Encoded<unknown>): Uint8Array {
  if (answer !== null && typeof answer === "object") {
    if ("Ok" in answer && answer.Ok instanceof Uint8Array) return answer.Ok;
    if ("Err" in answer) throw failure(answer.Err);
  }
  throw new RpcError(ErrorCode.Protocol, "a compute answer that is neither Ok nor Err");
}

/** `Failure` of PROTOCOL.md section 9, as the error the Rust client maps it to. */
function failure(f: unknown): RpcError {
  if (f !== null && typeof f === "object") {
    const [[name, data]] = Object.entries(f) as [[string, unknown]];
    switch (name) {
      case "UnknownMethod":
        return new RpcError(ErrorCode.UnknownMethod, `no compute method with id 0x${Number(data).toString(16).padStart(8, "0")} is exposed`);
      case "BadArguments":
        return new RpcError(ErrorCode.BadArguments, String(data));
      case "BadValue":
        return new RpcError(ErrorCode.Internal, String(data));
      case "TooManyReplicas":
        return new RpcError(ErrorCode.Overloaded, `too many replicas held: the server's limit of ${String(data)} was reached`);
    }
  }
  return new RpcError(ErrorCode.Internal, `an unknown failure: ${JSON.stringify(f)}`);
}

function hex(bytes: Uint8Array): string {
  let s = "";
  for (const b of bytes) s += b.toString(16).padStart(2, "0");
  return s;
}
