import { chownSync, lchownSync, mkdirSync, rmSync } from 'node:fs';
import { open, readFile, rename, stat, unlink, writeFile, type FileHandle } from 'node:fs/promises';
import { createServer, type Socket } from 'node:net';
import { join } from 'node:path';
import { DsecError } from '@dsec/core';
import { QmpClient } from './qmp.js';

/**
 * Pause and resume of a microVM (docs/adr/0017-microvm-lifecycle.md): the
 * stopped machine's memory and device state are migrated into a file the
 * edge writes, and QEMU exits; resume boots the same machine with
 * `-incoming` from that file. The file exists only complete (written as
 * `vmstate.partial`, renamed when QEMU reports the migration completed), and
 * is removed before the restored machine runs again, so that a crash at any
 * point leaves either a complete state to restore from or a running VM,
 * never a state older than the VM's disk.
 */
export function pausePaths(dir: string) {
  return {
    state: join(dir, 'vmstate'),
    statePartial: join(dir, 'vmstate.partial'),
    /** The only place the jailed QEMU may connect to: a directory of its own uid. */
    migrateDir: join(dir, 'migrate'),
    migrateSocket: join(dir, 'migrate', 'm.sock'),
    /**
     * The ids of the devices hot-plugged since boot (the dedicated ports),
     * written before the state: a restore must start with the same devices.
     */
    plugged: join(dir, 'plugged.json'),
  };
}

/** Ids of devices hot-plugged with `device_add … id=ID` (QOM's /machine/peripheral), sorted. */
export async function pluggedDevices(qmp: QmpClient, timeoutMs: number): Promise<string[]> {
  const list = await qmp.execute<{ name: string; type: string }[]>(
    'qom-list',
    { path: '/machine/peripheral' },
    { timeoutMs },
  );
  return list
    .filter((e) => e.type.startsWith('child<'))
    .map((e) => e.name)
    .sort();
}

/** What {@link saveVm} recorded (nothing: none were plugged, or a state from before hot-plug). */
export async function readPlugged(paths: { plugged: string }): Promise<string[]> {
  const text = await readFile(paths.plugged, 'utf8').catch(() => undefined);
  return text === undefined ? [] : (JSON.parse(text) as string[]);
}

type Paths = ReturnType<typeof pausePaths> & { qmp: string; dir: string };

/** QEMU 7.2 throttles migration to 32 MiB/s by default; a stopped VM's save is not traffic to spare. */
const MIGRATE_BANDWIDTH_BYTES = 64 * 2 ** 30;
const POLL_MS = 5;

export interface SaveTimings {
  /** `stop`: the vCPUs halted. */
  stopMs: number;
  /** The migration stream written and synced. */
  saveMs: number;
  /** `quit` until the process was gone. */
  quitMs: number;
  stateBytes: number;
}

/**
 * Stops the VM, migrates its state over a unix socket the edge listens on
 * into `vmstate`, and ends QEMU. QEMU (jailed as `hostId`, seccomp without
 * exec, so no `exec:` migration; QEMU 7.2 has no `file:`) connects to the
 * socket in a directory only its uid may enter; the file itself is the
 * edge's (root, 0600), so QEMU never holds an open state file.
 */
export async function saveVm(options: {
  paths: Paths;
  hostId: number;
  pid: number;
  timeoutMs: number;
}): Promise<SaveTimings> {
  const { paths, hostId, pid, timeoutMs } = options;
  const deadline = Date.now() + timeoutMs;
  const left = () => Math.max(1, deadline - Date.now());
  const t0 = performance.now();
  const qmp = await QmpClient.connect(paths.qmp, { timeoutMs: left() });
  const server = createServer();
  try {
    await qmp.execute('stop', undefined, { timeoutMs: left() });
    const t1 = performance.now();
    // Stopped: no device comes or goes any more (the edge plugs ports while the VM runs).
    await writeFile(paths.plugged, JSON.stringify(await pluggedDevices(qmp, left())), {
      mode: 0o600,
    });

    rmSync(paths.migrateDir, { recursive: true, force: true });
    mkdirSync(paths.migrateDir, { mode: 0o700 });
    chownSync(paths.migrateDir, hostId, hostId);
    const out = await open(paths.statePartial, 'w', 0o600);
    let received: Promise<void> | undefined;
    try {
      const accepted = new Promise<Socket>((resolve) => server.once('connection', resolve));
      await new Promise<void>((resolve, reject) => {
        server.once('error', reject);
        server.listen(paths.migrateSocket, () => resolve());
      });
      // The directory is QEMU's uid's: never follow what may stand at the socket's name now.
      lchownSync(paths.migrateSocket, hostId, hostId);
      received = accepted.then((sock) => writeAll(sock, out));
      received.catch(() => undefined);
      await qmp.execute(
        'migrate-set-parameters',
        { 'max-bandwidth': MIGRATE_BANDWIDTH_BYTES },
        { timeoutMs: left() },
      );
      await qmp.execute('migrate', { uri: `unix:${paths.migrateSocket}` }, { timeoutMs: left() });
      for (;;) {
        const m = await qmp.execute<{ status?: string; 'error-desc'?: string }>(
          'query-migrate',
          undefined,
          { timeoutMs: left() },
        );
        if (m.status === 'completed') break;
        if (m.status === 'failed' || m.status === 'cancelled')
          throw new DsecError(
            'unavailable',
            `saving the microVM failed: ${m['error-desc'] ?? m.status} (${await logTail(paths.dir)})`,
          );
        if (Date.now() >= deadline)
          throw new DsecError('deadline_exceeded', `saving the microVM took over ${timeoutMs} ms`);
        await sleep(POLL_MS);
      }
      // QEMU closes its end when done: the file then holds the whole stream.
      await withDeadline(received, left(), 'the migration stream did not end');
      await out.sync();
    } finally {
      await out.close();
    }
    await rename(paths.statePartial, paths.state);
    await syncDir(paths.dir);
    const stateBytes = (await stat(paths.state)).size;
    const t2 = performance.now();

    await qmp.execute('quit', undefined, { timeoutMs: left() }).catch(() => undefined);
    await waitGone(pid, left());
    return { stopMs: t1 - t0, saveMs: t2 - t1, quitMs: performance.now() - t2, stateBytes };
  } catch (err) {
    // Still the running machine's: let it run on (the pause failed).
    await qmp.execute('cont', undefined, { timeoutMs: 2_000 }).catch(() => undefined);
    await unlink(paths.statePartial).catch(() => undefined);
    throw err;
  } finally {
    qmp.close();
    server.close();
    rmSync(paths.migrateDir, { recursive: true, force: true });
  }
}

