// The live page in real Chromium: two browser contexts on one board; a change in one shows in
// the other; the server stops (offline) and restarts (live again, and current: a change made
// while it was down is shown). Screenshots of each state go under test-output/browser/.
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { join } from "node:path";
import { after, before, test } from "node:test";

import { api, ensurePageBuilt, launch, outputDir, seededDatabase, startTasks, USER } from "./harness.mjs";

let browser;
let server;
let db;
const shots = outputDir("browser");

before(async () => {
  ensurePageBuilt();
  db = seededDatabase({ tasks: 200, projects: 2 });
  server = await startTasks(db);
  browser = await launch();
});

after(async () => {
  await browser?.close();
  await server?.kill();
});

async function openBoard(url) {
  const context = await browser.newContext({ viewport: { width: 1200, height: 800 } });
  const page = await context.newPage();
  page.on("pageerror", (e) => console.error("page error:", e));
  await page.goto(url);
  await page.waitForSelector('[data-testid="connection"][data-state="live"]');
  await page.waitForSelector('[data-status="todo"] [data-task]');
  return page;
}

/** Logs `page` in through its form. */
async function logIn(page) {
  await page.getByLabel("user").fill(USER.name);
  await page.getByLabel("password").fill(USER.password);
  await page.getByRole("button", { name: "Log in" }).click();
  await page.waitForSelector(`[data-testid="account"][data-user="${USER.name}"]`);
}

const card = (status, id) => `[data-status="${status}"] [data-task="${id}"]`;

/** What a page shows and what its client holds: said when a wait fails. */
function describe(page, sel) {
  return page.evaluate((sel) => {
    const client = globalThis.coherent;
    const replicas = [...client.replicas.values()].map((r) => ({
      method: r.method,
      args: JSON.stringify(r.args),
      status: r.statusNow,
      fetching: r.fetching,
      watchId: r.watchId,
      invalidatedWhileLoading: r.invalidatedWhileLoading,
      watched: r.isWatched,
      version: r.version,
      items: r.current?.Ok?.items?.map((t) => `${t.id.slice(-6)} ${t.title}`),
    }));
    const columns = Object.fromEntries(
      [...document.querySelectorAll("[data-status]")].map((c) => [
        c.getAttribute("data-status"),
        [...c.querySelectorAll("[data-task]")].map((t) => `${t.getAttribute("data-task").slice(-6)} ${t.querySelector(".title")?.textContent}`),
      ]),
    );
    return JSON.stringify({ title: document.querySelector(sel)?.textContent ?? null, state: client.state, replicas, columns }, null, 1);
  }, sel);
}

/** Waits until the card `sel` shows `title`; on a timeout, fails with what the page holds. */
async function waitForTitle(name, page, sel, title) {
  try {
    await page.waitForFunction(([s, t]) => document.querySelector(`${s} .title`)?.textContent === t, [sel, title], {
      timeout: 20_000,
    });
  } catch (e) {
    throw new Error(`page ${name} never showed ${JSON.stringify(title)}: ${await describe(page, sel)}`, { cause: e });
  }
}

