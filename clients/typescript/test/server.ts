// Starts the Rust test server (examples/ts_server.rs) as a child process for the tests.
import { type ChildProcess, spawn, spawnSync } from "node:child_process";
import { existsSync } from "node:fs";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

import WebSocket from "ws";

import type { WebSocketFactory } from "../src/connection.js";

/** The `ws` package's WebSocket, for Node 20 (which has no global one). */
export const NodeWebSocket = WebSocket as unknown as WebSocketFactory;

const root = fileURLToPath(new URL("../../../../", import.meta.url));

let built: string | undefined;

/** Builds the test server once (cargo), answers its path. */
export function serverBinary(): string {
  if (built) return built;
  const fromEnv = process.env.COHERENT_TS_SERVER;
  if (fromEnv && existsSync(fromEnv)) return (built = fromEnv);
  const r = spawnSync("cargo", ["build", "-q", "-p", "coherent-examples", "--example", "ts_server"], {
    cwd: root,
    stdio: ["ignore", "inherit", "inherit"],
  });
  if (r.status !== 0) throw new Error("cargo build of the ts_server example failed");
  const target = process.env.CARGO_TARGET_DIR ?? `${root}target`;
  built = `${target}/debug/examples/ts_server`;
  return built;
}

/** A running server. */
export interface Server {
  /** `127.0.0.1:PORT`. */
  addr: string;
  ws(path?: string): string;
  http(path: string): string;
  child: ChildProcess;
  kill(signal?: NodeJS.Signals): Promise<void>;
}

/** Starts the server with `args`; resolves once it listens. */
export function startServer(args: string[] = []): Promise<Server> {
  const child = spawn(serverBinary(), args, { stdio: ["ignore", "pipe", "inherit"] });
  return new Promise((resolve, reject) => {
    const lines = createInterface({ input: child.stdout! });
    child.once("exit", (code) => reject(new Error(`ts_server exited with ${code} before listening`)));
    lines.once("line", (line) => {
      const addr: string = JSON.parse(line).listening;
      resolve({
        addr,
        child,
        ws: (path = "/rpc") => `ws://${addr}${path}`,
        http: (path) => `http://${addr}${path}`,
        kill: (signal = "SIGKILL") =>
          new Promise((done) => {
            if (child.exitCode !== null || child.signalCode !== null) return done();
            child.once("exit", () => done());
            child.kill(signal);
          }),
      });
    });
  });
}

/** Waits until `check` holds, polling; fails after `ms`. */
export async function until(check: () => boolean | Promise<boolean>, ms = 5_000, what = "a condition"): Promise<void> {
  const end = Date.now() + ms;
  while (!(await check())) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 5));
  }
}
