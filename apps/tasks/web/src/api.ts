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
  if (res.status === 401) setUser(null);
  if (!res.ok) {
    const text = await res.text();
    throw new Error(`${method} ${path}: ${res.status} ${text}`);
  }
}

// ---- the login: a cookie the server signs (HttpOnly: the page never sees it), and the
// name it stands for, which the page asks for at start. Writes need one.

let user: string | null = null;
const listeners = new Set<() => void>();

function setUser(name: string | null): void {
  if (name === user) return;
  user = name;
  for (const l of listeners) l();
}

/** Who is logged in (`null`: nobody), and a way to hear of changes: for `useSyncExternalStore`. */
export const session = {
  current: (): string | null => user,
  subscribe(listener: () => void): () => void {
    listeners.add(listener);
    return () => listeners.delete(listener);
  },
};

/** Asks the server who the cookie (if any) stands for. */
export async function refreshSession(): Promise<void> {
  const res = await fetch("/api/session");
  setUser(res.ok ? ((await res.json()) as { name: string }).name : null);
}

/** Logs in; throws the server's reason when it refuses. */
export async function logIn(name: string, password: string): Promise<void> {
  const res = await fetch("/api/session", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ name, password }),
  });
  if (!res.ok) throw new Error(((await res.json()) as { error: string }).error);
  setUser(((await res.json()) as { name: string }).name);
}

/** Logs out. */
export async function logOut(): Promise<void> {
  await fetch("/api/session", { method: "DELETE" });
  setUser(null);
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
