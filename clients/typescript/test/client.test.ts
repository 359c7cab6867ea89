// The client against a real Rust server (examples/ts_server.rs), over a real WebSocket:
// calls, errors, cancellation and deadlines, streams under a slow consumer, replicas
// invalidated by a server write, reconnection after the server restarts, hostile frames.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import { Client, type ClientOptions, computed, ErrorCode, RpcError } from "../src/index.js";
import { NodeWebSocket, type Server, startServer, until } from "./server.js";

/** The compute methods of the test server, as a generated declaration would give them. */
interface Counters {
  "Counters.get": { args: [name: string]; result: Ok<number> };
  "Counters.sum": { args: [names: string[]]; result: Ok<number> };
}

type Ok<T> = { Ok: T };
const ok = <T>(v: Ok<T> | undefined): T | undefined => v?.Ok;

const base: ClientOptions = { WebSocket: NodeWebSocket, token: "secret", reconnect: { initialDelayMs: 20, maxDelayMs: 200 } };

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

function isRpc(code: number) {
  return (e: unknown) => e instanceof RpcError && e.code === code;
}

describe("calls", () => {
  let server: Server;
  let client: Client<Counters>;
  before(async () => {
    server = await startServer();
    client = new Client(server.ws(), base);
    await client.ready();
  });
  after(async () => {
    client.close();
    await server.kill();
  });

  test("answer in order, many at once", async () => {
    assert.equal(await client.call("Calc.add", [2, 40]), 42);
    assert.equal(await client.call("Calc.echo", ["héllo, wörld"]), "héllo, wörld");
    const many = await Promise.all(Array.from({ length: 500 }, (_, i) => client.call<number>("Calc.add", [i, 1])));
    assert.deepEqual(many, Array.from({ length: 500 }, (_, i) => i + 1));
    // Integers past 32 bits travel as integers (an i64 of microseconds, say).
    assert.equal(await client.call("Calc.add", [1_700_000_000_000_000, 1]), 1_700_000_000_000_001);
  });

  test("large results span many WebSocket messages", async () => {
    const blob = await client.call<Uint8Array>("Calc.blob", [3 << 20]);
    assert.ok(blob instanceof Uint8Array);
    assert.equal(blob.length, 3 << 20);
  });

  test("errors carry the protocol's codes; application errors are values", async () => {
    await assert.rejects(client.call("Calc.fail", [7, "busy"]), isRpc(ErrorCode.Overloaded));
    await assert.rejects(client.call("Calc.nope", []), isRpc(ErrorCode.UnknownMethod));
    await assert.rejects(client.call("Calc.add", ["two", 40]), isRpc(ErrorCode.BadArguments));
    assert.deepEqual(await client.call("Calc.div", [1, 0]), { Err: "division by zero" });
    assert.deepEqual(await client.call("Calc.div", [9, 3]), { Ok: 3 });
    // The connection is still fine.
    assert.equal(await client.call("Calc.add", [1, 1]), 2);
  });

  test("cancelling a call aborts its handler on the server", async () => {
    const before = await client.call<number>("Calc.cancelled");
    const abort = new AbortController();
    const call = client.call("Calc.sleep", [10_000], { signal: abort.signal });
    setTimeout(() => abort.abort(), 50);
    await assert.rejects(call, isRpc(ErrorCode.Cancelled));
    await until(async () => (await client.call<number>("Calc.cancelled")) > before, 5_000, "the handler to be dropped");
  });

  test("a deadline cancels the call", async () => {
    const before = await client.call<number>("Calc.cancelled");
    await assert.rejects(client.call("Calc.sleep", [10_000], { timeoutMs: 50 }), isRpc(ErrorCode.DeadlineExceeded));
    await until(async () => (await client.call<number>("Calc.cancelled")) > before, 5_000, "the handler to be dropped");
    assert.equal(await client.call("Calc.sleep", [1], { timeoutMs: 5_000 }), 1);
  });

  test("a stream delivers every item in order", async () => {
    const items: number[] = [];
    for await (const x of client.stream<number>("Calc.count", [1000])) items.push(x);
    assert.deepEqual(items, Array.from({ length: 1000 }, (_, i) => i));
  });

  test("a slow consumer holds the producer to the window; leaving cancels", async () => {
    const window = 16;
    const slow = new Client(server.ws(), { ...base, streamWindow: window });
    try {
      await slow.ready();
      const start = await slow.call<number>("Calc.produced");
      const items = slow.stream<number>("Calc.count", [100_000]);
      let seen = 0;
      for await (const x of items) {
        assert.equal(x, seen);
        seen++;
        if (seen === 3 * window) break;
        if (seen % window === 0) await new Promise((r) => setTimeout(r, 50));
      }
      await new Promise((r) => setTimeout(r, 200));
      const produced = (await slow.call<number>("Calc.produced")) - start;
      // Everything consumed, plus at most one window ahead (and one ack's worth in flight).
      assert.ok(produced <= seen + 2 * window, `produced ${produced} items for ${seen} consumed`);
      // Cancelled: nothing more is produced.
      await new Promise((r) => setTimeout(r, 100));
      assert.equal((await slow.call<number>("Calc.produced")) - start, produced);
    } finally {
      slow.close();
    }
  });

  test("a wrong token is refused with the server's reason", async () => {
    // No `reconnect: false`: a refused token is not retried (it would be refused again).
    const bad = new Client(server.ws(), { ...base, token: "wrong" });
    await assert.rejects(bad.ready(), isRpc(ErrorCode.Disconnected));
    assert.equal(bad.state, "closed");
    assert.ok(bad.lastError && bad.lastError.code === ErrorCode.Unauthenticated, String(bad.lastError));
  });

  test("keep-alive pings keep a quiet connection open", async () => {
    const quiet = new Client(server.ws(), { ...base, keepAliveMs: 30, idleTimeoutMs: 150 });
    try {
      await quiet.ready();
      await new Promise((r) => setTimeout(r, 600));
      assert.equal(quiet.state, "live");
      assert.equal(await quiet.call("Calc.add", [1, 2]), 3);
    } finally {
      quiet.close();
    }
  });
});

