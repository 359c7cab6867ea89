// What the browser tests and the web bench share: the `tasks` binary on a fresh SQLite file,
// and the system's Chromium driven by playwright-core.
import { spawn, spawnSync } from "node:child_process";
import { existsSync, mkdirSync, mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

export const root = fileURLToPath(new URL("../../../../", import.meta.url));
export const webDir = fileURLToPath(new URL("../", import.meta.url));

/** Where screenshots and other outputs go (`TEST_OUTPUT`, or test-output/ here). */
export function outputDir(name) {
  const dir = join(process.env.TEST_OUTPUT ?? join(webDir, "test-output"), name);
  mkdirSync(dir, { recursive: true });
  return dir;
}

let binary;
/** Builds the `tasks` binary once (`--release` with `release: true`); answers its path. */
export function tasksBinary({ release = false } = {}) {
  if (process.env.TASKS_BIN && existsSync(process.env.TASKS_BIN)) return process.env.TASKS_BIN;
  if (binary) return binary;
  const args = ["build", "-q", "-p", "coherent-tasks", "--bin", "tasks", ...(release ? ["--release"] : [])];
  const r = spawnSync("cargo", args, { cwd: root, stdio: ["ignore", "inherit", "inherit"] });
  if (r.status !== 0) throw new Error("cargo build of the tasks binary failed");
  const target = process.env.CARGO_TARGET_DIR ?? join(root, "target");
  binary = join(target, release ? "release" : "debug", "tasks");
  return binary;
}

/** The page must be built (dist/) before the server serves it. */
export function ensurePageBuilt() {
  if (existsSync(join(webDir, "dist", "index.html")) && !process.env.REBUILD_PAGE) return;
  const r = spawnSync("npm", ["run", "build"], { cwd: webDir, stdio: ["ignore", "inherit", "inherit"] });
  if (r.status !== 0) throw new Error("the page's build failed");
}

/** A fresh SQLite database seeded with `tasks` tasks in `projects` projects. */
export function seededDatabase({ tasks = 200, projects = 2, release = false } = {}) {
  const dir = mkdtempSync(join(tmpdir(), "tasks-web-"));
  const file = join(dir, "tasks.db");
  const r = spawnSync(tasksBinary({ release }), ["--sqlite", file, "seed", "--tasks", String(tasks), "--projects", String(projects)], {
    stdio: ["ignore", "inherit", "inherit"],
    env: { ...process.env, DATABASE_URL: "" },
  });
  if (r.status !== 0) throw new Error("seeding failed");
  return file;
}

/** The user `startTasks` configures, and the secret its logins are signed with (the same on
 * every start, so a login survives a restart). */
export const USER = { name: "test", password: "a password for the tests" };
const SESSION_SECRET = "the tests' session secret, 32 b";

/** Starts `tasks serve` on `listen` over the SQLite `file`; resolves once it listens.
 * `unpaced`: its `/rpc` connections are not held to a rate of calls of their own (a
 * benchmark of the client's throughput; a browser is held to 100 a second). */
export function startTasks(file, { listen = "127.0.0.1:0", release = false, unpaced = false } = {}) {
  const args = ["--sqlite", file, "serve", "--listen", listen, "--web", join(webDir, "dist")];
  if (unpaced) args.push("--rpc-calls-per-connection", "0");
  const child = spawn(tasksBinary({ release }), args, {
    stdio: ["ignore", "inherit", "pipe"],
    // The user in the environment, not on the command line (where `ps` shows it).
    env: {
      ...process.env,
      DATABASE_URL: "",
      RUST_LOG: process.env.RUST_LOG ?? "warn",
      TASKS_USERS: `${USER.name}:${USER.password}`,
      TASKS_SESSION_SECRET: SESSION_SECRET,
    },
  });
  return new Promise((resolve, reject) => {
    child.once("exit", (code) => reject(new Error(`tasks serve exited with ${code} before listening`)));
    const lines = createInterface({ input: child.stderr });
    lines.on("line", (line) => {
      const m = /serving http:\/\/([0-9.:]+)\//.exec(line);
      if (!m) {
        process.stderr.write(`${line}\n`);
        return;
      }
      const addr = m[1];
      resolve({
        addr,
        port: Number(addr.split(":")[1]),
        url: (path = "/") => `http://${addr}${path}`,
        kill: () =>
          new Promise((done) => {
            if (child.exitCode !== null || child.signalCode !== null) return done();
            child.once("exit", () => done());
            child.kill("SIGKILL");
          }),
      });
    });
  });
}

/** The system's Chromium (`CHROMIUM`, or the Debian package's). */
export function chromiumPath() {
  for (const p of [process.env.CHROMIUM, "/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome"]) {
    if (p && existsSync(p)) return p;
  }
  throw new Error("no Chromium: install it (`apt-get install chromium`) or set CHROMIUM");
}

/** Launches headless Chromium. */
export async function launch() {
  const { chromium } = await import("playwright-core");
  return chromium.launch({ executablePath: chromiumPath(), headless: true, args: ["--no-sandbox", "--disable-gpu"] });
}

/** Logs in as `USER`; answers the cookie to send. */
export async function logIn(server) {
  const res = await fetch(server.url("/api/session"), {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify(USER),
  });
  if (!res.ok) throw new Error(`logging in: ${res.status} ${await res.text()}`);
  return res.headers.get("set-cookie").split(";")[0];
}

/** An HTTP request to the API, as curl would send it, logged in as `USER`. */
export async function api(server, method, path, body) {
  const cookie = await logIn(server);
  const res = await fetch(server.url(path), {
    method,
    headers: body === undefined ? { cookie } : { "content-type": "application/json", cookie },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await res.text();
  if (!res.ok) throw new Error(`${method} ${path}: ${res.status} ${text}`);
  return text ? JSON.parse(text) : undefined;
}
