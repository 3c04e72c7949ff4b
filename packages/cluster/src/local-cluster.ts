/**
 * `dsec up --edges N`: a whole cluster on this machine, for trying one with
 * one command. The apiserver runs in this process; the watcher and N edges
 * are child processes started from generated config files (the same files an
 * operator would write, under `stateDir/cluster/`). Each edge has its own
 * state dir, cgroup parent, port and sandbox address range (claimed
 * automatically, ADR 0005). The control database is the same embedded SQLite
 * file a single-node `dsec up` uses, so projects and keys carry over.
 *
 * Children exit when this process does (they watch their stdin, a pipe from
 * here), and an edge that dies is started again: it adopts its sandboxes.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { readFile, writeFile } from 'node:fs/promises';
import { createServer } from 'node:net';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { DsecError } from '@dsec/core';
import { ensureDir, PRIVATE_DIR_MODE, TRAVERSE_DIR_MODE, type AdmissionConfig } from '@dsec/edge';
import type { ApiBoundsConfig, ClusterConfig, EdgeConfig } from './config.js';
import type { LifecycleOptions } from './extensions.js';
import { joinEdge, startApiserver, stopAll, type ApiserverHandle } from './roles.js';

export interface LocalClusterOptions {
  stateDir: string;
  edges: number;
  /** How to run `dsec` (argv prefix), e.g. `[process.execPath, '/path/to/main.js']`. */
  dsecCommand: string[];
  port?: number;
  host?: string;
  admission?: AdmissionConfig | undefined;
  runtime?: string | undefined;
  cgroupFavorDynmods?: boolean;
  /** Each edge's `erofsMount`, `network` and `blobCacheBytes` (config.ts EdgeSection). */
  edgeConfig?: Pick<EdgeConfig, 'erofsMount' | 'gpus' | 'network' | 'blobCacheBytes' | 'fncall'>;
  lifecycle?: LifecycleOptions;
  /** Serve E2B host names `<port>-<sandboxId>.<domain>` (docs/e2b.md). */
  e2bDomain?: string | undefined;
  logRequests?: boolean;
  /** Edge N's cgroup parent is `<cgroupPrefix>-edge-N` (default `dsec`). */
  cgroupPrefix?: string;
  /** How often the watcher probes the edges (default 1000). */
  watcherIntervalMs?: number;
  log?: (msg: string) => void;
  /** Admin listener of the apiserver's metrics; edge i serves its own on `port + i`. */
  metricsListen?: { host: string; port: number } | undefined;
  /** The apiserver's Host allow-list, per-caller limits and audit retention. */
  apiBounds?: ApiBoundsConfig | undefined;
}

export interface LocalEdgeProcess {
  id: string;
  url: string;
  pid: number | undefined;
  stateDir: string;
}

export interface LocalCluster {
  url: string;
  adminKey: string;
  apiserver: ApiserverHandle;
  edges(): LocalEdgeProcess[];
  watcherPid(): number | undefined;
  close(options?: { stopSandboxes?: boolean }): Promise<void>;
}

/** What `dsec cluster status` reads to show local pids: `stateDir/cluster/processes.json`. */
export const PROCESSES_FILE = 'cluster/processes.json';

const READY_TIMEOUT_MS = 120_000;
const RESTART_DELAY_MS = 1000;

/** `HOST:PORT` of a config's `metricsListen`, `offset` ports above `at`. */
function listenAt(at: { host: string; port: number }, offset: number): string {
  const host = at.host.includes(':') ? `[${at.host}]` : at.host;
  return `${host}:${at.port + offset}`;
}

class Child {
  proc: ChildProcess | undefined;
  url = '';
  #closing = false;

  constructor(
    readonly name: string,
    readonly argv: string[],
    readonly log: (msg: string) => void,
    readonly onRestart: (child: Child) => Promise<void>,
  ) {}

