import type { BackendKind, DisplayInput } from '@dsec/core';
import type { SandboxRecord } from '../state/edge-store.js';
import type { PidsLimitEvent, SandboxChannel } from './channel.js';
import type { GpuSpecFragment } from '../gpu/oci-fragment.js';

export type { SandboxChannel, SandboxCommand } from './channel.js';

/**
 * What a backend is told about a sandbox: its identity, request and layers,
 * and the process IDs its own `start` returned (kept by the edge across its
 * restarts). Nothing of the edge's bookkeeping (state, TTLs, project).
 */
export type BackendSandbox = Pick<
  SandboxRecord,
  'id' | 'slot' | 'spec' | 'layers' | 'runtimePid' | 'initPid' | 'chronusPid'
> & {
  /**
   * Only on `start`, from the edge itself (never part of the public
   * `SandboxSpec`, never persisted): GPUs assigned to this sandbox (an
   * FnCall worker's), merged into its OCI config. Only the container
   * backend takes them; the edge refuses them for other backends.
   */
  gpu?: GpuSpecFragment | undefined;
  /**
   * Only on `start`, from the edge (never persisted): the host-side mounts
   * of the volumes `spec.volumes` names, in that order, each with its path
   * in the sandbox (docs/volumes.md). Only the container backend takes them;
   * the edge refuses volumes for other backends.
   */
  volumes?: { source: string; path: string }[] | undefined;
};

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
  /** The process whose life is the sandbox's (the container's init; the VM's hypervisor). */
  initPid: number;
  /** The host process serving the channel (a container's chronus; a microVM's hypervisor). */
  chronusPid: number;
}

/**
 * One way of running sandboxes on a node (paper 2.2): containers and
 * microVMs plug in behind this interface, and everything inside a sandbox
 * (commands, sessions, files, ports, ptys) goes through its `channel`, so
 * the edge's in-sandbox layer (sessions/) is the same for every backend.
 * `testing/conformance.ts` is the suite every backend passes.
 *
 * Lifecycle: `start` takes a sandbox being created to running and returns
 * the processes to remember; `stop` releases everything and must succeed on
 * a half-started or already stopped sandbox (it is also how a failed start
 * is rolled back); `isRunning` and `ensureChronus` let the edge reconcile
 * after its own restart (the sandboxes outlive the edge).
 */
export interface Backend {
  readonly kind: BackendKind;
  /** Every kind this backend serves (a set of backends serves several); default `[kind]`. */
  readonly kinds?: readonly BackendKind[];
  start(rec: BackendSandbox, signal?: AbortSignal): Promise<StartedSandbox>;
  stop(rec: BackendSandbox): Promise<void>;
  isRunning(rec: BackendSandbox): Promise<boolean>;
  /** Restarts what serves the channel if it died; returns its new PID, or undefined if it was alive. */
  ensureChronus(rec: BackendSandbox): Promise<number | undefined>;
  /**
   * The sandbox's channel: the shared one, or with `dedicated` a new one the
   * caller owns and closes (its reads can be paused for back-pressure
   * without stalling the sandbox's other commands).
   */
  channel(rec: BackendSandbox, options?: { dedicated?: boolean }): Promise<SandboxChannel>;
  /** Whether the OOM killer struck the sandbox since this was last asked. */
  oomKilled?(rec: BackendSandbox): Promise<boolean>;
  /**
   * Called before every spawn in the sandbox (commands, sessions, files,
   * ports): undefined at once unless forks were refused in the sandbox since
   * the last call and it is at its pids limit; then it takes back leftovers
   * of finished commands and resolves with what it did, before the spawn
   * goes out (container/pids-relief.ts). Optional: without it only the
   * channel's own reclaim on a refused fork applies.
   */
  relieve?(rec: BackendSandbox): Promise<PidsLimitEvent> | undefined;
  /**
   * Pause (docs/adr/0012-pause-and-resume.md): stops every process of the
   * sandbox and gives its memory back to the host, keeping all of its state.
   * Idempotent: on a paused sandbox it freezes and reclaims again (how a
   * pause interrupted by an edge crash is finished). Optional with `resume`,
   * `isFrozen` and `memoryBytes`: the edge answers `unavailable` without them.
   */
  pause?(rec: BackendSandbox): Promise<PauseResult>;
  /**
   * Undoes `pause`; idempotent. Returns the command daemon's new PID when it
   * had to be restarted (it may have died while the sandbox was paused).
   */
  resume?(rec: BackendSandbox): Promise<{ chronusPid?: number | undefined }>;
  /** Whether the sandbox's processes are frozen now (reconcile compares this with the record). */
  isFrozen?(rec: BackendSandbox): Promise<boolean>;
  /** Host memory charged to the sandbox now; undefined when it has none (gone). */
  memoryBytes?(rec: BackendSandbox): Promise<number | undefined>;
  /**
   * The sandbox's screen (the full-VM backend): a PNG of it now, and keys
   * and pointer events sent to it. Optional: without them the edge answers
   * `unavailable` (the sandbox has no display).
   */
  screenshot?(rec: BackendSandbox): Promise<Buffer>;
  input?(rec: BackendSandbox, input: DisplayInput): Promise<void>;
  /**
   * The edge is shutting down: release every handle this process holds for
   * its sandboxes (connections to their command daemons, pipes to runtime
   * processes) so that nothing keeps the process alive. The sandboxes keep
   * running; the next edge adopts them. Nothing is called after it.
   */
  close?(): Promise<void>;
}
