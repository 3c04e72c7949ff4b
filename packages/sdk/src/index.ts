/**
 * @dsec/sdk — the TypeScript client of DSec (the paper's libdsec): create a
 * sandbox, run commands in it, stop it. Talks HTTP API v1
 * (docs/CONVENTIONS.md) over pooled keep-alive sockets; every call takes an
 * `AbortSignal` and has a deadline, and every failure is a `DsecError` whose
 * `code` says what to do (`unavailable`, `quota_exceeded`, ...).
 *
 * @example The paper's minimal session (run with `DSEC_URL`/`DSEC_API_KEY` set):
 * ```ts
 * import { DSecClient } from '@dsec/sdk';
 *
 * const client = new DSecClient(); // DSEC_URL, DSEC_API_KEY
 * await client.open();
 * const sandbox = await client.runContainer(
 *   {
 *     image: 'busybox',
 *     memoryLimitMb: 4096,
 *     cpuCoresLimit: 4,
 *     ttlRunningStopSeconds: 300,
 *     networkRules: { npm: false, pypi: true },
 *     initUser: 'root',
 *   },
 *   { timeoutMs: 120_000 },
 * );
 * const result = await sandbox.runShell('echo hello world');
 * console.log(result.exitCode, result.stdout); // 0 'hello world\n'
 * await sandbox.exec(['ls', '-la'], { onStdout: (text) => process.stdout.write(text) });
 * await sandbox.stop();
 * client.close();
 * ```
 */
export {
  DSecClient,
  DEFAULT_URL,
  DEFAULT_TIMEOUT_MS,
  DEFAULT_CREATE_TIMEOUT_MS,
} from './client.js';
export { Sandbox } from './sandbox.js';
export { DEFAULT_COMMAND_TIMEOUT_MS, COMMAND_DEADLINE_SLACK_MS } from './deadlines.js';
export type * from './types.js';
export { DsecError, isDsecError } from '@dsec/core';
export type {
  Answer,
  Body,
  CommandInfo,
  CommandResult,
  CommandWireEvent,
  EdgeStatus,
  ErrorCode,
  FileInfo,
  FileType,
  ForkResult,
  LayerInfo,
  NetworkPolicyPatch,
  NetworkRules,
  NetworkTarget,
  QosClass,
  SandboxEvent,
  SandboxEventKind,
  SandboxInfo,
  SandboxSpec,
  SandboxState,
  SessionInfo,
  SessionResult,
  SnapshotInfo,
  VolumeInfo,
} from './wire.js';
/** Every path, operation and schema of docs/openapi.json, as generated types. */
export type { components, operations, paths } from './gen/openapi.js';
export type { EventsOptions } from './network.js';
export { DEFAULT_LIFECYCLE_TIMEOUT_MS } from './lifecycle.js';
export type { JobAction } from './lifecycle.js';
export { Commands, CommandHandle } from './commands.js';
export type { CommandOptions, StartOptions } from './commands.js';
export { CommandRun } from './command-run.js';
export type { CommandEvent, OutputCallbacks } from './command-run.js';
export { Session } from './session.js';
export type { SessionOptions, SessionRunOptions } from './session.js';
export { Files } from './files.js';
export type { FileCallOptions, WriteOptions } from './files.js';
export type { SandboxFetchInit } from './port-fetch.js';
export { Terminal } from './terminal.js';
export { FnCalls } from './fncall.js';
export type {
  FnCallMapItem,
  FnCallMapOptions,
  FnCallOutcome,
  FnCallPoolStatus,
  FnCallRequest,
  FnCallResult,
} from './fncall.js';
export type { TerminalOptions } from './terminal.js';
export type { DisplayInput, DisplayInputEvent } from './display.js';
