import { readFileSync } from 'node:fs';
import { availableParallelism } from 'node:os';
import { DsecError, randomId, toDsecError } from '@dsec/core';
import type {
  BackendKind,
  CommandResult,
  FnCallGpuRequest,
  FnCallOptions,
  FnCallPoolStatus,
  FnCallRequest,
  FnCallResult,
  NetworkRules,
  NetworkTarget,
  SandboxSpec,
} from '@dsec/core';
import type { EventLog } from '../events/event-log.js';
import { normalizeGpuRequest } from '../gpu/allocator.js';
import type { EdgeGpus } from '../gpu/edge-gpus.js';
import type { EdgeStartOptions } from '../edge.js';
import { DEFAULT_NETWORK_CATALOGUE } from '../network/policy.js';
import { DEFAULT_FNCALL_RUNTIMES, validateRuntimes, type FnCallRuntime } from './runtimes.js';
import { SANDBOXFUSION_RUNTIMES } from './sandboxfusion.js';
import { workersToRetire, workersToStart, type PoolCounts, type PoolSizing } from './sizing.js';
import { Worker, type FnCallHost, type WorkerRun, type ZygoteConfig } from './worker.js';

/** The project worker sandboxes belong to; the edge hides it from sandbox lists. */
export const FNCALL_PROJECT = '_fncall';
/** Labels on worker sandboxes. */
export const FNCALL_RUNTIME_LABEL = 'dsec.fncall/runtime';
export const FNCALL_NETWORK_LABEL = 'dsec.fncall/network';
/** On GPU workers: the pool's GPU request (`exclusivex1`, `sharedx1:H200`). */
export const FNCALL_GPU_LABEL = 'dsec.fncall/gpu';

export const FNCALL_DEFAULT_TIMEOUT_MS = 10_000;
export const FNCALL_MAX_TIMEOUT_MS = 300_000;
const DEFAULT_MAX_OUTPUT_BYTES = 1024 * 1024;
const MAX_OUTPUT_BYTES = 16 * 1024 * 1024;
/** The zygote, its page cache and chronus's share, above the largest call. */
const WORKER_OVERHEAD_MB = 128;

export interface FnCallPoolsOptions {
  /** Runtimes beside (or, by name, instead of) python, node and bash. */
  runtimes?: FnCallRuntime[] | undefined;
  /** Pool sizing (sizing.ts); `min` is the warm size of every pool. */
  sizing?: Partial<PoolSizing> | undefined;
  /** Warm size per runtime (`{ python: 4 }`), over `sizing.min`; those pools start at once. */
  warm?: Record<string, number> | undefined;
  /** CPU ceiling of each worker sandbox (default 1 core). */
  cpuCoresPerWorker?: number | undefined;
  /** Processes a call may have at once (RLIMIT_NPROC of the call uid; default 128). */
  nprocPerCall?: number | undefined;
  /** Largest file a call may write (RLIMIT_FSIZE; default 256 MiB). */
  fileSizeLimitMb?: number | undefined;
  /** The uid (and gid) calls run as inside workers (default 60000; never 0). */
  callUid?: number | undefined;
  /** Egress of `network: true` pools (default: every rule of the edge's catalogue). */
  network?: { networkRules?: NetworkRules; networkAllow?: NetworkTarget[] } | undefined;
  /** How long a call may wait for a worker (default 60 s); then `capacity_exhausted`. */
  queueTimeoutMs?: number | undefined;
  /** A worker is replaced after this many calls (default 10,000). */
  maxCallsPerWorker?: number | undefined;
  /**
   * Workers whose zygote may watch its scratch places with inotify (and so
   * skip the clean-up after a call that left them alone). Default: a quarter
   * of the host's `fs.inotify.max_user_instances` (inotifyBudget).
   */
  inotifyWorkers?: number | undefined;
}

/** The edge's side of the pools: `create` also takes what only the edge adds (a worker's GPUs). */
export interface FnCallPoolsHost extends FnCallHost {
  create(
    id: string,
    spec: SandboxSpec,
    signal?: AbortSignal,
    start?: EdgeStartOptions,
  ): Promise<void>;
}

