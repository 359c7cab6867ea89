// A TypeScript reader of a checked run (crates/coherent-checker): a Node.js process holding
// replicas of one host's `Registers.value` through `@coherent/client` over a WebSocket (as a
// Node.js tier of an application would), recording every read in the history format of
// `src/history.rs` (33-byte records, times on CLOCK_MONOTONIC, which is what
// `process.hrtime.bigint()` reads on Linux).
//
// Settings in the environment: CHK_TS_ROOT (the repository, for the client's build and
// `ws`), CHK_TS_URL, CHK_KEYS, CHK_TS_READERS, CHK_READ_BATCH, CHK_HISTORY. Lines on stdin
// (`start`, `stop`, `final`, `stats`, `quit`) are answered on stdout as `@@ ...`, as a host
// process answers them.

import { openSync, writeSync, closeSync } from "node:fs";
import { createRequire } from "node:module";
import { createInterface } from "node:readline";
import { pathToFileURL } from "node:url";

const env = (k, d) => {
  const v = process.env[k];
  if (v === undefined || v === "") {
    if (d === undefined) throw new Error(`${k} is not set`);
    return d;
  }
  return v;
};
const root = env("CHK_TS_ROOT");
const { Client } = await import(pathToFileURL(`${root}/clients/typescript/dist/index.js`).href);
const WebSocket = createRequire(`${root}/clients/typescript/package.json`)("ws");

const url = env("CHK_TS_URL");
const keys = Number(env("CHK_KEYS", "32"));
const readers = Number(env("CHK_TS_READERS", "2"));
const batchSize = Math.max(1, Number(env("CHK_READ_BATCH", "8")));
const file = openSync(env("CHK_HISTORY"), "w");

const say = (line) => process.stdout.write(`@@ ${line}\n`);

// The history: records buffered, written every 20 ms (a killed reader leaves them up to
// its last write).
const RECORD = 33;
let buffer = Buffer.alloc(RECORD * 4096);
let used = 0;
function record(key, seen, start, end, reader) {
  if (used + RECORD > buffer.length) {
    const bigger = Buffer.alloc(buffer.length * 2);
    buffer.copy(bigger, 0, 0, used);
    buffer = bigger;
  }
  const b = buffer;
  b[used] = 0x52; // 'R'
  b.writeUInt32LE(key, used + 1);
  b.writeBigInt64LE(BigInt(seen), used + 5);
  b.writeBigUInt64LE(start, used + 13);
  b.writeBigUInt64LE(end, used + 21);
  b.writeUInt32LE(reader, used + 29);
  used += RECORD;
}
function flush() {
  if (used > 0) {
    writeSync(file, buffer, 0, used);
    used = 0;
  }
}
setInterval(flush, 20);

const client = new Client(url, { WebSocket });
const counts = { reads: 0, errors: 0, hits: 0, misses: 0 };
const replica = (key) => client.replica("Registers.value", key);

// One read: the version, or undefined for an error (an error answer, or none within 1 s:
// a reader does not wait through a lost host for good).
async function read(key) {
  const r = replica(key);
  const hit = r.status === "current" && client.answersFromReplicas;
  let timer;
  const late = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error("no answer within 1 s")), 1_000);
  });
  try {
    const answer = await Promise.race([r.get(), late]);
    if (answer && typeof answer === "object" && "Ok" in answer) {
      if (hit) counts.hits++;
      else counts.misses++;
      return answer.Ok;
    }
  } catch {
    // counted by the caller
  } finally {
    clearTimeout(timer);
  }
  return undefined;
}

let running = false;
let loops = [];
async function readerLoop(n) {
  while (running) {
    for (let i = 0; i < batchSize && running; i++) {
      const key = 1 + Math.floor(Math.random() * keys);
      const start = process.hrtime.bigint();
      const seen = await read(key);
      const end = process.hrtime.bigint();
      if (seen === undefined) {
        counts.errors++;
      } else {
        counts.reads++;
        record(key, seen, start, end, n);
      }
    }
    await new Promise((r) => setTimeout(r, 1));
  }
}

await client.ready();
say("ready ts");

const lines = createInterface({ input: process.stdin });
for await (const line of lines) {
  const words = line.trim().split(/\s+/);
  switch (words[0]) {
    case "start":
      if (!running) {
        running = true;
        loops = Array.from({ length: readers }, (_, n) => readerLoop(n));
      }
      say("started");
      break;
    case "stop":
      running = false;
      await Promise.all(loops);
      flush();
      say("stopped");
      break;
    case "final": {
      // The host caught up and its pushes were delivered: every key as the host has it.
      const values = [];
      for (let key = 1; key <= keys; key++) {
        let seen;
        for (let i = 0; i < 100 && seen === undefined; i++) {
          seen = await read(key);
          if (seen === undefined) await new Promise((r) => setTimeout(r, 50));
        }
        values.push(seen === undefined ? "err" : String(seen));
      }
      say(`final ${values.join(" ")}`);
      break;
    }
    case "stats":
      say(`stats ts_reads=${counts.reads} ts_read_errors=${counts.errors} ts_hits=${counts.hits} ts_misses=${counts.misses}`);
      break;
    case "quit":
      flush();
      closeSync(file);
      client.close();
      say("bye");
      process.exit(0);
      break;
    default:
      say(`err unknown line ${JSON.stringify(line)}`);
  }
}
