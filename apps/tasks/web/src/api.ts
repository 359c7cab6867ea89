// The page's link to the server: one Coherent client for reads (replicas over the `/rpc`
// WebSocket) and the HTTP API for writes (each write is a command on the server, whose
// invalidations come back to every page holding what it changed).
import { Client } from "@coherent/client";

import type { ApiError, Status, Task, TasksService } from "./generated/tasks";

function rpcUrl(): string {
  const url = new URL("/rpc", location.href);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  return url.toString();
}

/** The page's client: typed by the declarations generated from the Rust service. */
export const client = new Client<TasksService>(rpcUrl());

// For the browser tests and for poking at it from the console.
(globalThis as { coherent?: unknown }).coherent = client;

/** The value of a method answering `Result<T, ApiError>`, or `undefined` while loading. */
export function ok<T>(r: { Ok: T } | { Err: ApiError } | undefined): T | undefined {
  if (r === undefined) return undefined;
  if ("Ok" in r) return r.Ok;
  throw new Error(describe(r.Err));
}

function describe(e: ApiError): string {
  // A unit variant is its name; the others are a one-entry map from the name to the data.
  if (typeof e === "string") return e;
  const [[kind, detail]] = Object.entries(e) as [[string, unknown]];
  return typeof detail === "string" ? `${kind}: ${detail}` : `${kind}: ${JSON.stringify(detail)}`;
}

async function send(method: string, path: string, body: unknown): Promise<void> {
  const res = await fetch(path, {
    method,
    headers: { "content-type": "application/json" },
    body: JSON.stringify(body),
  });
  if (!res.ok) {
    const text = await res.text();
    throw new Error(`${method} ${path}: ${res.status} ${text}`);
  }
}

/** Moves a task to another column. */
export function setStatus(task: Task, status: Status): Promise<void> {
  return send("PATCH", `/api/tasks/${task.id}`, { status });
}

/** Renames a task. */
export function rename(task: Task, title: string): Promise<void> {
  return send("PATCH", `/api/tasks/${task.id}`, { title });
}

/** Adds a task to a project. */
export function addTask(project: string, title: string): Promise<void> {
  return send("POST", "/api/tasks", { project, title });
}
