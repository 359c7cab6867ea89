// The reactive core on its own: computed records what it read, recomputes after a change,
// watches its dependencies only while watched itself; effect re-runs; State notifies.
import assert from "node:assert/strict";
import { test } from "node:test";

import { batch, computed, effect, state, untracked } from "../src/reactive.js";

test("a computed recomputes after a dependency changes, and only then", () => {
  const a = state(1);
  const b = state(2);
  let runs = 0;
  const sum = computed(() => {
    runs++;
    return a.value + b.value;
  });
  assert.equal(sum.value, 3);
  assert.equal(sum.value, 3);
  const seen: number[] = [];
  const stop = sum.subscribe(() => seen.push(sum.value));
  const before = runs;
  a.value = 10;
  assert.deepEqual(seen, [12]);
  assert.equal(runs, before + 1);
  a.value = 10; // unchanged: nothing
  assert.deepEqual(seen, [12]);
  stop();
  b.value = 5; // unwatched: recomputed on the next read
  assert.equal(sum.value, 15);
});

test("dependencies follow what the last run read", () => {
  const which = state(true);
  const x = state("x");
  const y = state("y");
  const pick = computed(() => (which.value ? x.value : y.value));
  let notified = 0;
  const stop = pick.subscribe(() => notified++);
  assert.equal(pick.value, "x");
  which.value = false;
  assert.equal(pick.value, "y");
  const n = notified;
  x.value = "x2"; // no longer read
  assert.equal(notified, n);
  y.value = "y2";
  assert.equal(pick.value, "y2");
  stop();
});

test("computeds nest, and untracked reads are not dependencies", () => {
  const a = state(2);
  const hidden = state(100);
  const double = computed(() => a.value * 2);
  const total = computed(() => double.value + untracked(() => hidden.value));
  const values: number[] = [];
  const stop = total.subscribe(() => values.push(total.value));
  assert.equal(total.value, 104);
  a.value = 3;
  hidden.value = 1000;
  assert.deepEqual(values, [106]);
  stop();
});

test("an effect re-runs after what it read changes", async () => {
  const a = state(1);
  const seen: number[] = [];
  const stop = effect(() => {
    seen.push(a.value);
  });
  a.value = 2;
  a.value = 3; // batched into one re-run
  await new Promise((r) => setTimeout(r, 0));
  stop();
  a.value = 4;
  await new Promise((r) => setTimeout(r, 0));
  assert.deepEqual(seen, [1, 3]);
});

test("an error in a computed is rethrown to its readers, and recovers", () => {
  const a = state(0);
  const inv = computed(() => {
    if (a.value === 0) throw new Error("zero");
    return 1 / a.value;
  });
  assert.throws(() => inv.value, /zero/);
  const stop = inv.subscribe(() => {});
  a.value = 4;
  assert.equal(inv.value, 0.25);
  stop();
});

test("a computed nobody watches still sees a change (by versions, without subscribing)", () => {
  const a = state(1);
  let runs = 0;
  const c = computed(() => {
    runs++;
    return { x: a.value };
  });
  const first = c.value;
  assert.equal(c.value, first, "the same object until a dependency changes");
  assert.equal(runs, 1);
  a.value = 10;
  assert.equal(c.value.x, 10);
  // Subscribing after a change it has not seen brings it up to date first.
  a.value = 20;
  const stop = c.subscribe(() => {});
  assert.equal(c.value.x, 20);
  stop();
});

test("batch holds notifications back until it ends, then sends each once", () => {
  const a = state(1);
  const b = state(2);
  const sum = computed(() => a.value + b.value);
  const seen: number[] = [];
  const stop = sum.subscribe(() => seen.push(sum.value));
  batch(() => {
    a.value = 10;
    b.value = 20;
    assert.deepEqual(seen, [], "nothing is told inside the batch");
  });
  assert.deepEqual(seen, [30]);
  stop();
});

test("a batch that changes nothing leaves notifications working", () => {
  // (It once left its empty set installed: every later notification went into it, unsent.)
  const a = state(1);
  const seen: number[] = [];
  const stop = a.subscribe(() => seen.push(a.value));
  batch(() => {});
  a.value = 2;
  batch(() => {
    a.value = 3;
  });
  assert.deepEqual(seen, [2, 3]);
  stop();
});
