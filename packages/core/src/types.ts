/**
 * Domain types shared by every component. Units are in the names
 * (`memoryLimitMb`, `ttlSeconds`, `timeoutMs`).
 */
import type { FnCallGpuUnitStatus, FnCallPoolStatus } from './fncall.js';
import type { LayerInfo } from './images.js';

/** Which isolation mechanism runs a sandbox (paper 2.2). */
export type BackendKind = 'container' | 'microvm' | 'vm' | 'fncall';

export type SandboxState = 'creating' | 'running' | 'paused' | 'stopping' | 'stopped' | 'failed';

/** Named network rules from the catalogue (`{ pypi: true, npm: false }`, paper 2.1). */
export type NetworkRules = Record<string, boolean>;

/**
 * One explicit egress target: a domain (`example.com`, or `*.example.com` for
 * its subdomains) or a CIDR (`10.1.2.0/24`, `2001:db8::/32`), optionally only
 * on some ports (TCP and UDP). Without ports every port and protocol matches.
 */
export type NetworkTarget =
  { domain: string; ports?: number[] | undefined } | { cidr: string; ports?: number[] | undefined };

/** A live change of a sandbox's egress policy: rules are merged by name, lists replaced when given. */
export interface NetworkPolicyPatch {
  networkRules?: NetworkRules | undefined;
  allow?: NetworkTarget[] | undefined;
  deny?: NetworkTarget[] | undefined;
}

/** What the edge noticed a sandbox doing that a policy or limit stopped. */
export type SandboxEventKind =
  | 'network_denied'
  | 'dns_blocked'
  | 'output_truncated'
  | 'oom_killed'
  | 'pids_limit'
  | 'command_timeout';

export interface SandboxEvent {
  /** Increasing per edge; pass the last one seen as `afterId` to page. */
  id: number;
  sandboxId: string;
  time: string;
  kind: SandboxEventKind;
  message: string;
  /** How many times it happened since the previous event of the same key (rate-limited). */
  count: number;
  details: Record<string, unknown>;
}

/**
 * CPU QoS class of a sandbox (paper 5.2). `latency-sensitive` sandboxes run
 * at normal priority; `best-effort` ones run under `SCHED_IDLE` in a cgroup of
 * minimal CPU weight, so they only get cycles no latency-sensitive task wants.
 */
export type QosClass = 'latency-sensitive' | 'best-effort';

/** What a caller asks for when creating a sandbox. Validated before it reaches an edge. */
export interface SandboxSpec {
  backend: BackendKind;
  /** Base image layer, `name` or `name:version`. */
  image: string;
  /** Workspace layer stacked above the base. */
  workspace?: string | undefined;
  /** Toolkit layers, lowest priority first; the last one wins on conflicts. */
  toolkits: string[];
  /** Ceiling, not reservation: the cgroup limit. Admission goes by measured use (ADR 0007). */
  memoryLimitMb: number;
  /** Ceiling, not reservation: the CFS quota. */
  cpuCoresLimit: number;
  pidsLimit: number;
  /** Absent: `latency-sensitive` (records written before QoS classes existed have none). */
  qosClass?: QosClass | undefined;
  /**
   * Disk quota of the writable layer in MiB (bytes, and inodes at one per
   * 16 KiB): writes past it fail with ENOSPC inside the sandbox. Absent: the
   * writable layer shares the node's disk.
   */
  diskLimitMb?: number | undefined;
  /** The sandbox is stopped and reclaimed this long after creation. */
  ttlSeconds: number;
  networkRules: NetworkRules;
  /** Explicit egress allowed on top of `networkRules` (default none: egress is denied). */
  networkAllow?: NetworkTarget[] | undefined;
  /** Explicit egress denied; wins over every allow. */
  networkDeny?: NetworkTarget[] | undefined;
  /** User that commands run as unless they say otherwise (`root`, `1000`, `app`). */
  initUser: string;
  env: Record<string, string>;
  labels: Record<string, string>;
  /**
   * Labels an edge must carry to receive this sandbox (`{ pool: 'gpu',
   * hardware: 'h200' }`): every key must be present with exactly this value.
   * Absent or empty: any edge.
   */
  edgeSelector?: Record<string, string> | undefined;
  /**
   * The project's volumes mounted read-write into the sandbox at create
   * (docs/volumes.md): container sandboxes only, each at an absolute path
   * outside `/proc`, `/dev` and `/sys`. The sandbox is placed on the edge
   * that holds the volumes. Absent or empty: none.
   */
  volumes?: VolumeMount[] | undefined;
}

/** One volume mounted into a sandbox. */
export interface VolumeMount {
  /** The volume's name in the sandbox's project (`VOLUME_NAME_RE`). */
  name: string;
  /** Where it appears inside the sandbox: absolute, normalised. */
  path: string;
}

/** A project's named volume as the API shows it (docs/volumes.md). */
export interface VolumeInfo {
  name: string;
  projectId: string;
  /** Its size limit: writes past it fail with ENOSPC inside the sandbox. */
  sizeMb: number;
  /** The edge that holds its bytes; sandboxes that mount it are placed there. */
  edgeId: string;
  /** `creating` until its edge has made it; `ready` after. */
  state: 'creating' | 'ready';
  createdAt: string;
  /** Bytes in use now, when the edge was asked (`GET /v1/volumes/NAME`). */
  usedBytes?: number | undefined;
  /** Sandboxes on its edge that mount it now, when the edge was asked. */
  mountedBy?: string[] | undefined;
}

