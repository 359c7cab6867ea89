// Type-level checks: with a service's declarations, a replica's method, arguments and value
// are checked by tsc (the `@ts-expect-error` lines must stay errors, or the build fails).
import assert from "node:assert/strict";
import { test } from "node:test";

import { Client } from "../src/index.js";
import { NodeWebSocket } from "./server.js";

interface Service {
  "S.get": { args: [id: string]; result: { Ok: number } | { Err: string } };
  "S.none": { args: []; result: string[] };
}

test("declarations type-check method names, arguments and values", () => {
  const client = new Client<Service>("ws://127.0.0.1:1/rpc", { WebSocket: NodeWebSocket, reconnect: false });
  const r = client.replica("S.get", "x");
  const v: { Ok: number } | { Err: string } | undefined = r.value;
  const list: string[] | undefined = client.replica("S.none").value;
  // @ts-expect-error: no such method
  client.replica("S.nope", "x");
  // @ts-expect-error: the argument is a string
  client.replica("S.get", 5);
  // @ts-expect-error: one argument
  client.replica("S.get");
  // @ts-expect-error: the value is not a string
  const wrong: string | undefined = r.value;
  assert.equal(v, undefined);
  assert.equal(list, undefined);
  assert.equal(wrong, undefined);
  client.close();
});
