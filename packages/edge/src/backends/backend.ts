import type { BackendKind, CommandResult, CommandSpec, RunCommandOptions } from '@dsec/core';
import type { ChronusConnection } from '@dsec/native';
import type { SandboxRecord } from '../state/edge-store.js';

/** What one pause did (logged; the benchmark reads the memory figures). */
export interface PauseResult {
  /** How long freezing the processes took. */
  freezeMs: number;
  /** How long pushing the memory out took. */
  reclaimMs: number;
  memoryBeforeBytes: number;
  memoryAfterBytes: number;
}

export interface StartedSandbox {
  /** The runtime process, where one stays per sandbox (not for detached OCI runtimes). */
  runtimePid?: number;
  initPid: number;
  chronusPid: number;
}

/**
 * One way of running sandboxes on a node (paper 2.2): container here; fncall,
 * microVM and VM plug in behind the same interface.
 *
 * Lifecycle: `start` takes a record in state `creating` to running and
 * returns the processes to remember; `stop` releases everything and must
 * succeed on a half-started or already stopped sandbox (it is also how a
 * failed start is rolled back); `isRunning` and `ensureChronus` let the edge
 * reconcile after its own restart.
 */
export interface Backend {
  readonly kind: BackendKind;
  start(rec: SandboxRecord, signal?: AbortSignal): Promise<StartedSandbox>;
  stop(rec: SandboxRecord): Promise<void>;
  isRunning(rec: SandboxRecord): Promise<boolean>;
  /** Restarts the command daemon if it died; returns its new PID, or undefined if it was alive. */
  ensureChronus(rec: SandboxRecord): Promise<number | undefined>;
  runCommand(
    rec: SandboxRecord,
    command: CommandSpec,
    options: RunCommandOptions & { commandId: string },
  ): Promise<CommandResult>;
  /** The sandbox's chronus connection (shared, or a new `dedicated` one the caller closes). */
  channel?(rec: SandboxRecord, options?: { dedicated?: boolean }): Promise<ChronusConnection>;
  /** Whether the OOM killer struck the sandbox since this was last asked. */
  oomKilled?(rec: SandboxRecord): Promise<boolean>;
  /**
   * Pause (docs/adr/0012-pause-and-resume.md): stops every process of the
   * sandbox and gives its memory back to the host, keeping all of its state.
   * Idempotent: on a paused sandbox it freezes and reclaims again (how a
   * pause interrupted by an edge crash is finished). Optional with `resume`,
   * `isFrozen` and `memoryBytes`: the edge answers `unavailable` without them.
   */
  pause?(rec: SandboxRecord): Promise<PauseResult>;
  /**
   * Undoes `pause`; idempotent. Returns the command daemon's new PID when it
   * had to be restarted (it may have died while the sandbox was paused).
   */
  resume?(rec: SandboxRecord): Promise<{ chronusPid?: number | undefined }>;
  /** Whether the sandbox's processes are frozen now (reconcile compares this with the record). */
  isFrozen?(rec: SandboxRecord): Promise<boolean>;
  /** Host memory charged to the sandbox now; undefined when it has none (gone). */
  memoryBytes?(rec: SandboxRecord): Promise<number | undefined>;
  /**
   * The edge is shutting down: release every handle this process holds for
   * its sandboxes (connections to their command daemons, pipes to runtime
   * processes) so that nothing keeps the process alive. The sandboxes keep
   * running; the next edge adopts them. Nothing is called after it.
   */
  close?(): Promise<void>;
}
