/**
 * React bindings: `useComputed` renders from replicas and computeds and re-renders when
 * what it read changes; `useReplica` and `useClientState` are shorthands.
 * @module
 */

import { useCallback, useMemo, useSyncExternalStore } from "react";

import type { Client, ClientState, ComputeMethods, Replica } from "./client.js";
import { Computed, type Listener } from "./reactive.js";

/**
 * The value of `fn`, which reads replicas (`replica.value`) and computeds: the component
 * re-renders when one of them changes, and what it reads stays watched (so fetched and kept
 * current) while it is mounted. `deps` rebuild the computation, as for `useMemo`.
 */
export function useComputed<T>(fn: () => T, deps: readonly unknown[] = []): T {
  // eslint-disable-next-line react-hooks/exhaustive-deps
  const c = useMemo(() => new Computed(fn), deps);
  // Stable functions: new ones would make React resubscribe after every render.
  const subscribe = useCallback((onChange: Listener) => c.subscribe(onChange), [c]);
  // The same value until a dependency changes (a computed caches it).
  const snapshot = useCallback(() => c.value, [c]);
  return useSyncExternalStore(subscribe, snapshot, snapshot);
}

/** The replica of `method` for `args`, re-rendered when its value or status changes. */
export function useReplica<S extends ComputeMethods<S>, M extends keyof S & string>(
  client: Client<S>,
  method: M,
  ...args: S[M]["args"]
): Replica<S[M]["result"]> {
  const key = JSON.stringify(args);
  // eslint-disable-next-line react-hooks/exhaustive-deps
  const replica = useMemo(() => client.replica(method, ...args), [client, method, key]);
  const subscribe = useCallback((onChange: Listener) => replica.subscribe(onChange), [replica]);
  const snapshot = useCallback(() => replica.version, [replica]);
  useSyncExternalStore(subscribe, snapshot, snapshot);
  return replica;
}

/** The client's connection state (`live`, `reconnecting`, `offline`, ...), re-rendered as it changes. */
export function useClientState<S extends ComputeMethods<S>>(client: Client<S>): ClientState {
  const subscribe = useCallback((onChange: Listener) => client.onStateChange(onChange), [client]);
  const snapshot = useCallback(() => client.state, [client]);
  return useSyncExternalStore(subscribe, snapshot, snapshot);
}
