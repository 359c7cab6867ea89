/**
 * A small reactive core, framework-agnostic: values that say when they change, and
 * `computed(() => ...)`, which records what it read (replicas, other computeds) and
 * recomputes after one of them changes — the shape of Coherent's Rust core, on the client.
 * @module
 */

/** Called when a value changed (read it again to see how). */
export type Listener = () => void;

/** A value that can be watched. */
export interface Observable {
  /** Calls `listener` after each change until the returned function is called. */
  subscribe(listener: Listener): () => void;
  /**
   * A number that changes with the value (read without recording a dependency): how a
   * computed that nobody watches knows, without subscribing, whether to recompute.
   */
  readonly version: number;
}

interface Collector {
  read(source: Observable): void;
}

let collector: Collector | undefined;

/** Records that the computation now running read `source` (called by readable values). */
export function track(source: Observable): void {
  collector?.read(source);
}

/** Runs `fn` without recording what it reads. */
export function untracked<T>(fn: () => T): T {
  const saved = collector;
  collector = undefined;
  try {
    return fn();
  } finally {
    collector = saved;
  }
}

let batched: Set<Listeners> | undefined;

/**
 * Runs `fn`, holding back the notifications of what it changes until it returns, so that
 * listeners see all of its changes at once, never some of them.
 */
export function batch<T>(fn: () => T): T {
  if (batched !== undefined) return fn();
  let held = new Set<Listeners>();
  batched = held;
  try {
    return fn();
  } finally {
    batched = undefined;
    // In rounds: what the first round's listeners notify in turn (a computed telling its
    // own listeners) is gathered and told once in the next, after every source is marked.
    while (held.size > 0) {
      const next = new Set<Listeners>();
      batched = next;
      try {
        for (const l of held) l.notifyNow();
      } finally {
        batched = undefined;
      }
      held = next;
    }
  }
}

/** A set of listeners with the subscribe/notify plumbing, for values built on this core. */
export class Listeners {
  private readonly set = new Set<Listener>();
  private onFirst: (() => void) | undefined;
  private onLast: (() => void) | undefined;

  /** `onFirst`/`onLast` run when the value gains its first listener and loses its last. */
  constructor(onFirst?: () => void, onLast?: () => void) {
    this.onFirst = onFirst;
    this.onLast = onLast;
  }

  /** How many listeners there are. */
  get size(): number {
    return this.set.size;
  }

  /** Adds a listener; answers its removal (idempotent). */
  add(listener: Listener): () => void {
    // A wrapper, so that the same function can be subscribed twice.
    const entry = () => listener();
    this.set.add(entry);
    if (this.set.size === 1) this.onFirst?.();
    return () => {
      if (this.set.delete(entry) && this.set.size === 0) this.onLast?.();
    };
  }

  /** Calls every listener (at the end of the {@link batch} running now, if one is); one that throws does not stop the others. */
  notify(): void {
    if (batched !== undefined) {
      batched.add(this);
      return;
    }
    this.notifyNow();
  }

  /** @internal Calls every listener now. */
  notifyNow(): void {
    for (const l of [...this.set]) {
      try {
        l();
      } catch (e) {
        queueMicrotask(() => {
          throw e;
        });
      }
    }
  }
}

/** A value computed from others, recomputed when they change. */
export class Computed<T> implements Observable {
  private readonly fn: () => T;
  private current: { ok: true; value: T } | { ok: false; error: unknown } | undefined;
  /** Set by a dependency's notification while watched. */
  private dirty = true;
  private evaluating = false;
  /** Whether it watches its dependencies (it has listeners). */
  private watched = false;
  private changes = 0;
  /** What the last run read: each dependency's version then, and its subscription while watched. */
  private deps = new Map<Observable, { version: number; unsubscribe: (() => void) | undefined }>();
  private readonly listeners = new Listeners(
    () => this.watchDeps(),
    () => this.unwatchDeps(),
  );

  constructor(fn: () => T) {
    this.fn = fn;
  }

