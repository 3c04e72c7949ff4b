/**
 * @dsec/cli — the `dsec` command line: noun-verb commands over the HTTP API
 * through @dsec/sdk (`dsec sandbox create|exec|ls|get|rm`, `dsec image ls`,
 * `dsec project create|ls`, `dsec key create|rm`). `bin/dsec` runs the built
 * `main`; tests call it in-process with their own output writers.
 *
 * @example
 * ```ts
 * import { main } from '@dsec/cli';
 * let out = '';
 * const code = await main(['sandbox', 'create', '--image', 'busybox'], {
 *   stdout: { write: (s: string) => (out += s) },
 * });
 * // code === 0, out === 'sb-…\n'
 * ```
 */
export { main, VERSION } from './main.js';
export { CliContext, contextOf } from './context.js';
export type { CliIo, GlobalOptions, Writer } from './context.js';
export { createProgress } from './progress.js';
export type { Progress, ProgressOptions } from './progress.js';
