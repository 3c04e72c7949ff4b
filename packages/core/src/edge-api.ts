import type {
  CommandResult,
  CommandSpec,
  EdgeStatus,
  NetworkPolicyPatch,
  SandboxEvent,
  SandboxInfo,
  SandboxSpec,
  SnapshotInfo,
  SnapshotRequest,
} from './types.js';
import { DsecError } from './errors.js';
import type { SandboxIoApi } from './sandbox-io.js';
import type { DisplayInput } from './display.js';
import type { FnCallOptions, FnCallRequest, FnCallResult } from './fncall.js';

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
  listSandboxes(
    filter: { projectIds?: string[]; includeEnded?: boolean },
    signal?: AbortSignal,
  ): Promise<SandboxInfo[]>;
  /** Stops and releases everything; stopping a stopped sandbox is a no-op. */
  stopSandbox(id: string, signal?: AbortSignal): Promise<void>;
  /** Runs one command to completion, streaming output to the callbacks as it comes. */
  runCommand(id: string, command: CommandSpec, options?: RunCommandOptions): Promise<CommandResult>;
  /**
   * Changes a running sandbox's egress policy; new connections follow it within
   * seconds, other sandboxes are untouched. Optional: edges without network
   * policy do not implement it (the apiserver answers `unavailable`).
   */
  updateNetwork?(id: string, patch: NetworkPolicyPatch, signal?: AbortSignal): Promise<SandboxInfo>;
  /**
   * Lifecycle (issue 11; optional like `updateNetwork`, the apiserver answers
   * `unavailable` for edges without them).
   *
   * `pauseSandbox` stops every process of the sandbox and gives its memory back
   * to the host, keeping processes, open files and the writable layer;
   * `resumeSandbox` undoes it. Pausing a paused sandbox and resuming a running
   * one are no-ops. A paused sandbox also resumes by itself on its next
   * command, session, file or port call. Both throw `sandbox_not_running` for a
   * stopped sandbox.
   */
  pauseSandbox?(id: string, signal?: AbortSignal): Promise<SandboxInfo>;
  resumeSandbox?(id: string, signal?: AbortSignal): Promise<SandboxInfo>;
  /** Moves the running TTL: the sandbox stops `ttlSeconds` from now (E2B's `setTimeout`). */
  setSandboxTimeout?(id: string, ttlSeconds: number, signal?: AbortSignal): Promise<SandboxInfo>;
  /**
   * Captures the writable layer as a new immutable layer after a brief freeze,
   * scrubbing `scrub` first, and names the result as an image `create`
   * accepts. `failed_precondition`-like refusals use `sandbox_not_running`.
   */
  snapshotSandbox?(
    id: string,
    req: EdgeSnapshotRequest,
    signal?: AbortSignal,
  ): Promise<SnapshotInfo>;
  /** Audit events of a sandbox, oldest first, after `afterId`. Optional like `updateNetwork`. */
  listEvents?(
    id: string,
    query: { afterId?: number | undefined; limit?: number | undefined },
    signal?: AbortSignal,
  ): Promise<SandboxEvent[]>;
  /**
   * The screen of a sandbox that has one (`vm`; issue 15): a PNG of it now,
   * and keys and pointer events sent to it. Optional; an edge answers
   * `unavailable` for a sandbox whose backend has no display.
   */
  screenshot?(id: string, signal?: AbortSignal): Promise<Buffer>;
  sendInput?(id: string, input: DisplayInput, signal?: AbortSignal): Promise<void>;
  /**
   * The in-sandbox interface: command log, background commands, sessions,
   * files, ports, terminals. Optional: the apiserver answers `unavailable`
   * for edges without it.
   */
  readonly io?: SandboxIoApi | undefined;
  /**
   * Runs one stateless function call in a warm pool (issue 14). Optional: the
   * apiserver sends calls only to edges that report `fncall` pools or the
   * `fncall` backend, and answers `unavailable` when none does.
   */
  fncall?(req: FnCallRequest, options: FnCallOptions): Promise<FnCallResult>;
  /**
   * The node's volumes (docs/volumes.md). Optional: the apiserver places no
   * volume on an edge without them.
   */
  readonly volumes?: EdgeVolumeApi | undefined;
}