test("a change in one context shows in the other; offline, then live and current after a restart", async () => {
  const a = await openBoard(server.url("/"));
  const b = await openBoard(server.url("/"));
  // Anonymous: the board is read-only.
  const anonymousMove = a.locator('[data-status="todo"] [data-task] button[aria-label="move right"]').first();
  assert.equal(await anonymousMove.isDisabled(), true);
  for (const page of [a, b]) await logIn(page);
  await b.screenshot({ path: join(shots, "1-live.png") });

  // Read-your-writes: when a write of A's answers, no replica of A's still holds what it
  // changed as current (A's own replicas were invalidated before the answer came).
  for (let round = 0; round < 10; round++) {
    const { id: task, title } = await a.evaluate(() => {
      const card = document.querySelector('[data-status="todo"] [data-task]');
      return { id: card.getAttribute("data-task"), title: card.querySelector(".title").textContent };
    });
    const stale = await a.evaluate(
      async ([id, title, round]) => {
        await globalThis.tasksApi.rename({ id }, `Renamed in A, round ${round}`);
        const old = JSON.stringify(title);
        return [...globalThis.coherent.replicas.values()]
          .filter((r) => r.statusNow === "current" && JSON.stringify(r.current ?? null).includes(`"title":${old}`))
          .map((r) => r.method);
      },
      [task, title, round],
    );
    assert.deepEqual(stale, [], `round ${round}: replicas still current with the old title after the write answered`);
  }

  // In A: move the first task of "To do" to "In progress"; B shows it there.
  const id = await a.locator('[data-status="todo"] [data-task]').first().getAttribute("data-task");
  await a.locator(card("todo", id)).getByRole("button", { name: "move right" }).click();
  // (Both columns change: each is a replica, refetched when the move invalidates it.)
  await b.waitForSelector(card("in_progress", id));
  await b.waitForSelector(card("todo", id), { state: "detached" });

  // A write from outside the browser (as curl would) shows in both.
  await api(server, "PATCH", `/api/tasks/${id}`, { title: "Renamed by curl" });
  for (const [name, page] of [["A", a], ["B", b]]) await waitForTitle(name, page, card("in_progress", id), "Renamed by curl");
  await b.screenshot({ path: join(shots, "2-changed.png") });

  // The server stops: the indicator says offline (after its first failed attempt to reconnect).
  const port = server.port;
  await server.kill();
  for (const page of [a, b]) await page.waitForSelector('[data-testid="connection"][data-state="offline"]', { timeout: 15_000 });
  await b.screenshot({ path: join(shots, "3-offline.png") });

  // While it is down, the task changes in the database itself.
  const hexId = id.replaceAll("-", "");
  const py = `import sqlite3,sys; c=sqlite3.connect(sys.argv[1]); c.execute("UPDATE tasks SET title='Changed while offline' WHERE id=?", (bytes.fromhex(sys.argv[2]),)); c.commit()`;
  const r = spawnSync("python3", ["-c", py, db, hexId], { stdio: "inherit" });
  assert.equal(r.status, 0, "python3's sqlite3 updates the file");

  // Restarted on the same port: both pages come back live, and show the current title.
  server = await startTasks(db, { listen: `127.0.0.1:${port}` });
  for (const [name, page] of [["A", a], ["B", b]]) {
    await page.waitForSelector('[data-testid="connection"][data-state="live"]', { timeout: 15_000 });
    await waitForTitle(name, page, card("in_progress", id), "Changed while offline");
  }
  await b.screenshot({ path: join(shots, "4-live-again.png") });

  // And it is live: a new task added in B appears in A.
  await b.getByLabel("new task").fill("Added after the restart");
  await b.getByRole("button", { name: "Add" }).click();
  await a.waitForFunction(() =>
    [...document.querySelectorAll('[data-status="todo"] .title')].some((t) => t.textContent === "Added after the restart"),
  );
  await a.screenshot({ path: join(shots, "5-added.png") });
});

test("a page of another origin can neither open /rpc nor write through /api, even with the user logged in", async () => {
  const { createServer } = await import("node:http");
  // The attacker's page, on another port of the same host: same site, other origin, so the
  // SameSite=Strict login cookie still goes with its requests and only the server's own
  // checks (the Origin of the WebSocket upgrade, JSON-only writes) stand in the way.
  const evil = createServer((_, res) => {
    res.writeHead(200, { "content-type": "text/html" });
    res.end("<!doctype html><title>evil</title>");
  });
  await new Promise((resolve) => evil.listen(0, "127.0.0.1", resolve));
  try {
    const context = await browser.newContext();
    const page = await context.newPage();
    await page.goto(server.url("/"));
    await page.waitForSelector('[data-testid="connection"][data-state="live"]');
    await logIn(page);
    const project = (await api(server, "GET", "/api/projects"))[0].id;
    const count = async () => (await api(server, "GET", `/api/projects/${project}/summary`)).total;
    const before = await count();

    await page.goto(`http://127.0.0.1:${evil.address().port}/`);
    const target = server.url("");
    const outcome = await page.evaluate(async ([target, project]) => {
      const ws = await new Promise((resolve) => {
        const s = new WebSocket(`${target.replace("http", "ws")}/rpc`);
        s.onopen = () => resolve("opened");
        s.onerror = () => resolve("refused");
      });
      const body = JSON.stringify({ project, title: "forged" });
      // A "simple" request: no preflight, the cookie goes along.
      const simple = await fetch(`${target}/api/tasks`, {
        method: "POST",
        mode: "no-cors",
        credentials: "include",
        headers: { "content-type": "text/plain" },
        body,
      }).then(
        (r) => r.type,
        (e) => `failed: ${e}`,
      );
      // A JSON request needs a preflight, which the server does not grant.
      const json = await fetch(`${target}/api/tasks`, {
        method: "POST",
        credentials: "include",
        headers: { "content-type": "application/json" },
        body,
      }).then(
        (r) => `answered ${r.status}`,
        () => "blocked",
      );
      return { ws, simple, json };
    }, [target, project]);
    assert.deepEqual(outcome, { ws: "refused", simple: "opaque", json: "blocked" });
    // Nothing was written.
    assert.equal(await count(), before);
    await context.close();
  } finally {
    evil.close();
  }
});