/** A GPU request with its defaults: what GPU pools are keyed by. */
export type PoolGpu = { mode: 'shared' | 'exclusive'; count: number; model?: string | undefined };

export interface FnCallPoolsDeps {
  edgeId: string;
  backendKind: BackendKind;
  host: FnCallPoolsHost;
  /** The node's GPUs (docs/gpu.md); absent: calls with `gpu` answer `unavailable`. */
  gpus?: EdgeGpus | undefined;
  events?: EventLog | undefined;
  /** Names of the edge's network catalogue (the default egress of `network: true` pools). */
  networkCatalogue?: readonly string[] | undefined;
}

/**
 * A worker runs one call at a time, so more workers than a few per core only
 * add memory and start-up work for CPU-bound calls; calls that wait (sleep,
 * I/O) want more, which `sizing.max` gives. Two per core keep a core busy
 * while another worker's answer travels back; at four per core the zygotes
 * contended (about 25 % more CPU per call, 2 cores, `dsec bench fncall`).
 */
const DEFAULT_SIZING: PoolSizing = {
  min: 1,
  max: Math.max(4, 2 * availableParallelism()),
  spare: 1,
  maxStarting: 2,
  idleRetireMs: 60_000,
};

interface Waiter {
  resolve: (w: Worker) => void;
  reject: (e: unknown) => void;
  timer: NodeJS.Timeout;
  signal: AbortSignal | undefined;
  onAbort: () => void;
}

/** One runtime's warm pool on one network setting. */
class Pool {
  readonly idle: Worker[] = [];
  readonly busy = new Set<Worker>();
  starting = 0;
  readonly queue: Waiter[] = [];
  #lastFailure: { atMs: number; err: unknown } | undefined;
  #retry: NodeJS.Timeout | undefined;
  #closed = false;
  readonly #starts = new Set<Promise<void>>();

  constructor(
    readonly runtime: FnCallRuntime,
    readonly network: boolean,
    readonly sizing: PoolSizing,
    readonly owner: FnCallPools,
    readonly gpu?: PoolGpu | undefined,
  ) {}

  counts(): PoolCounts {
    return {
      idle: this.idle.length,
      busy: this.busy.size,
      starting: this.starting,
      queued: this.queue.length,
    };
  }

  status(): FnCallPoolStatus {
    return {
      language: this.runtime.name,
      network: this.network,
      idle: this.idle.length,
      busy: this.busy.size,
      starting: this.starting,
      max: this.sizing.max,
      ...(this.gpu ? { gpu: { ...this.gpu } } : {}),
    };
  }

  acquire(signal: AbortSignal | undefined, queueTimeoutMs: number): Promise<Worker> {
    if (this.#closed) return Promise.reject(new DsecError('unavailable', 'the edge is closing'));
    const w = this.idle.pop();
    if (w) {
      this.busy.add(w);
      this.fill();
      return Promise.resolve(w);
    }
    return new Promise<Worker>((resolve, reject) => {
      const waiter: Waiter = {
        resolve,
        reject,
        signal,
        timer: setTimeout(() => {
          this.#dequeue(waiter);
          reject(
            new DsecError(
              'capacity_exhausted',
              `no ${this.runtime.name} worker was free within ${queueTimeoutMs} ms`,
            ),
          );
        }, queueTimeoutMs),
        onAbort: () => {
          this.#dequeue(waiter);
          reject(new DsecError('aborted', 'the call was aborted while it waited for a worker'));
        },
      };
      signal?.addEventListener('abort', waiter.onAbort, { once: true });
      this.queue.push(waiter);
      this.fill();
    });
  }

  #dequeue(w: Waiter): void {
    const i = this.queue.indexOf(w);
    if (i !== -1) this.queue.splice(i, 1);
    clearTimeout(w.timer);
    w.signal?.removeEventListener('abort', w.onAbort);
  }

  /** Back after a call: to the next waiting call, to the idle list, or retired. */
  release(w: Worker, retire: boolean): void {
    this.busy.delete(w);
    if (retire || w.dead || this.#closed || w.calls >= this.owner.maxCallsPerWorker) {
      void this.owner.retire(w);
    } else {
      this.#handOver(w);
    }
    this.fill();
  }

