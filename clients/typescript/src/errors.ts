/**
 * Errors, with the codes of PROTOCOL.md section 6 (the same as the Rust `ErrorCode`).
 * @module
 */

/** The protocol's error codes. Codes not listed here are kept as numbers. */
export const ErrorCode = {
  UnknownMethod: 1,
  BadArguments: 2,
  DeadlineExceeded: 3,
  Disconnected: 4,
  TooLarge: 5,
  Unauthenticated: 6,
  Overloaded: 7,
  Cancelled: 8,
  Protocol: 9,
  Internal: 10,
  UnsupportedVersion: 11,
} as const;

/** A code of {@link ErrorCode}, or another number a newer peer sent. */
export type ErrorCode = (typeof ErrorCode)[keyof typeof ErrorCode] | (number & {});

const NAMES: Record<number, string> = Object.fromEntries(
  Object.entries(ErrorCode).map(([name, code]) => [code, name]),
);

/** The name of a code (`"Unknown(42)"` for a code this client does not know). */
export function errorCodeName(code: number): string {
  return NAMES[code] ?? `Unknown(${code})`;
}

/**
 * A call or a connection failed: the peer answered an `Error` frame, closed the
 * connection, or the failure was found here (a deadline, a cancellation, a bad frame).
 */
export class RpcError extends Error {
  /** The protocol code. */
  readonly code: ErrorCode;

  constructor(code: ErrorCode, message: string, options?: { cause?: unknown }) {
    super(`${errorCodeName(code)}: ${message}`, options);
    this.name = "RpcError";
    this.code = code;
  }

  /** The code's name, e.g. `"Disconnected"`. */
  get codeName(): string {
    return errorCodeName(this.code);
  }

  /** The message without the code's name. */
  get reason(): string {
    const prefix = `${this.codeName}: `;
    return this.message.startsWith(prefix) ? this.message.slice(prefix.length) : this.message;
  }

  /** Whether a retry on a new connection may succeed (the connection, not the call, failed). */
  get isTransient(): boolean {
    return this.code === ErrorCode.Disconnected || this.code === ErrorCode.Overloaded;
  }
}
