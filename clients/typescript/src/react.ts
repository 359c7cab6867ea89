/**
 * React bindings: `useComputed` renders from replicas and computeds and re-renders when
 * what it read changes; `useReplica` and `useClientState` are shorthands.
 * @module
 */

import { useMemo, useSyncExternalStore } from "react";

import type { Client, ClientState, ComputeMethods, Replica } from "./client.js";
import { Computed } from "./reactive.js";

/**
 * The value of `fn`, which reads replicas (`replica.value`) and computeds: the component
 * re-renders when one of them changes, and what it reads stays watched (so fetched and kept
 * current) while it is mounted. `deps` rebuild the computation, as for `useMemo`.
 */
export function useComputed<T>(fn: () => T, deps: readonly unknown[] = []): T {
  // eslint-disable-next-line react-hooks/exhaustive-deps
  const c = useMemo(() => new Computed(fn), deps);
  return useSyncExternalStore(
    (onChange) => c.subscribe(onChange),
    () => c.value,
    () => c.value,
  );
}

/** The value of a replica (`undefined` while loading), re-rendered when it changes. */
export function useReplica<S extends ComputeMethods<S>, M extends keyof S & string>(
  client: Client<S>,
  method: M,
  ...args: S[M]["args"]
): Replica<S[M]["result"]> {
  const key = JSON.stringify(args);
  // eslint-disable-next-line react-hooks/exhaustive-deps
  const replica = useMemo(() => client.replica(method, ...args), [client, method, key]);
  useSyncExternalStore(
    (onChange) => replica.subscribe(onChange),
    () => replica.version,
    () => replica.version,
  );
  return replica;
}

/** The client's connection state (`live`, `reconnecting`, `offline`, ...), re-rendered as it changes. */
export function useClientState<S extends ComputeMethods<S>>(client: Client<S>): ClientState {
  return useSyncExternalStore(
    (onChange) => client.onStateChange(onChange),
    () => client.state,
    () => client.state,
  );
}
