/**
 * `@coherent/client`: Coherent's TypeScript client. It speaks the Coherent RPC protocol
 * (PROTOCOL.md) over a WebSocket, in MessagePack: calls, streams, and replicas of a server's
 * compute methods that the server keeps current by pushing invalidations.
 * @module
 */

export { Client, Replica } from "./client.js";
export type { ClientOptions, ClientState, ComputeMethods, MethodShape, ReconnectOptions, ReplicaStatus } from "./client.js";
export { Connection } from "./connection.js";
export type { CallOptions, ConnectionOptions, WebSocketFactory, WebSocketLike } from "./connection.js";
export { ErrorCode, RpcError, errorCodeName } from "./errors.js";
export { Computed, Listeners, State, batch, computed, effect, state, track, untracked } from "./reactive.js";
export type { Listener, Observable } from "./reactive.js";
export { methodId, valueHash } from "./hash.js";
export { decode, encode, encodeArgs } from "./codec.js";
export * as wire from "./frame.js";