export interface SandboxInfo {
  id: string;
  edgeId: string;
  projectId: string;
  state: SandboxState;
  spec: SandboxSpec;
  createdAt: string;
  /** When the TTL stops it (while running; `setSandboxTimeout` moves it). */
  expiresAt: string;
  /** Why it failed or stopped, when it did. */
  reason?: string | undefined;
  /** Since when it is paused (state `paused`). */
  pausedAt?: string | undefined;
  /** When a paused sandbox is stopped if nothing resumes it (the paused TTL, a separate limit). */
  pausedExpiresAt?: string | undefined;
  /** Host memory charged to the sandbox's cgroup now (filled by `getSandbox`, not by lists). */
  memoryBytes?: number | undefined;
}

/** What `snapshotSandbox` asks for (paper 6.1, pack_diff). */
export interface SnapshotRequest {
  /** Name of the new layer and image (`name` or `name:version`). */
  name: string;
  /**
   * Paths (absolute inside the sandbox; a trailing `/**` means everything
   * under a directory) removed from the captured layer: build residue,
   * reference answers. Recorded in the layer's metadata.
   */
  scrub?: string[] | undefined;
}

/** A snapshot: the sandbox's writable layer captured as an immutable layer. */
export interface SnapshotInfo {
  /** What `create` accepts as `image` to start from this state (base + layers + the new one). */
  image: string;
  /** The new layer, in the edge's image store. */
  layer: LayerInfo;
  /** The layers below it, lowest first: the sandbox's base, workspace and toolkits. */
  parents: string[];
  scrub: string[];
  /** How long the sandbox's processes were frozen. */
  freezeMs: number;
  /** How long the whole snapshot took. */
  totalMs: number;
}

/** One command to run in a sandbox. */
export interface CommandSpec {
  /** Program and arguments; exclusive with `shell`. */
  argv?: string[] | undefined;
  /** A shell line, run by the platform's own shell (never the sandbox's /bin/sh). */
  shell?: string | undefined;
  env?: Record<string, string> | undefined;
  cwd?: string | undefined;
  user?: string | undefined;
  /** Whole stdin, sent then closed. */
  stdin?: string | undefined;
  timeoutMs?: number | undefined;
  /** Cap on captured bytes per stream; head and tail are kept. */
  maxOutputBytes?: number | undefined;
}

/** How a command ended. Exit codes come from the kernel's wait status. */
export type CommandOutcome = 'exited' | 'signaled' | 'timeout' | 'killed' | 'oom';

export interface CommandResult {
  commandId: string;
  exitCode: number;
  /** Set when the process died of a signal. */
  signal?: string | undefined;
  outcome: CommandOutcome;
  stdout: string;
  stderr: string;
  /** True when either stream went past the cap and its middle was dropped. */
  truncated: boolean;
  stdoutBytes: number;
  stderrBytes: number;
  durationMs: number;
  /** Why the platform ended or lost the command, when it did (e.g. the edge restarted under it). */
  reason?: string | undefined;
}

/** What an edge reports to the watcher. */
export interface EdgeStatus {
  edgeId: string;
  url: string;
  healthy: boolean;
  backends: BackendKind[];
  /**
   * What placement may still put here. `memoryMb` and `cpuCores` bound the
   * sum of requested ceilings (the overcommit ratios); `sandboxes` is the hard
   * cap lowered to what the measured headroom still allows (0 room while the
   * edge would refuse on measured pressure).
   */
  capacity: { memoryMb: number; cpuCores: number; sandboxes: number };
  /** Requested ceilings of the live sandboxes, and their count. */
  used: { memoryMb: number; cpuCores: number; sandboxes: number };
  sandboxesByProject: Record<string, number>;
  labels: Record<string, string>;
  /**
   * The layers and images in this edge's image store as layer keys
   * (`name:version` for the platform's, `project/name:version` for a
   * project's); reported by edges that may take burst work (placement sends
   * a burst edge only requests whose every layer is listed here, the
   * platform's or in a namespace of the request's layer view).
   */
  layers?: string[] | undefined;
  /** The edge's last measurement of the node (absent from edges that do not measure). */
  pressure?: NodePressure | undefined;
  /** Warm FnCall pools on this edge (absent on edges without FnCall). */
  fncall?: FnCallPoolStatus[] | undefined;
  /** GPU units FnCall workers may be given, and their use (absent on edges without GPUs). */
  gpus?: FnCallGpuUnitStatus[] | undefined;
  /**
   * Set by `dsec edge cordon`: placement sends this edge nothing new. The
   * apiserver's view (`GET /v1/edges`), never an edge's own report.
   */
  cordoned?: boolean | undefined;
}

/** An edge's measurement of its node, as admission sees it (ADR 0007). */
export interface NodePressure {
  /** When it was measured (ISO time). */
  measuredAt: string;
  memoryTotalMb: number;
  memoryAvailableMb: number;
  /** Memory charged to the sandboxes' cgroups. */
  sandboxMemoryMb: number;
  /** PSI `some avg60` of the CPU (or a load-average estimate where the kernel has no PSI). */
  cpuPressurePercent: number;
  /** The sandboxes' CPU use in percent of all cores, smoothed over about 10 s. */
  sandboxCpuPercent: number;
  threads: number;
  threadsLimit: number;
  diskFreeMb: number;
  /** The check a new sandbox would fail now, if any. */
  refusing?: AdmissionRefusal | undefined;
}

/** Why an edge refuses a sandbox (`capacity_exhausted` details carry the same fields). */
export interface AdmissionRefusal {
  /** The resource that ran out. */
  resource: 'sandboxes' | 'memory' | 'cpu' | 'pids' | 'disk';
  /** Which measure of it: `requested_mb`, `available_mb`, `charged_mb`, `pressure_percent`, … */
  measure: string;
  /** Its value with this sandbox admitted (for `available_mb`/`free_mb`: what would be left). */
  current: number;
  limit: number;
}