  /** Starts the process and resolves with the URL it prints on its `ready` line. */
  start(): Promise<string> {
    const [cmd, ...args] = this.argv;
    // stdin is a pipe the child watches: when this process dies, so do its children.
    const proc = spawn(cmd!, args, { stdio: ['pipe', 'pipe', 'inherit'] });
    this.proc = proc;
    const ready = new Promise<string>((resolve, reject) => {
      const timer = setTimeout(
        () => reject(new DsecError('unavailable', `${this.name} did not start within 120 s`)),
        READY_TIMEOUT_MS,
      );
      const lines = createInterface({ input: proc.stdout });
      lines.on('line', (line) => {
        const m = /^ready (\S+)/.exec(line);
        if (m) {
          clearTimeout(timer);
          resolve(m[1]!);
        } else this.log(`${this.name}: ${line}`);
      });
      proc.once('exit', (code, signal) => {
        clearTimeout(timer);
        reject(
          new DsecError(
            'unavailable',
            `${this.name} exited (${signal ?? code}) before it was ready`,
          ),
        );
      });
    });
    proc.once('exit', (code, signal) => {
      if (this.#closing || this.proc !== proc) return;
      this.log(`${this.name} exited (${signal ?? code}); starting it again`);
      setTimeout(() => {
        if (this.#closing) return;
        this.start()
          .then(async (url) => {
            this.url = url;
            await this.onRestart(this);
          })
          .catch((err: unknown) => this.log(`${this.name}: restart failed: ${String(err)}`));
      }, RESTART_DELAY_MS).unref();
    });
    return ready.then((url) => (this.url = url));
  }

  async stop(): Promise<void> {
    this.#closing = true;
    const proc = this.proc;
    if (!proc || proc.exitCode !== null || proc.signalCode !== null) return;
    const exited = new Promise<void>((resolve) => proc.once('exit', () => resolve()));
    proc.kill('SIGTERM');
    const force = setTimeout(() => proc.kill('SIGKILL'), 15_000);
    await exited;
    clearTimeout(force);
  }
}

export async function startLocalCluster(options: LocalClusterOptions): Promise<LocalCluster> {
  const { stateDir } = options;
  if (!Number.isInteger(options.edges) || options.edges < 1 || options.edges > 64)
    throw new DsecError('invalid_argument', '--edges takes 1 to 64', { field: 'edges' });
  const log = options.log ?? (() => undefined);
  ensureDir(stateDir, TRAVERSE_DIR_MODE);
  const clusterDir = join(stateDir, 'cluster');
  ensureDir(clusterDir, PRIVATE_DIR_MODE);
  ensureDir(join(stateDir, 'images'), PRIVATE_DIR_MODE);
  ensureDir(join(stateDir, 'edges'), TRAVERSE_DIR_MODE);

  const shared: ClusterConfig = {
    database: join(stateDir, 'iam.db'),
    clusterSecretFile: join(stateDir, 'cluster.secret'),
    imageStore: join(stateDir, 'images'),
    apiserver: {
      host: options.host ?? '127.0.0.1',
      port: options.port ?? 7420,
      adminKeyFile: join(stateDir, 'admin.key'),
      watch: false,
      registryRefreshMs: 500,
      logRequests: options.logRequests ?? false,
      ...(options.metricsListen ? { metricsListen: listenAt(options.metricsListen, 0) } : {}),
      ...options.apiBounds,
    },
    ...(options.e2bDomain ? { e2b: { sandboxDomain: options.e2bDomain } } : {}),
    watcher: {
      intervalMs: options.watcherIntervalMs ?? 1000,
      probeTimeoutMs: 1500,
      failuresBeforeDown: 2,
    },
  };
  const sharedFile = join(clusterDir, 'cluster.json');
  await writeFile(sharedFile, JSON.stringify(shared, null, 2) + '\n', { mode: 0o600 });

  // The apiserver first: it creates the control database (and the admin key) the others use.
  const apiserver = await startApiserver(shared);
  const children: Child[] = [];
  const edgeConfigs: { config: ClusterConfig; file: string; child: Child }[] = [];
  const writeProcesses = () =>
    writeFile(
      join(stateDir, PROCESSES_FILE),
      JSON.stringify(
        {
          apiserver: { pid: process.pid, url: apiserver.url },
          watcher: { pid: watcher?.proc?.pid },
          edges: edgeConfigs.map((e) => ({
            id: e.config.edge!.id,
            url: e.child.url,
            pid: e.child.proc?.pid,
            stateDir: e.config.edge!.stateDir,
          })),
        },
        null,
        2,
      ) + '\n',
      { mode: 0o600 },
    );
  const registerEdge = async (e: { config: ClusterConfig; child: Child }) => {
    await joinEdge({ ...e.config, database: shared.database }, { url: e.child.url });
    await apiserver.fleet.refresh();
  };
  let watcher: Child | undefined;
  try {
    for (let i = 1; i <= options.edges; i++) {
      const id = `edge-${i}`;
      const port = await freePort();
      const edge: EdgeConfig = {
        id,
        stateDir: join(stateDir, 'edges', id),
        host: '127.0.0.1',
        port,
        secretFile: join(clusterDir, `${id}.secret`),
        labels: {},
        cgroupParent: `${options.cgroupPrefix ?? 'dsec'}-${id}`,
        cgroupFavorDynmods: options.cgroupFavorDynmods ?? true,
        logRequests: false,
        ...(options.metricsListen ? { metricsListen: listenAt(options.metricsListen, i) } : {}),
        ...(options.admission ? { admission: options.admission } : {}),
        ...(options.lifecycle?.pausedTtlMs
          ? { pausedTtlSeconds: Math.ceil(options.lifecycle.pausedTtlMs / 1000) }
          : {}),
        ...(options.lifecycle?.idleTimeoutMs
          ? { idlePauseSeconds: Math.ceil(options.lifecycle.idleTimeoutMs / 1000) }
          : {}),
        ...(options.lifecycle?.pauseSwapMaxBytes !== undefined
          ? { pauseSwapMaxMb: Math.floor(options.lifecycle.pauseSwapMaxBytes / 2 ** 20) }
          : {}),
        ...(options.runtime ? { runtime: options.runtime } : {}),
        ...options.edgeConfig,
      };
      const config: ClusterConfig = { imageStore: shared.imageStore, edge };
      const file = join(clusterDir, `${id}.json`);
      await writeFile(file, JSON.stringify(config, null, 2) + '\n', { mode: 0o600 });
      const entry = {
        config,
        file,
        child: new Child(
          id,
          [...options.dsecCommand, 'serve', 'edge', '--config', file, '--exit-with-stdin'],
          log,
          async () => {
            await registerEdge(entry);
            await writeProcesses();
          },
        ),
      };
      edgeConfigs.push(entry);
      children.push(entry.child);
    }
    const watcherChild = new Child(
      'watcher',
      [...options.dsecCommand, 'serve', 'watcher', '--config', sharedFile, '--exit-with-stdin'],
      log,
      () => writeProcesses(),
    );
    watcher = watcherChild;
    children.push(watcherChild);
    // Edges start in parallel: each mounts, adopts and claims its own things.
    await Promise.all(edgeConfigs.map((e) => e.child.start()));
    for (const e of edgeConfigs) await registerEdge(e);
    await watcherChild.start();
    await writeProcesses();
    await untilHealthy(apiserver, options.edges);
  } catch (err) {
    await Promise.all(children.map((c) => c.stop()));
    await apiserver.close();
    throw err;
  }

  return {
    url: apiserver.url,
    adminKey: apiserver.adminKey ?? (await readAdminKey(stateDir)),
    apiserver,
    edges: () =>
      edgeConfigs.map((e) => ({
        id: e.config.edge!.id,
        url: e.child.url,
        pid: e.child.proc?.pid,
        stateDir: e.config.edge!.stateDir,
      })),
    watcherPid: () => watcher?.proc?.pid,
    async close(closeOptions = {}) {
      if (closeOptions.stopSandboxes) {
        // Through each edge's process, while it still runs: 8 at a time per edge.
        await Promise.all(
          edgeConfigs.map(async (e) => {
            const edge = apiserver.fleet.edge(e.config.edge!.id);
            if (edge) await stopAll(edge, 8).catch(() => undefined);
          }),
        );
      }
      await apiserver.close();
      await Promise.all(children.map((c) => c.stop()));
    },
  };
}

/** Ready means placeable: waits (bounded) until the apiserver sees every edge healthy. */
async function untilHealthy(apiserver: ApiserverHandle, edges: number): Promise<void> {
  const deadline = Date.now() + READY_TIMEOUT_MS;
  for (;;) {
    await apiserver.fleet.refresh();
    const healthy = apiserver.fleet.view().edges.filter((e) => e.healthy).length;
    if (healthy >= edges) return;
    if (Date.now() > deadline)
      throw new DsecError('unavailable', `only ${healthy} of ${edges} edges became healthy`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

async function readAdminKey(stateDir: string): Promise<string> {
  const key = (await readFile(join(stateDir, 'admin.key'), 'utf8').catch(() => '')).trim();
  if (!key)
    throw new DsecError(
      'invalid_argument',
      `${join(stateDir, 'admin.key')} is missing but the control database exists: restore the key file or use a new --state-dir`,
    );
  return key;
}

/** A port free now (the kernel picks it); the edge binds it a moment later. */
function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address() as { port: number };
      server.close(() => resolve(port));
    });
  });
}