/**
 * A node's volumes: each a project's named, size-limited store that outlives
 * sandboxes, mounted into the sandboxes that name it at create
 * (`SandboxSpec.volumes`). A volume is keyed by (project, name): the same
 * name in two projects is two volumes, and every call names the project.
 *
 *   create → ready → (mounted by 0..n sandboxes) → deleted
 *
 * `delete` is refused with `volume_in_use` while any sandbox of the node
 * mounts it or is being created with it, and a create that names a volume
 * being deleted fails with `volume_not_found`: the two never interleave.
 */
export interface EdgeVolumeApi {
  /** Makes the volume. `conflict` if the project has one of that name on this node. */
  create(
    req: { projectId: string; name: string; sizeMb: number },
    signal?: AbortSignal,
  ): Promise<EdgeVolumeInfo>;
  /** `volume_not_found` unless the project has it here. */
  get(projectId: string, name: string, signal?: AbortSignal): Promise<EdgeVolumeInfo>;
  /** The project's volumes on this node (or every project's, without one). */
  list(projectId: string | undefined, signal?: AbortSignal): Promise<EdgeVolumeInfo[]>;
  /** Removes it and its bytes. `volume_in_use` while mounted; a missing one is `volume_not_found`. */
  delete(projectId: string, name: string, signal?: AbortSignal): Promise<void>;
}

/** A volume as its edge knows it. */
export interface EdgeVolumeInfo {
  projectId: string;
  name: string;
  sizeMb: number;
  createdAt: string;
  /** Bytes in use on the volume's filesystem now. */
  usedBytes: number;
  /** Live sandboxes that mount it. */
  mountedBy: string[];
}

export interface CreateSandboxRequest {
  id: string;
  projectId: string;
  spec: SandboxSpec;
  requestId?: string | undefined;
  /**
   * The projects whose layers the sandbox may stack besides the platform's,
   * root first (`LayerView`, docs/adr/0019-layer-ownership.md): the
   * apiserver sends the view of the project, or of a scoped key's own
   * project. Absent: the sandbox's own project only.
   */
  layerView?: string[] | undefined;
}

/**
 * A snapshot as the apiserver asks an edge for it: the caller's request plus
 * what only the control plane knows. The snapshot layer always belongs to
 * the sandbox's project.
 */
export interface EdgeSnapshotRequest extends SnapshotRequest {
  /**
   * The sandbox's project's view (as `CreateSandboxRequest.layerView`): a
   * name it already sees is taken, since that layer would shadow the new
   * one. Absent: the sandbox's own project only.
   */
  layerView?: string[] | undefined;
  /**
   * The most bytes the layer may weigh: what the project's `imageBytes`
   * quota reserved for it. A bigger layer is `quota_exceeded` and is not
   * stored. Absent: no limit of the control plane's.
   */
  maxBytes?: number | undefined;
}

export interface RunCommandOptions {
  signal?: AbortSignal | undefined;
  /**
   * When set, the edge answers `sandbox_not_found` unless the sandbox belongs
   * to this project: the caller's authorisation and the exec in one call.
   */
  projectId?: string | undefined;
  onStdout?: ((chunk: Buffer) => void) | undefined;
  onStderr?: ((chunk: Buffer) => void) | undefined;
}

/** The in-sandbox interface of an edge, or `unavailable` naming the edge that has none. */
export function requireIo(edge: EdgeApi): SandboxIoApi {
  if (!edge.io) {
    throw new DsecError(
      'unavailable',
      `edge ${edge.edgeId} does not run commands, sessions or files`,
    );
  }
  return edge.io;
}

export type LifecycleMethod =
  'pauseSandbox' | 'resumeSandbox' | 'setSandboxTimeout' | 'snapshotSandbox';

/** One of the optional lifecycle methods of an edge, or `unavailable` naming the edge. */
export function requireLifecycle<M extends LifecycleMethod>(
  edge: EdgeApi,
  method: M,
): NonNullable<EdgeApi[M]> {
  const fn = edge[method];
  if (!fn) {
    throw new DsecError(
      'unavailable',
      `edge ${edge.edgeId} cannot ${method === 'snapshotSandbox' ? 'snapshot' : 'pause, resume or re-time'} sandboxes`,
    );
  }
  return fn;
}
