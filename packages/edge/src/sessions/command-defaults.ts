/** How long a command may run when its spec names no `timeoutMs`. */
export const DEFAULT_TIMEOUT_MS = 60_000;
/** Output kept per stream when the spec names no `maxOutputBytes` (head and tail; the middle is dropped). */
export const DEFAULT_MAX_OUTPUT_BYTES = 1024 * 1024;