  #handOver(w: Worker): void {
    const next = this.queue[0];
    if (next) {
      this.#dequeue(next);
      this.busy.add(w);
      next.resolve(w);
    } else {
      w.idleSinceMs = Date.now();
      this.idle.push(w);
    }
  }

  /** Starts workers up to the wanted size (sizing.ts). */
  fill(): void {
    if (this.#closed) return;
    // After a failed start, wait a little before the next: a refusing edge is not hammered.
    if (this.#lastFailure && Date.now() - this.#lastFailure.atMs < 1000) {
      this.#retry ??= setTimeout(() => {
        this.#retry = undefined;
        this.fill();
      }, 1000).unref();
      return;
    }
    for (let n = workersToStart(this.counts(), this.sizing); n > 0; n--) this.#startOne();
  }

  #startOne(): void {
    this.starting++;
    const p = this.owner
      .startWorker(this.runtime, this.network, this.gpu)
      .then(
        (w) => {
          this.#lastFailure = undefined;
          if (this.#closed) {
            void this.owner.retire(w);
            return;
          }
          w.onDeath = (dead) => this.#forget(dead);
          this.#handOver(w);
        },
        (err: unknown) => {
          this.#lastFailure = { atMs: Date.now(), err };
          this.owner.log('fncall worker start failed', {
            runtime: this.runtime.name,
            err: String(err),
          });
          // With no worker at all, waiting calls would wait for nothing: they fail now.
          if (this.idle.length + this.busy.size + this.starting - 1 === 0) {
            for (const waiter of [...this.queue]) {
              this.#dequeue(waiter);
              waiter.reject(toDsecError(err));
            }
          }
        },
      )
      .finally(() => {
        this.starting--;
        this.#starts.delete(p);
        this.fill();
      });
    this.#starts.add(p);
  }

  /** A worker died on its own (TTL, stopped, killed): it leaves the pool; the next fill replaces it. */
  #forget(w: Worker): void {
    const i = this.idle.indexOf(w);
    if (i !== -1) {
      this.idle.splice(i, 1);
      void this.owner.retire(w);
      this.fill();
    }
    // A busy one is released by its call, which sees the death.
  }

  sweep(nowMs: number): void {
    for (const w of workersToRetire(this.idle, this.counts(), this.sizing, nowMs)) {
      this.idle.splice(this.idle.indexOf(w), 1);
      void this.owner.retire(w);
    }
    this.fill();
  }

  async close(): Promise<void> {
    this.#closed = true;
    clearTimeout(this.#retry);
    for (const waiter of [...this.queue]) {
      this.#dequeue(waiter);
      waiter.reject(new DsecError('unavailable', 'the edge is closing'));
    }
    await Promise.allSettled([...this.#starts]);
    const all = [...this.idle, ...this.busy];
    this.idle.length = 0;
    this.busy.clear();
    await Promise.allSettled(all.map((w) => this.owner.retire(w)));
  }
}

/**
 * The edge's FnCall engine (issue 14, docs/adr/0014-fncall.md): a warm pool
 * per (runtime, network) of worker sandboxes, each running one call at a
 * time through its zygote.
 */
export class FnCallPools {
  readonly #deps: FnCallPoolsDeps;
  readonly #o: FnCallPoolsOptions;
  readonly #runtimes: Map<string, FnCallRuntime>;
  readonly #sizing: PoolSizing;
  readonly #pools = new Map<string, Pool>();
  readonly #workers = new Set<string>();
  readonly #retiring = new Map<string, Promise<void>>();
  readonly #sweeper: NodeJS.Timeout;
  /** Workers started with an inotify watch, and how many may be. */
  readonly #watching = new Set<string>();
  readonly #inotifyWorkers: number;
  readonly maxCallsPerWorker: number;
  #closed = false;

  constructor(deps: FnCallPoolsDeps, options: FnCallPoolsOptions = {}) {
    this.#deps = deps;
    this.#o = options;
    // The SandboxFusion runtimes are defaults too: a pool exists only once a call asks for it.
    const byName = new Map(
      [...DEFAULT_FNCALL_RUNTIMES, ...SANDBOXFUSION_RUNTIMES].map((r) => [r.name, r]),
    );
    for (const r of options.runtimes ?? []) byName.set(r.name, r);
    this.#runtimes = validateRuntimes([...byName.values()]);
    this.#sizing = { ...DEFAULT_SIZING, ...options.sizing };
    this.maxCallsPerWorker = options.maxCallsPerWorker ?? 10_000;
    this.#inotifyWorkers = options.inotifyWorkers ?? inotifyBudget();
    const uid = options.callUid ?? 60_000;
    if (!(Number.isInteger(uid) && uid > 0 && uid < 65_534)) {
      throw new DsecError('invalid_argument', 'fncall.callUid must be in 1..65533', {
        field: 'fncall.callUid',
      });
    }
    this.#sweeper = setInterval(() => {
      for (const p of this.#pools.values()) p.sweep(Date.now());
    }, 5_000);
    this.#sweeper.unref();
  }

  /** Starts the pools named in `warm` (each to its warm size). */
  prewarm(): void {
    for (const name of Object.keys(this.#o.warm ?? {}))
      if (this.#runtimes.has(name)) this.#pool(name, false);
  }

  /** Whether a sandbox is one of this engine's workers (the edge never idles or lists them). */
  owns(sandboxId: string): boolean {
    return this.#workers.has(sandboxId);
  }

  log(msg: string, fields?: Record<string, unknown>): void {
    this.#deps.host.log?.(msg, fields);
  }

  status(): FnCallPoolStatus[] {
    const out: FnCallPoolStatus[] = [];
    for (const r of this.#runtimes.values()) {
      for (const network of [false, true]) {
        const pool = this.#pools.get(poolKey(r.name, network));
        if (pool) out.push(pool.status());
        else if (!network)
          out.push({
            language: r.name,
            network,
            idle: 0,
            busy: 0,
            starting: 0,
            max: this.#sizing.max,
          });
      }
    }
    // GPU pools exist only once asked for.
    for (const pool of this.#pools.values()) if (pool.gpu) out.push(pool.status());
    return out;
  }

  #pool(language: string, network: boolean, gpu?: PoolGpu): Pool {
    const key = poolKey(language, network, gpu);
    let pool = this.#pools.get(key);
    if (!pool) {
      const runtime = this.#runtimes.get(language)!;
      const warm = this.#o.warm?.[language];
      const sizing = gpu
        ? // An idle GPU worker holds its units: none is kept warm and no spare started.
          { ...this.#sizing, min: 0, spare: 0 }
        : warm !== undefined && !network
          ? { ...this.#sizing, min: Math.max(this.#sizing.min, warm) }
          : this.#sizing;
      pool = new Pool(
        runtime,
        network,
        { ...sizing, max: Math.max(sizing.max, sizing.min) },
        this,
        gpu,
      );
      this.#pools.set(key, pool);
      pool.fill();
    }
    return pool;
  }

  async call(req: FnCallRequest, options: FnCallOptions): Promise<FnCallResult> {
    if (this.#closed) throw new DsecError('unavailable', 'the edge is closing');
    const runtime = this.#runtimes.get(req.language);
    if (!runtime) {
      throw new DsecError(
        'invalid_argument',
        `no runtime ${JSON.stringify(req.language)} on this edge (${[...this.#runtimes.keys()].join(', ')})`,
        { field: 'language' },
      );
    }
    const call = this.#checked(req, runtime);
    const pool = this.#pool(runtime.name, req.network === true, this.#checkedGpu(req.gpu));
    const queueTimeoutMs = this.#o.queueTimeoutMs ?? 60_000;
    for (let attempt = 1; ; attempt++) {
      const w = await pool.acquire(options.signal, queueTimeoutMs);
      let run: WorkerRun;
      const onAbort = () => void w.retire();
      options.signal?.addEventListener('abort', onAbort, { once: true });
      try {
        run = await w.run(call);
      } finally {
        options.signal?.removeEventListener('abort', onAbort);
      }
      if (options.signal?.aborted) {
        pool.release(w, true);
        throw new DsecError('aborted', 'the call was aborted');
      }
      if (run.kind === 'died') {
        pool.release(w, true);
        // Never started: nothing of the call ran, so it may go to another worker, once.
        if (!run.started && attempt === 1) continue;
        const oom = await this.#deps.host.oomKilled(w.id).catch(() => false);
        const result: FnCallResult = {
          exitCode: -1,
          stdout: '',
          stderr: '',
          truncated: false,
          outcome: oom ? 'oom' : 'runtime_error',
          durationMs: 0,
          reason: `${run.reason}; the worker was replaced`,
          edgeId: this.#deps.edgeId,
        };
        this.#recordEvents(w.id, result, call.nproc, 0, 0, 0);
        return result;
      }
      const d = run.done;
      pool.release(w, d.retire);
      let outcome = d.outcome;
      // The cgroup's OOM killer sends SIGKILL; ask it only then (as the command path does).
      if (
        d.signal === 'SIGKILL' &&
        outcome === 'signaled' &&
        (await this.#deps.host.oomKilled(w.id).catch(() => false))
      )
        outcome = 'oom';
      // A runtime that reports running out of memory in words (node aborts, or throws).
      if (ranOutOfMemory(pool.runtime, outcome, d.exitCode, d.stderr)) outcome = 'oom';
      const result: FnCallResult = {
        exitCode: d.exitCode,
        stdout: d.stdout,
        stderr: d.stderr,
        truncated: d.truncated,
        outcome,
        durationMs: Math.round(d.durationMs),
        ...(d.reason !== undefined ? { reason: d.reason } : {}),
        edgeId: this.#deps.edgeId,
      };
      this.#recordEvents(w.id, result, call.nproc, d.stdoutBytes, d.stderrBytes, d.leftover);
      return result;
    }
  }

  /** The audit events the sandbox command path records, against the worker sandbox. */
  #recordEvents(
    workerId: string,
    r: FnCallResult,
    nproc: number,
    stdoutBytes: number,
    stderrBytes: number,
    leftover: number,
  ): void {
    const events = this.#deps.events;
    if (!events) return;
    const commandEvent = r.truncated || r.outcome === 'oom' || r.outcome === 'timeout';
    const pidsEvent = r.outcome === 'pids_limit';
    // Most calls record nothing: the ID (random bytes) is drawn only for an event.
    if (!commandEvent && !pidsEvent) return;
    const commandId = randomId('fncall', 8);
    if (commandEvent) {
      const asCommand: CommandResult = {
        commandId,
        exitCode: r.exitCode,
        outcome: r.outcome === 'oom' ? 'oom' : r.outcome === 'timeout' ? 'timeout' : 'exited',
        stdout: '',
        stderr: '',
        truncated: r.truncated,
        stdoutBytes,
        stderrBytes,
        durationMs: r.durationMs,
      };
      events.recordCommand(workerId, asCommand);
    }
    if (pidsEvent) {
      events.record(
        workerId,
        'pids_limit',
        `a function call reached its pids limit (${nproc}); its ${leftover} processes were killed`,
        { limit: 'pids', max: nproc, commandId, reclaimedProcesses: leftover },
        'fncall',
      );
    }
  }

  #checked(req: FnCallRequest, runtime: FnCallRuntime) {
    const bad = (field: string, msg: string): never => {
      throw new DsecError('invalid_argument', `${field}: ${msg}`, { field });
    };
    if (typeof req.code !== 'string') bad('code', 'must be a string');
    const timeoutMs = req.timeoutMs ?? FNCALL_DEFAULT_TIMEOUT_MS;
    if (!(Number.isInteger(timeoutMs) && timeoutMs >= 1 && timeoutMs <= FNCALL_MAX_TIMEOUT_MS))
      bad('timeoutMs', `must be an integer in 1..${FNCALL_MAX_TIMEOUT_MS}`);
    const memoryMb = req.memoryMb ?? runtime.defaultMemoryMb;
    if (!(Number.isInteger(memoryMb) && memoryMb >= 16 && memoryMb <= runtime.maxMemoryMb))
      bad('memoryMb', `must be an integer in 16..${runtime.maxMemoryMb} for ${runtime.name}`);
    const maxOutputBytes = req.maxOutputBytes ?? DEFAULT_MAX_OUTPUT_BYTES;
    if (!(
      Number.isInteger(maxOutputBytes) &&
      maxOutputBytes >= 0 &&
      maxOutputBytes <= MAX_OUTPUT_BYTES
    ))
      bad('maxOutputBytes', `must be an integer in 0..${MAX_OUTPUT_BYTES}`);
    for (const [i, a] of (req.args ?? []).entries())
      if (typeof a !== 'string' || a.includes('\0'))
        bad(`args.${i}`, 'must be a string without NUL');
    for (const [k, v] of Object.entries(req.env ?? {})) {
      if (!/^[A-Za-z_][A-Za-z0-9_]*$/.test(k)) bad(`env.${k}`, 'bad variable name');
      if (typeof v !== 'string' || v.includes('\0'))
        bad(`env.${k}`, 'must be a string without NUL');
    }
    for (const [path, text] of Object.entries(req.files ?? {})) {
      const parts = path.split('/');
      if (
        path.startsWith('/') ||
        parts.some((p) => p === '' || p === '.' || p === '..') ||
        path.length > 255
      )
        bad(`files.${path}`, 'must be a relative path inside the work dir');
      if (path === runtime.entry) bad(`files.${path}`, 'is the program file');
      if (typeof text !== 'string') bad(`files.${path}`, 'must be text');
    }
    return {
      code: req.code,
      stdin: req.stdin ?? '',
      files: req.files ?? {},
      args: req.args ?? [],
      env: req.env ?? {},
      timeoutMs,
      memoryMb,
      maxOutputBytes,
      nproc: this.#o.nprocPerCall ?? 128,
      fsizeMb: this.#o.fileSizeLimitMb ?? 256,
    };
  }

  /** The pool key's GPU part: checked, with defaults; undefined for a call without `gpu`. */
  #checkedGpu(gpu: FnCallGpuRequest | undefined): PoolGpu | undefined {
    if (gpu === undefined) return undefined;
    if (!this.#deps.gpus || this.#deps.backendKind !== 'container')
      throw new DsecError('unavailable', `edge ${this.#deps.edgeId} has no GPUs for calls`, {
        field: 'gpu',
      });
    const { mode, count, model } = normalizeGpuRequest(gpu);
    return { mode, count, ...(model !== undefined ? { model } : {}) };
  }

  /**
   * Creates one worker sandbox for a runtime and starts its zygote. A GPU
   * worker's units are assigned first (`capacity_exhausted` when they are
   * taken: the pool's waiting calls then wait for a busy worker, or fail
   * when the pool has none) and released when its sandbox is gone.
   */
  async startWorker(runtime: FnCallRuntime, network: boolean, gpu?: PoolGpu): Promise<Worker> {
    const id = randomId('fn', 9).replace(/[-_]/g, 'x').toLowerCase();
    const gpus = this.#deps.gpus;
    const fragment = gpu && gpus?.assign(id, gpu);
    const nproc = this.#o.nprocPerCall ?? 128;
    const networkRules: NetworkRules = network
      ? (this.#o.network?.networkRules ??
        Object.fromEntries(
          (this.#deps.networkCatalogue ?? Object.keys(DEFAULT_NETWORK_CATALOGUE)).map((n) => [
            n,
            true,
          ]),
        ))
      : {};
    const spec: SandboxSpec = {
      backend: this.#deps.backendKind,
      image: runtime.image,
      toolkits: runtime.toolkits ?? [],
      memoryLimitMb: runtime.maxMemoryMb + WORKER_OVERHEAD_MB,
      cpuCoresLimit: this.#o.cpuCoresPerWorker ?? 1,
      // The call uid's NPROC stops a fork bomb first; the zygote and chronus keep room to clean up.
      pidsLimit: nproc + 64,
      ttlSeconds: 24 * 3600,
      networkRules,
      ...(network && this.#o.network?.networkAllow
        ? { networkAllow: this.#o.network.networkAllow }
        : {}),
      initUser: 'root',
      env: {},
      labels: {
        [FNCALL_RUNTIME_LABEL]: runtime.name,
        [FNCALL_NETWORK_LABEL]: String(network),
        ...(gpu ? { [FNCALL_GPU_LABEL]: gpusLabel(gpu) } : {}),
      },
    };
    const config: ZygoteConfig = {
      uid: this.#o.callUid ?? 60_000,
      mode: runtime.mode,
      command: runtime.command ?? [],
      entry: runtime.entry,
      // Every call's environment starts from this: the GPU's UUIDs and library path included.
      env: { ...runtime.env, ...fragment?.env },
      memoryMb: runtime.defaultMemoryMb,
      nproc,
      fsizeMb: this.#o.fileSizeLimitMb ?? 256,
      preload: runtime.preload ?? [],
      watchScratch: this.#watching.size < this.#inotifyWorkers,
    };
    if (config.watchScratch) this.#watching.add(id);
    const host = this.#deps.host;
    // The worker's own create passes the GPU fragment to the backend.
    const workerHost: FnCallHost = fragment
      ? {
          create: (i, s, signal) => host.create(i, s, signal, { gpu: fragment }),
          stop: (i) => host.stop(i),
          channel: (i) => host.channel(i),
          oomKilled: (i) => host.oomKilled(i),
          log: host.log,
        }
      : host;
    this.#workers.add(id);
    try {
      return await Worker.start(workerHost, id, spec, config);
    } catch (err) {
      this.#workers.delete(id);
      this.#watching.delete(id);
      // Worker.start stopped the sandbox: nothing uses the units any more.
      gpus?.release(id);
      throw err;
    }
  }

  /** Stops a worker's sandbox (in the background; `close` waits for every one). Once per worker. */
  retire(w: Worker): Promise<void> {
    const already = this.#retiring.get(w.id);
    if (already) return already;
    const p = w
      .retire()
      .catch((err: unknown) =>
        this.log('fncall worker stop failed', { id: w.id, err: String(err) }),
      )
      .finally(() => {
        this.#workers.delete(w.id);
        this.#watching.delete(w.id);
        this.#retiring.delete(w.id);
        // After the stop (even a failed one: the sandbox is then being torn down
        // by the edge's own stop path, which a retry of the stop joins).
        this.#deps.gpus?.release(w.id);
      });
    this.#retiring.set(w.id, p);
    return p;
  }

  /** Fails waiting calls, stops every worker sandbox and waits for them to be gone. */
  async close(): Promise<void> {
    this.#closed = true;
    clearInterval(this.#sweeper);
    await Promise.allSettled([...this.#pools.values()].map((p) => p.close()));
    await Promise.allSettled([...this.#retiring.values()]);
  }
}

/**
 * Whether a call that failed (a non-zero exit, or a signal) said on stderr
 * that it ran out of memory in one of its runtime's `oomMessages`: the
 * python fast path reports a `MemoryError` itself, an exec runtime only in
 * words (node aborts on a full heap, throws when a buffer cannot be had).
 */
export function ranOutOfMemory(
  runtime: Pick<FnCallRuntime, 'oomMessages'>,
  outcome: FnCallResult['outcome'],
  exitCode: number,
  stderr: string,
): boolean {
  if (!runtime.oomMessages || exitCode === 0) return false;
  if (outcome !== 'ok' && outcome !== 'signaled') return false;
  return runtime.oomMessages.some((m) => stderr.includes(m));
}

/**
 * How many workers may hold an inotify instance. Sandboxes' user namespaces
 * are created by the host's root, so every inotify instance made in any
 * sandbox also counts against root's `fs.inotify.max_user_instances` (128 by
 * default), which root's own daemons and users' sandboxes (file watchers)
 * share: workers take at most a quarter of it. `dsec doctor` says when the
 * limit is low for a sandbox node.
 */
export function inotifyBudget(path = '/proc/sys/fs/inotify/max_user_instances'): number {
  try {
    return Math.floor(Number.parseInt(readFileSync(path, 'utf8'), 10) / 4) || 0;
  } catch {
    return 0;
  }
}

/** Pools are keyed by runtime, network, and the GPU request (mode, count, model). */
export function poolKey(language: string, network: boolean, gpu?: PoolGpu): string {
  const base = `${language}/${network ? 'net' : 'nonet'}`;
  return gpu ? `${base}/gpu:${gpusLabel(gpu)}` : base;
}

/** `exclusive×1`, `shared×2:H200`: a GPU request as pool keys and worker labels name it. */
function gpusLabel(gpu: PoolGpu): string {
  return `${gpu.mode}x${gpu.count}${gpu.model !== undefined ? `:${gpu.model}` : ''}`;
}
