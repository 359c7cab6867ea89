// The live page in real Chromium: two browser contexts on one board; a change in one shows in
// the other; the server stops (offline) and restarts (live again, and current: a change made
// while it was down is shown). Screenshots of each state go under test-output/browser/.
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { join } from "node:path";
import { after, before, test } from "node:test";

import { api, ensurePageBuilt, launch, outputDir, seededDatabase, startTasks } from "./harness.mjs";

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

const card = (status, id) => `[data-status="${status}"] [data-task="${id}"]`;

test("a change in one context shows in the other; offline, then live and current after a restart", async () => {
  const a = await openBoard(server.url("/"));
  const b = await openBoard(server.url("/"));
  await b.screenshot({ path: join(shots, "1-live.png") });

  // In A: move the first task of "To do" to "In progress"; B shows it there.
  const id = await a.locator('[data-status="todo"] [data-task]').first().getAttribute("data-task");
  await a.locator(card("todo", id)).getByRole("button", { name: "move right" }).click();
  // (Both columns change: each is a replica, refetched when the move invalidates it.)
  await b.waitForSelector(card("in_progress", id));
  await b.waitForSelector(card("todo", id), { state: "detached" });

  // A write from outside the browser (as curl would) shows in both.
  await api(server, "PATCH", `/api/tasks/${id}`, { title: "Renamed by curl" });
  for (const page of [a, b]) {
    await page.waitForFunction(
      ([sel]) => document.querySelector(sel)?.textContent === "Renamed by curl",
      [`${card("in_progress", id)} .title`],
    );
  }
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
  for (const page of [a, b]) {
    await page.waitForSelector('[data-testid="connection"][data-state="live"]', { timeout: 15_000 });
    await page.waitForFunction(
      ([sel]) => document.querySelector(sel)?.textContent === "Changed while offline",
      [`${card("in_progress", id)} .title`],
    );
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