describe("replicas", () => {
  let server: Server;
  let client: Client<Counters>;
  before(async () => {
    server = await startServer(["--initial", "a=1", "--initial", "b=2"]);
    client = new Client(server.ws(), base);
    await client.ready();
  });
  after(async () => {
    client.close();
    await server.kill();
  });

  test("a write on the server invalidates the replica; a read after it returns sees it", async () => {
    const a = client.replica("Counters.get", "a");
    assert.equal(ok(await a.get()), 1);
    const stop = a.subscribe(() => {});
    try {
      for (let i = 1; i <= 20; i++) {
        const now = await client.call<number>("Calc.bump", ["a", 1]);
        // The server answered after this client acknowledged the invalidation.
        // Watched, it may even hold the new value already: never the old one as current.
        assert.ok(a.status !== "current" || ok(a.value) === now, `round ${i}: the old value is current after the write returned`);
        assert.equal(ok(await a.get()), now, `round ${i}`);
      }
    } finally {
      stop();
    }
  });

  test("reconnect() drops the connection and comes back live with the replicas current", async () => {
    const a = client.replica("Counters.get", "a");
    const stop = a.subscribe(() => {});
    try {
      const before = ok(await a.get());
      const states: string[] = [];
      const off = client.onStateChange((s) => states.push(s));
      client.reconnect();
      await until(() => states.includes("live"));
      off();
      assert.deepEqual(states, ["reconnecting", "live"]);
      assert.equal(ok(await a.get()), before);
      // And it is still kept current.
      const now = await client.call<number>("Calc.bump", ["a", 1]);
      assert.equal(ok(await a.get()), now);
    } finally {
      stop();
    }
  });

  test("a computed over replicas recomputes when one changes", async () => {
    const a = client.replica("Counters.get", "a");
    const b = client.replica("Counters.get", "b");
    const total = computed(() => (ok(a.value) ?? 0) + (ok(b.value) ?? 0));
    const seen: number[] = [];
    const stop = total.subscribe(() => seen.push(total.value));
    try {
      await until(() => a.status === "current" && b.status === "current", 5_000, "both replicas");
      const server = await client.call<number>("Calc.bump", ["b", 10]);
      assert.ok(server > 0);
      await until(() => b.status === "current" && total.value === (ok(a.value) ?? 0) + server, 5_000, "the sum to follow");
      // The server's own computed agrees.
      assert.equal(ok(await client.compute("Counters.sum", ["a", "b"])), total.value);
      assert.ok(seen.length > 0);
    } finally {
      stop();
    }
  });

  test("a released replica object, read or watched again, is fetched again: never stale", async () => {
    const c = new Client<Counters>(server.ws(), { ...base, releaseDelayMs: 20 });
    try {
      await c.ready();
      const r = c.replica("Counters.get", "kept");
      assert.equal(ok(await r.get()), 0);
      await until(() => c.replicaCount === 0, 2_000, "the release");
      assert.notEqual(r.status, "current", "a released replica does not claim to be current");
      const now = await c.call<number>("Calc.bump", ["kept", 3]);
      const stop = r.subscribe(() => {});
      try {
        assert.equal(ok(await r.get()), now);
        assert.equal(c.replicaCount, 1);
      } finally {
        stop();
      }
    } finally {
      c.close();
    }
  });

  test("get() of a replica whose method fails rejects with the error, and refresh() retries", async () => {
    const r = client.replica("Counters.nope" as "Counters.get", "x");
    await assert.rejects(r.get(), isRpc(ErrorCode.UnknownMethod));
    assert.equal(r.status, "error");
    await assert.rejects(r.get(), isRpc(ErrorCode.UnknownMethod));
  });

  test("what one write invalidates is refetched and applied together: no half-applied state", async () => {
    const g = client.replica("Counters.get", "g");
    const sum = client.replica("Counters.sum", ["g", "h"]);
    const pair = computed(() => [ok(g.value), ok(sum.value)] as const);
    const torn: string[] = [];
    const stop = pair.subscribe(() => {
      const [x, total] = pair.value;
      // h stays 0: the sum is g's value whenever both are in.
      if (x !== undefined && total !== undefined && total !== x) torn.push(`g=${x} sum=${total}`);
    });
    try {
      await until(() => g.status === "current" && sum.status === "current", 5_000, "both replicas");
      for (let i = 0; i < 30; i++) {
        const now = await client.call<number>("Calc.bump", ["g", 1]);
        await until(() => ok(g.value) === now && ok(sum.value) === now && g.status === "current", 5_000, `round ${i}`);
      }
      assert.deepEqual(torn, []);
    } finally {
      stop();
    }
  });

  test("a replica nobody watches is released", async () => {
    const c = new Client<Counters>(server.ws(), { ...base, releaseDelayMs: 20 });
    try {
      await c.ready();
      const r = c.replica("Counters.get", "zzz");
      assert.equal(ok(await r.get()), 0);
      await until(() => c.replicaCount === 0, 2_000, "the release");
    } finally {
      c.close();
    }
  });
});

