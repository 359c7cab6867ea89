#!/usr/bin/env node
// The `web` benchmark suite: Coherent's TypeScript client against what a web front end would
// otherwise use, from one Node process against the Tasks server (release build, SQLite, on
// loopback), and the live page in headless Chromium.
//
//   npm run bench -w apps/tasks/web -- [--quick] [--json out.json] [--seconds 5] [--callers 64]
//
// Rows (the JSON has coherent-bench's shape: {suite, cores, results: [{name, value, unit, ...}], notes}):
// - web.call.coherent: calls/s of `client.compute("TasksService.task", id)` over one WebSocket,
//   many concurrent callers (answered from the server's cache);
// - web.call.fetch: the same method through `fetch()` to the HTTP gateway (keep-alive), the same
//   callers;
// - web.call.ws_json: a plain `ws` JSON request/answer server in Node (another process), the naive floor;
// - web.replica.get: `await replica.get()` of a held replica (current: no round trip), and
//   web.replica.value: the synchronous `replica.value` read; both against web.call.fetch;
// - web.push.dom_p50_ms / web.push.dom_p99_ms: in Chromium, after a warm-up, a PATCH sent by the
//   page until the DOM shows it (the page does not apply its own answer: the change comes back as an invalidation,
//   a refetch and a render).
import { spawn } from "node:child_process";
import { availableParallelism } from "node:os";
import { writeFileSync } from "node:fs";
import { createInterface } from "node:readline";
import { parseArgs } from "node:util";

import WebSocket from "ws";

import { Client } from "@coherent/client";
import { api, ensurePageBuilt, launch, seededDatabase, startTasks, USER } from "../tests/harness.mjs";

const { values: opts } = parseArgs({
  options: {
    quick: { type: "boolean", default: false },
    json: { type: "string" },
    seconds: { type: "string" },
    callers: { type: "string", default: "64" },
    debug: { type: "boolean", default: false },
  },
});
const seconds = Number(opts.seconds ?? (opts.quick ? 1 : 5));
const callers = Number(opts.callers);
const release = !opts.debug;
const rows = [];
const notes = [];

function row(name, value, unit, extra = {}, baseline) {
  rows.push({ name, value, unit, extra, baseline });
}

/** Runs `callers` loops of `once` for `seconds`; answers calls/s (after a warm-up of a fifth). */
async function closedLoop(once, n = callers) {
  const warm = Date.now() + Math.max(200, (seconds * 1000) / 5);
  await Promise.all(Array.from({ length: n }, async () => {
    while (Date.now() < warm) await once();
  }));
  let count = 0;
  const start = performance.now();
  const end = start + seconds * 1000;
  await Promise.all(Array.from({ length: n }, async () => {
    while (performance.now() < end) {
      await once();
      count++;
    }
  }));
  return count / ((performance.now() - start) / 1000);
}

function percentile(sorted, p) {
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];
}