/**
 * The second half of a restore (QEMU started with `-incoming fd:3 -S`):
 * waits until the state is loaded, removes the state file (from now on
 * the disk moves on), and lets the vCPUs run.
 */
export async function finishRestore(paths: Paths, timeoutMs: number): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  const left = () => Math.max(1, deadline - Date.now());
  let qmp: QmpClient | undefined;
  // The socket is QEMU's to create (a previous QEMU's may still be there, refusing).
  while (!qmp) {
    try {
      qmp = await QmpClient.connect(paths.qmp, { timeoutMs: left() });
    } catch (err) {
      if (Date.now() >= deadline) throw err;
      await sleep(POLL_MS);
    }
  }
  try {
    for (;;) {
      const s = await qmp.execute<{ status: string }>('query-status', undefined, {
        timeoutMs: left(),
      });
      if (s.status === 'paused' || s.status === 'postmigrate') break;
      if (s.status !== 'inmigrate' && s.status !== 'prelaunch')
        throw new DsecError('unavailable', `the restored microVM is ${s.status}`);
      if (Date.now() >= deadline)
        throw new DsecError('deadline_exceeded', `restoring the microVM took over ${timeoutMs} ms`);
      await sleep(POLL_MS);
    }
    await unlink(paths.state);
    await syncDir(paths.dir);
    await qmp.execute('cont', undefined, { timeoutMs: left() });
  } finally {
    qmp.close();
  }
}

/** The migration stream into the state file, until QEMU closes its end (one write at a time). */
async function writeAll(sock: Socket, out: FileHandle): Promise<void> {
  let writing = Promise.resolve();
  let failed: Error | undefined;
  sock.on('data', (chunk: Buffer) => {
    sock.pause();
    writing = writing
      .then(async () => {
        await out.write(chunk);
      })
      .catch((err: unknown) => {
        failed ??= err instanceof Error ? err : new Error(String(err));
      })
      .finally(() => sock.resume());
  });
  await new Promise<void>((resolve, reject) => {
    sock.once('end', resolve);
    sock.once('error', reject);
  });
  await writing;
  if (failed) throw failed;
}

async function syncDir(dir: string): Promise<void> {
  const fh = await open(dir, 'r');
  try {
    await fh.sync();
  } finally {
    await fh.close();
  }
}

function withDeadline<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  return new Promise((resolve, reject) => {
    const t = setTimeout(() => reject(new DsecError('deadline_exceeded', what)), ms);
    p.then(resolve, reject).finally(() => clearTimeout(t));
  });
}

function sleep(ms: number): Promise<void> {
  return new Promise((r) => setTimeout(r, ms));
}

async function waitGone(pid: number, ms: number): Promise<void> {
  const deadline = Date.now() + ms;
  while (Date.now() < deadline) {
    const st = await readFile(`/proc/${pid}/stat`, 'utf8').catch(() => '');
    if (!st || / Z /.test(st)) return;
    await sleep(POLL_MS);
  }
  try {
    process.kill(pid, 'SIGKILL');
  } catch {
    // gone
  }
}

/** v1's `memory.force_empty`: what the gone QEMU left charged (page cache of its files) is reclaimed. */
export async function reclaimCgroup(dirs: string[]): Promise<void> {
  for (const d of dirs) await writeFile(join(d, 'memory.force_empty'), '0').catch(() => undefined);
}

/** QEMU reports why a migration failed on its stderr (qemu.log), not in `query-migrate`. */
async function logTail(dir: string): Promise<string> {
  const text = await readFile(join(dir, 'qemu.log'), 'utf8').catch(() => '');
  return text.trim().split('\n').slice(-2).join(' | ').slice(-400) || 'no log';
}