  /** The value (computed now if a dependency changed since); rethrows what `fn` threw. */
  get value(): T {
    track(this);
    const c = this.evaluate();
    if (!c.ok) throw c.error;
    return c.value;
  }

  /** The value without recording the read in the computation running now. */
  peek(): T {
    return untracked(() => this.value);
  }

  /** Changes each time the value is computed again (brings it up to date first). */
  get version(): number {
    this.evaluate();
    return this.changes;
  }

  /** Calls `listener` after each change of a dependency. Subscribing keeps the dependencies watched. */
  subscribe(listener: Listener): () => void {
    return this.listeners.add(listener);
  }

  private get stale(): boolean {
    if (this.current === undefined) return true;
    if (this.watched) return this.dirty;
    // Unwatched, nothing notifies it: compare what it read with what there is now.
    for (const [dep, seen] of this.deps) if (dep.version !== seen.version) return true;
    return false;
  }

  private evaluate(): { ok: true; value: T } | { ok: false; error: unknown } {
    if (this.evaluating || !this.stale) return this.current ?? { ok: false, error: new Error("a computed read itself") };
    const read = new Set<Observable>();
    const saved = collector;
    collector = { read: (s) => s !== this && read.add(s) };
    this.evaluating = true;
    try {
      this.current = { ok: true, value: this.fn() };
    } catch (error) {
      this.current = { ok: false, error };
    } finally {
      collector = saved;
      this.evaluating = false;
    }
    this.dirty = false;
    this.changes++;
    const watching = this.watched;
    for (const [dep, seen] of this.deps) {
      if (!read.has(dep)) seen.unsubscribe?.();
    }
    const next = new Map<Observable, { version: number; unsubscribe: (() => void) | undefined }>();
    for (const dep of read) {
      const unsubscribe = this.deps.get(dep)?.unsubscribe ?? (watching ? dep.subscribe(this.changed) : undefined);
      next.set(dep, { version: dep.version, unsubscribe });
    }
    this.deps = next;
    return this.current;
  }

  private readonly changed = (): void => {
    if (this.dirty) return;
    this.dirty = true;
    this.listeners.notify();
  };

  private watchDeps(): void {
    // Know the dependencies, up to date, before watching them.
    this.evaluate();
    for (const [dep, seen] of this.deps) seen.unsubscribe = dep.subscribe(this.changed);
    this.watched = true;
    this.dirty = false;
  }

  private unwatchDeps(): void {
    this.watched = false;
    for (const seen of this.deps.values()) {
      seen.unsubscribe?.();
      seen.unsubscribe = undefined;
    }
  }
}

/** A value computed by `fn` from the replicas and computeds it reads. */
export function computed<T>(fn: () => T): Computed<T> {
  return new Computed(fn);
}

/**
 * Runs `fn` now and again after each change of what it read, until the returned function
 * is called: how a page keeps a DOM node in step with replicas without a framework.
 */
export function effect(fn: () => void): () => void {
  const c = new Computed(fn);
  let scheduled = false;
  const unsubscribe = c.subscribe(() => {
    if (scheduled) return;
    scheduled = true;
    queueMicrotask(() => {
      scheduled = false;
      c.value;
    });
  });
  try {
    c.value;
  } catch (e) {
    unsubscribe();
    throw e;
  }
  return unsubscribe;
}

/** A writable value of the reactive core (local UI state beside replicas). */
export class State<T> implements Observable {
  private current: T;
  private changes = 0;
  private readonly listeners = new Listeners();

  constructor(value: T) {
    this.current = value;
  }

  /** The value; reading it inside a computed makes the computed depend on it. */
  get value(): T {
    track(this);
    return this.current;
  }

  set value(v: T) {
    if (Object.is(v, this.current)) return;
    this.current = v;
    this.changes++;
    this.listeners.notify();
  }

  /** Changes with the value. */
  get version(): number {
    return this.changes;
  }

  /** Calls `listener` after each change. */
  subscribe(listener: Listener): () => void {
    return this.listeners.add(listener);
  }
}

/** A writable reactive value. */
export function state<T>(value: T): State<T> {
  return new State(value);
}