ensurePageBuilt();
const db = seededDatabase({ tasks: 1000, projects: 4, release });
// The server's rate per `/rpc` connection (100 calls a second, for browsers) is lifted: the
// rows measure what the client and the server can do, not the limit. Its clients are on
// 127.0.0.1, which the per-address limits exempt.
const server = await startTasks(db, { release, unpaced: true });
notes.push("tasks serve --rpc-calls-per-connection 0: the per-connection rate of /rpc (100 calls a second by default, for browsers) lifted; the clients are on 127.0.0.1, exempt from the per-address limits");
try {
  const page = await api(server, "GET", "/api/tasks?limit=1");
  const task = page.items[0];
  const id = task.id;
  const expect = (t) => {
    if (t?.Ok?.id !== id) throw new Error(`unexpected answer ${JSON.stringify(t)}`);
  };

  // ---- calls ----
  const client = new Client(`ws://${server.addr}/rpc`, { WebSocket });
  await client.ready();
  const coherent = await closedLoop(async () => expect(await client.compute("TasksService.task", id)));
  row("web.call.coherent", coherent, "calls/s", { callers }, "web.call.fetch");

  const gateway = server.url(`/gateway/TasksService.task?args=${encodeURIComponent(JSON.stringify([id]))}`);
  const viaFetch = await closedLoop(async () => {
    const res = await fetch(gateway);
    expect(await res.json());
  });
  row("web.call.fetch", viaFetch, "calls/s", { callers });

  const echo = spawn(process.execPath, [new URL("./echo-server.mjs", import.meta.url).pathname, JSON.stringify({ Ok: task })], {
    stdio: ["ignore", "pipe", "inherit"],
  });
  const port = await new Promise((resolve) =>
    createInterface({ input: echo.stdout }).once("line", (l) => resolve(JSON.parse(l).listening)),
  );
  try {
    const ws = new WebSocket(`ws://127.0.0.1:${port}`);
    await new Promise((resolve, reject) => {
      ws.once("open", resolve);
      ws.once("error", reject);
    });
    const waiting = new Map();
    let next = 1;
    ws.on("message", (data) => {
      const msg = JSON.parse(data.toString());
      waiting.get(msg.id)?.(msg.result);
      waiting.delete(msg.id);
    });
    const naive = await closedLoop(async () => {
      const reqId = next++;
      const answer = new Promise((resolve) => waiting.set(reqId, resolve));
      ws.send(JSON.stringify({ id: reqId, method: "TasksService.task", args: [id] }));
      expect(await answer);
    });
    row("web.call.ws_json", naive, "calls/s", { callers }, "web.call.fetch");
    ws.close();
  } finally {
    echo.kill();
  }

  // ---- replica reads ----
  const replica = client.replica("TasksService.task", id);
  const stop = replica.subscribe(() => {});
  expect(await replica.get());
  const reads = await closedLoop(async () => expect(await replica.get()), 1);
  row("web.replica.get", reads, "reads/s", {}, "web.call.fetch");
  let syncReads = 0;
  const t0 = performance.now();
  while (performance.now() - t0 < seconds * 1000) {
    for (let i = 0; i < 10_000; i++) if (replica.value.Ok.id === id) syncReads++;
  }
  row("web.replica.value", syncReads / ((performance.now() - t0) / 1000), "reads/s", {}, "web.call.fetch");
  stop();
  client.close();

  // ---- write -> DOM in Chromium ----
  const browser = await launch();
  try {
    const context = await browser.newContext();
    const tab = await context.newPage();
    await tab.goto(server.url("/"));
    await tab.waitForSelector('[data-testid="connection"][data-state="live"]');
    await tab.waitForSelector('[data-status="todo"] [data-task]');
    // Writes need a login: the cookie is set for the tab's later fetches.
    await tab.evaluate(async (user) => {
      const res = await fetch("/api/session", {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify(user),
      });
      if (!res.ok) throw new Error(`logging in: ${res.status}`);
    }, USER);
    const n = opts.quick ? 30 : 300;
    // A warm-up, as for the other rows: the first writes pay for JIT and first routes.
    const warm = opts.quick ? 5 : 30;
    const latencies = await tab.evaluate(async ([n, warm]) => {
      const cardId = document.querySelector('[data-status="todo"] [data-task]').getAttribute("data-task");
      const title = () => document.querySelector(`[data-task="${cardId}"] .title`)?.textContent;
      const out = [];
      for (let i = 0; i < warm + n; i++) {
        const want = `Write ${i} at ${Date.now()}`;
        const start = performance.now();
        const seen = new Promise((resolve) => {
          const observer = new MutationObserver(() => {
            if (title() === want) {
              observer.disconnect();
              resolve(performance.now());
            }
          });
          observer.observe(document.body, { subtree: true, childList: true, characterData: true });
        });
        const res = await fetch(`/api/tasks/${cardId}`, {
          method: "PATCH",
          headers: { "content-type": "application/json" },
          body: JSON.stringify({ title: want }),
        });
        if (!res.ok) throw new Error(`PATCH: ${res.status}`);
        const end = await seen;
        if (i >= warm) out.push(end - start);
      }
      return out;
    }, [n, warm]);
    latencies.sort((a, b) => a - b);
    row("web.push.dom_p50_ms", percentile(latencies, 50), "ms", { writes: n });
    row("web.push.dom_p99_ms", percentile(latencies, 99), "ms", { writes: n, max_ms: latencies.at(-1) });
  } finally {
    await browser.close();
  }
} finally {
  await server.kill();
}

notes.push(
  `${callers} concurrent callers in one Node ${process.version} process; the Tasks server ${release ? "release" : "debug"} build on SQLite, on loopback; ${seconds} s per row after a warm-up`,
);

// ---- report ----
const fmt = (v) => (v >= 1e6 ? `${(v / 1e6).toFixed(2)}M` : v >= 1e3 ? `${(v / 1e3).toFixed(2)}K` : v.toFixed(2));
const cores = availableParallelism();
console.log(`\nsuite web on ${cores} cores\n`);
const width = Math.max(...rows.map((r) => r.name.length));
console.log(`${"name".padEnd(width)}  ${"value".padStart(12)}  ${"unit".padEnd(8)}  ratio`);
for (const r of rows) {
  const base = r.baseline && rows.find((b) => b.name === r.baseline);
  const ratio = base ? `${(r.value / base.value).toFixed(2)}x ${base.name}` : "";
  const extra = Object.entries(r.extra).map(([k, v]) => `${k}=${typeof v === "number" ? +v.toFixed(3) : v}`).join(" ");
  console.log(`${r.name.padEnd(width)}  ${fmt(r.value).padStart(12)}  ${r.unit.padEnd(8)}  ${ratio.padEnd(30)}  ${extra}`);
}
for (const n of notes) console.log(`note: ${n}`);
if (opts.json) {
  const results = rows.map((r) => ({ name: r.name, value: r.value, unit: r.unit, ...r.extra }));
  writeFileSync(opts.json, JSON.stringify({ suite: "web", cores, results, notes }, null, 2) + "\n");
}