describe("faults", () => {
  test("after the server restarts, every replica is current again: none stale", async () => {
    let server = await startServer(["--initial", "a=1", "--initial", "b=2"]);
    const port = server.addr.split(":")[1]!;
    const client = new Client<Counters>(server.ws(), base);
    const states: string[] = [];
    client.onStateChange((s) => states.push(s));
    try {
      const a = client.replica("Counters.get", "a");
      const b = client.replica("Counters.get", "b");
      const stopA = a.subscribe(() => {});
      const stopB = b.subscribe(() => {});
      await until(() => ok(a.value) === 1 && ok(b.value) === 2, 5_000, "the first values");
      await server.kill();
      await until(() => client.state !== "live", 5_000, "the client to notice");
      // A new server on the same port, where `a` changed while nobody listened.
      server = await startServer(["--listen", `127.0.0.1:${port}`, "--initial", "a=100", "--initial", "b=2"]);
      await client.ready();
      // Live means revalidated: `a` is no longer current, or already the new value.
      assert.ok(a.status !== "current" || ok(a.value) === 100, `a is ${JSON.stringify(a.value)} (${a.status}) once live`);
      assert.equal(ok(await a.get()), 100);
      assert.equal(b.status, "current");
      assert.equal(ok(b.value), 2);
      assert.ok(states.includes("reconnecting"), states.join(","));
      stopA();
      stopB();
    } finally {
      client.close();
      await server.kill();
    }
  });

  test("a client whose server stops answering answers nothing from its replicas once its lease ran out", async () => {
    const server = await startServer(["--initial", "a=1"]);
    const client = new Client<Counters>(server.ws(), { ...base, livenessMs: 400 });
    try {
      await client.ready();
      const a = client.replica("Counters.get", "a");
      assert.equal(ok(await a.get()), 1);
      assert.ok(client.answersFromReplicas);
      // The server paused (as a host stopped by SIGSTOP): it renews nothing. Past the
      // liveness (400 ms) after the last renewal it answered, the replica answers nothing.
      server.child.kill("SIGSTOP");
      await sleep(600);
      assert.equal(client.answersFromReplicas, false);
      let answered = false;
      const read = a.get().then((v) => {
        answered = true;
        return v;
      });
      await sleep(50);
      assert.equal(answered, false, "a current replica answered with the lease out");
      // The unanswered renewal closed the connection; once the server is back the client
      // reconnects, revalidates, renews, and answers.
      await until(() => client.state !== "live", 5_000, "the connection to be taken for dead");
      server.child.kill("SIGCONT");
      assert.equal(ok(await read), 1);
      assert.ok(client.leasesLost >= 1, `leasesLost ${client.leasesLost}`);
    } finally {
      server.child.kill("SIGCONT");
      client.close();
      await server.kill();
    }
  });

  test("while the server cannot vouch for its caches, get() reads through to it", async () => {
    // Every renewal answers that nothing is left (a cluster host past its lease): the
    // client's replicas answer nothing by themselves; each get() fetches and answers.
    const server = await startServer(["--initial", "a=1", "--lease-fenced"]);
    const client = new Client<Counters>(server.ws(), { ...base, livenessMs: 400 });
    try {
      await client.ready();
      const a = client.replica("Counters.get", "a");
      assert.equal(ok(await a.get()), 1);
      assert.equal(client.answersFromReplicas, false);
      for (let i = 1; i <= 5; i++) {
        const now = await client.call<number>("Calc.bump", ["a", 1]);
        assert.equal(ok(await a.get()), now, `write ${i}`);
        assert.equal(ok(await a.get()), now, `write ${i}, read again`);
      }
      assert.equal(client.leasesLost, 0, "a lease never granted is never lost");
    } finally {
      client.close();
      await server.kill();
    }
  });

  test("a server that promises nothing (an untrusted connection) grants a lease without bound", async () => {
    const server = await startServer(["--initial", "a=1", "--untrusted"]);
    const client = new Client<Counters>(server.ws(), { ...base, livenessMs: 400 });
    try {
      await client.ready();
      const a = client.replica("Counters.get", "a");
      assert.equal(ok(await a.get()), 1);
      // Writes never wait for this connection: its replicas are not bounded by a lease
      // (the connection's keep-alive is what finds a dead server).
      server.child.kill("SIGSTOP");
      await sleep(600);
      assert.ok(client.answersFromReplicas);
      assert.equal(ok(await a.get()), 1);
      assert.equal(client.leasesLost, 0);
    } finally {
      server.child.kill("SIGCONT");
      client.close();
      await server.kill();
    }
  });

  test("a hostile frame closes the connection with a reason", async () => {
    const server = await startServer();
    try {
      for (const [mode, code] of [
        ["", ErrorCode.Protocol],
        ["?mode=toolarge", ErrorCode.TooLarge],
        ["?mode=badack", ErrorCode.Protocol],
        ["?mode=garbage-batch", ErrorCode.Protocol],
      ] as const) {
        const c = new Client(server.ws(`/hostile${mode}`), { ...base, reconnect: false, maxMessageSize: 1 << 16 });
        // Calls made meanwhile fail, naming the reason.
        const call = c.call("Calc.count", [3]).catch((e: unknown) => e);
        await until(() => c.state === "closed", 5_000, `the ${mode || "kind 15"} case to close`);
        const why = c.lastError;
        assert.ok(why instanceof RpcError && why.code === code, `${mode}: ${String(why)}`);
        const failed = await call;
        assert.ok(failed instanceof RpcError, String(failed));
      }
    } finally {
      await server.kill();
    }
  });

  test("a server that is not there: offline, then live once it starts", async () => {
    const probe = await startServer();
    const port = probe.addr.split(":")[1]!;
    await probe.kill();
    const client = new Client(`ws://127.0.0.1:${port}/rpc`, base);
    try {
      await until(() => client.state === "offline", 5_000, "offline");
      const server = await startServer(["--listen", `127.0.0.1:${port}`]);
      try {
        await client.ready();
        assert.equal(await client.call("Calc.add", [20, 22]), 42);
      } finally {
        await server.kill();
      }
    } finally {
      client.close();
    }
  });
});
