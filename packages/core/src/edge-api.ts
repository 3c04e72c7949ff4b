import type { CommandResult, CommandSpec, EdgeStatus, SandboxInfo, SandboxSpec } from './types.js';

/**
 * What the apiserver asks of an edge (paper 3.3). The edge has final admission
 * authority: `createSandbox` may throw `capacity_exhausted` even when placement
 * chose it, and the caller then tries another edge.
 *
 * Lifecycle of a sandbox on an edge:
 *   creating → running → stopping → stopped   (stop or TTL)
 *   creating → failed                          (everything taken is released)
 * A create that is interrupted by an edge crash is finished or rolled back when
 * the edge starts again. A `requestId` makes create idempotent: a retry with
 * the same ID returns the same sandbox.
 */
export interface EdgeApi {
  readonly edgeId: string;
  status(signal?: AbortSignal): Promise<EdgeStatus>;
  createSandbox(req: CreateSandboxRequest, signal?: AbortSignal): Promise<SandboxInfo>;
  /** Throws `sandbox_not_found`. */
  getSandbox(id: string, signal?: AbortSignal): Promise<SandboxInfo>;
  /** Live sandboxes; with `includeEnded`, also stopped and failed ones still retained. */
  listSandboxes(filter: { projectIds?: string[]; includeEnded?: boolean }, signal?: AbortSignal): Promise<SandboxInfo[]>;
  /** Stops and releases everything; stopping a stopped sandbox is a no-op. */
  stopSandbox(id: string, signal?: AbortSignal): Promise<void>;
  /** Runs one command to completion, streaming output to the callbacks as it comes. */
  runCommand(id: string, command: CommandSpec, options?: RunCommandOptions): Promise<CommandResult>;
}

export interface CreateSandboxRequest {
  id: string;
  projectId: string;
  spec: SandboxSpec;
  requestId?: string | undefined;
}

export interface RunCommandOptions {
  signal?: AbortSignal | undefined;
  onStdout?: ((chunk: Buffer) => void) | undefined;
  onStderr?: ((chunk: Buffer) => void) | undefined;
}
