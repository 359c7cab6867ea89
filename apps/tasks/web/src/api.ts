// The page's link to the server: one Coherent client over the `/rpc` WebSocket, for reads
// (replicas) and writes (commands, whose invalidations come back to every page holding what
// they changed, this one's before its answer). The HTTP API is for the login.
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

/** A command's failure, as the host answers it (`coherent_ops::CommandError`). */
interface CommandError {
  kind: string;
  message: string;
  /** The application's own error, as JSON, when the handler gave one (`with_detail`). */
  detail?: string | null;
}

/**
 * Runs a command on the backend over the page's own connection (`Commands.run`). Its answer
 * comes after the replicas this connection holds of what it changed were invalidated here
 * (the backend waits for the writing connection's acknowledgement): the page sees its own
 * write as soon as the promise resolves. Needs a login (an anonymous connection is refused).
 */
async function command<T>(kind: string, body: unknown): Promise<T> {
  const answer = await client.call<{ Ok: string } | { Err: CommandError }>("Commands.run", [kind, JSON.stringify(body)]);
  if ("Err" in answer) {
    if (answer.Err.kind === "Unauthorized") setUser(null);
    throw new Error(`${kind}: ${answer.Err.kind}: ${answer.Err.message}`);
  }
  return JSON.parse(answer.Ok) as T;
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
  // The connection was opened before the cookie existed: the server sees it on a new one.
  client.reconnect();
}

/** Logs out. */
export async function logOut(): Promise<void> {
  await fetch("/api/session", { method: "DELETE" });
  setUser(null);
  client.reconnect();
}

/** Moves a task to another column. */
export async function setStatus(task: Pick<Task, "id">, status: Status): Promise<void> {
  await command<Task>("tasks.update", { id: task.id, patch: { status } });
}

/** Renames a task. */
export async function rename(task: Pick<Task, "id">, title: string): Promise<void> {
  await command<Task>("tasks.update", { id: task.id, patch: { title } });
}

/** Adds a task to a project. */
export async function addTask(project: string, title: string): Promise<void> {
  await command<Task>("tasks.create", { new: { project, title } });
}

// For the browser tests: the writes, called as the page calls them.
(globalThis as { tasksApi?: unknown }).tasksApi = { setStatus, rename, addTask };
