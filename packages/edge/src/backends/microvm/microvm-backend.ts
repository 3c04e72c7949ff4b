import { createHash } from 'node:crypto';
import { chmodSync, chownSync, closeSync, existsSync, mkdirSync, openSync, rmSync } from 'node:fs';
import { readdir, readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { DsecError } from '@dsec/core';
import type { ImageStore } from '@dsec/core';
import { ChronusConnection } from '@dsec/native';
import type { CgroupDriver } from '../../cgroups/cgroup-driver.js';
import type { LayerMountCache } from '../../layers/layer-cache.js';
import type { Backend, BackendSandbox, PauseResult, StartedSandbox } from '../backend.js';
import type { CommandExit, SandboxChannel, SandboxCommand } from '../channel.js';
import {
  accelArgs,
  kernelCmdline,
  probeAccel,
  QEMU_BINARY,
  type Accel,
  type MicrovmAssets,
} from './assets.js';
import { isQemuOf, killQuietly, makeQemuCgroup, qemuJailArgs, spawnQemu } from './qemu-cgroup.js';
import { makeScratchDisk } from '../scratch-disk.js';
import { finishRestore, pausePaths, readPlugged, reclaimCgroup, saveVm } from './pause.js';
import { QmpClient } from './qmp.js';
import { connectMicrovm, netCmdline, tapArgs, type MicrovmNetwork } from './network.js';

/** Each sandbox's hypervisor runs as its own host uid/gid (the container backend's range per slot). */
const ID_BASE = 100_000;
const ID_COUNT = 65_536;
/**
 * Ports 1… of this many serve dedicated channels (port 0 is the shared
 * one). A port present at boot costs boot time (≈ 30 ms each under TCG:
 * the guest driver fills its receive queue and registers a device), so a VM
 * boots with port 0 only and the edge hot-plugs a dedicated port the first
 * time it needs one (`device_add` over QMP; its chardev socket is there from
 * the start, so QEMU, jailed, creates nothing); a port stays plugged. A
 * caller waits for a free one when all are taken (file transfers, port
 * forwards and terminals hold one each while they stream).
 */
const DEDICATED_PORTS = 7;
/** QOM id of a hot-plugged dedicated port (`pause.ts` records them for a restore). */
const portDeviceId = (port: number) => `dsec-port-${port}`;
/** How long a caller waits for a dedicated port before `resource_exhausted`. */
const PORT_WAIT_MS = 30_000;
/**
 * A port's next host connection waits this long after its last one closed:
 * the guest agent must see the hang-up (and drop the old relayed connection)
 * before new bytes arrive, or they would reach the old connection.
 */
const PORT_COOLDOWN_MS = 250;
/** Host memory of QEMU itself on top of the guest's RAM (TCG's 64 MiB translation cache, devices). */
const QEMU_OVERHEAD_MB = 160;
/** Writable disk when the spec names no disk limit (sparse: only what is written takes space). */
const DEFAULT_DISK_MB = 4096;
const STOP_WAIT_MS = 5_000;

export interface MicrovmBackendOptions {
  /** Per-sandbox directories (disk image, channel sockets, console log). */
  dir: string;
  assets: MicrovmAssets;
  /** The EROFS blobs of the layers are attached as drives straight from here. */
  store: ImageStore;
  /**
   * The edge's layer references: a sandbox holds one per layer while it
   * runs (so the blobs it reads stay, and the edge's restart accounting,
   * which acquires for every adopted sandbox, balances with `stop`).
   */
  layers: Pick<LayerMountCache, 'acquire' | 'release'>;
  cgroups: CgroupDriver;
  /**
   * The edge's network manager: a VM whose spec opens something gets a tap
   * under its firewall elements and resolver (network.ts, ADR 0016); `stop`
   * releases them (idempotent, like the container's).
   */
  network?: MicrovmNetwork | undefined;
  /** Cgroup under which every sandbox's cgroup is created (`/<parent>/<name>`). */
  cgroupParent: string;
  qemuBinary?: string | undefined;
  /** Default: probed once (`probeAccel`). */
  accel?: Accel | undefined;
  /** From QEMU's start to the agent answering. Default: 30 s with KVM, 120 s with TCG. */
  bootTimeoutMs?: number | undefined;
  /** virtio-balloon free-page reporting (default on; off only to measure it). */
  freePageReporting?: boolean | undefined;
  log?: ((msg: string, fields?: Record<string, unknown>) => void) | undefined;
}

/**
 * MicroVM sandboxes (paper 2.2, 5.1): QEMU's `microvm` machine boots
 * Debian's cloud kernel with the project's initramfs; the image's EROFS
 * layers are read-only virtio-blk drives, the writable layer an ext4 disk
 * of the disk limit, joined by overlayfs inside the guest. The guest agent
 * (packages/native/src/guest_agent.c) runs chronus's event loop, so the
 * edge's channel is the same protocol as for containers, carried by
 * virtio-serial ports (one connection each) instead of a unix socket.
 *
 * The hypervisor is the sandbox's only host process: it runs in the
 * sandbox's cgroup (memory = guest RAM plus QEMU's overhead, CPU quota),
 * as the sandbox's own uid after it opened its files (`-runas`), under
 * QEMU's seccomp sandbox. A VM whose spec opens egress gets a virtio-net
 * device on a host tap under the container's firewall and resolver (ADR
 * 0016); others have no network device, only loopback.
 * Sandboxes outlive the edge: QEMU runs detached, and the next edge adopts
 * it by pid and command line.
 */
export class MicrovmBackend implements Backend {
  readonly kind = 'microvm' as const;
  readonly #shared = new Map<string, Promise<ChronusConnection>>();
  /** Dedicated ports in use (or cooling down) per sandbox, and who waits for one. */
  readonly #ports = new Map<
    string,
    {
      busy: Set<number>;
      waiting: {
        resolve: (port: number) => void;
        reject: (err: Error) => void;
        timer: NodeJS.Timeout;
      }[];
    }
  >();
  /**
   * Dedicated ports known to be plugged, per sandbox, and the plug in
   * progress (QEMU's monitor takes one client at a time: plugs queue).
   */
  readonly #plugged = new Map<string, { ports: Set<number>; queue: Promise<unknown> }>();
  #accel: Promise<Accel> | undefined;

  constructor(readonly options: MicrovmBackendOptions) {
    // Traversable (not listable) by the sandboxes' uids: a paused QEMU connects
    // to its own uid's migrate/ directory inside its sandbox's (pause.ts).
    mkdirSync(options.dir, { recursive: true, mode: 0o711 });
    chmodSync(options.dir, 0o711);
  }

  /** KVM or TCG (the probe runs once, on the first start). */
  accel(): Promise<Accel> {
    this.#accel ??= this.options.accel
      ? Promise.resolve(this.options.accel)
      : probeAccel(this.options.assets).then((a) => {
          this.options.log?.('microvm accelerator', { accel: a });
          return a;
        });
    return this.#accel;
  }

  paths(rec: Pick<BackendSandbox, 'id'>) {
    const name = 'dsec-vm-' + createHash('sha256').update(rec.id).digest('hex').slice(0, 20);
    const dir = join(this.options.dir, name);
    return {
      name,
      dir,
      disk: join(dir, 'disk.img'),
      console: join(dir, 'console.log'),
      port: (i: number) => join(dir, `p${i}.sock`),
      cgroupsPath: `/${this.options.cgroupParent}/${name}`,
      qmp: join(dir, 'qmp.sock'),
      ...pausePaths(dir),
    };
  }

  /**
   * `restore` (from `resume`, pause.ts): boots the same machine with
   * `-incoming` from the saved state instead, stopped (`-S`) until the
   * state is loaded, then continues it; the disk, cgroup and layer
   * references are the paused sandbox's own.
   */
  async start(
    rec: BackendSandbox,
    signal?: AbortSignal,
    restore?: { stateFd: number },
  ): Promise<StartedSandbox> {
    const p = this.paths(rec);
    const hostId = ID_BASE + rec.slot * ID_COUNT;
    mkdirSync(p.dir, { recursive: true, mode: 0o711 });
    if (!restore) for (const layer of rec.layers) await this.options.layers.acquire(layer);
    // Top layer first (the init stacks them in drive order); identical layers once.
    const digests = [...new Set([...rec.layers].reverse().map((l) => l.digest))];
    const [layerFiles, accel] = await Promise.all([
      Promise.all(digests.map((d) => this.options.store.blobPath(d, { signal }))),
      this.accel(),
      restore
        ? undefined
        : makeScratchDisk(p.disk, rec.spec.diskLimitMb ?? DEFAULT_DISK_MB, { exclusive: false }),
      restore && this.options.cgroups.exists(p.cgroupsPath)
        ? undefined
        : makeQemuCgroup(this.options.cgroups, p.cgroupsPath, {
            memoryMb: rec.spec.memoryLimitMb + QEMU_OVERHEAD_MB,
            cpuCores: rec.spec.cpuCoresLimit,
          }),
    ]);
    // A tap under the sandbox's firewall elements when its spec opens something (network.ts).
    const link = await connectMicrovm(this.options.network, rec, {
      ownerUid: hostId,
      dir: p.dir,
      restore: Boolean(restore),
    });
    // QEMU reopens the disk by path when a migration (pause) hands it over
    // read-only and when a restore takes it back (as its own uid by then).
    chownSync(p.disk, hostId, hostId);
    // Guest-visible ports at boot: the shared one; a restore also has those
    // plugged before the pause (a state saved before hot-plug existed, with
    // no record, had every port from boot, as has a VM whose initramfs
    // predates it).
    const bootPorts = new Set([0]);
    if (!this.options.assets.hotplugPorts)
      for (let i = 1; i <= DEDICATED_PORTS; i++) bootPorts.add(i);
    if (restore) {
      if (!existsSync(p.plugged)) for (let i = 1; i <= DEDICATED_PORTS; i++) bootPorts.add(i);
      for (const id of await readPlugged(p)) {
        const port = Number(/^dsec-port-(\d+)$/.exec(id)?.[1] ?? NaN);
        if (port >= 1 && port <= DEDICATED_PORTS) bootPorts.add(port);
      }
    }
    const args = [
      '-name',
      p.name,
      '-M',
      'microvm,x-option-roms=off',
      ...accelArgs(accel),
      '-m',
      String(rec.spec.memoryLimitMb),
      '-smp',
      String(Math.max(1, Math.ceil(rec.spec.cpuCoresLimit))),
      '-nodefaults',
      '-no-user-config',
      '-display',
      'none',
      '-no-reboot',
      '-kernel',
      this.options.assets.kernel,
      '-initrd',
      this.options.assets.initramfs,
      '-append',
      // The agent mounts the root itself (no fork per step: guest_agent.c setup_root).
      kernelCmdline([
        'rdinit=/dsec-agent',
        `dsec.layers=${layerFiles.length}`,
        `dsec.pids=${rec.spec.pidsLimit}`,
        ...(link ? netCmdline(link) : []),
      ]),
      '-serial',
      `file:${p.console}`,
      ...layerFiles.flatMap((file, i) => [
        '-drive',
        `file=${file},if=none,id=l${i},format=raw,readonly=on`,
        '-device',
        `virtio-blk-device,drive=l${i}`,
      ]),
      '-drive',
      `file=${p.disk},if=none,id=rw,format=raw,cache=unsafe,discard=unmap`,
      '-device',
      'virtio-blk-device,drive=rw',
      ...(link ? tapArgs(link) : []),
      '-device',
      // Port number 0 is reserved for a console.
      `virtio-serial-device,max_ports=${DEDICATED_PORTS + 2}`,
      ...Array.from({ length: DEDICATED_PORTS + 1 }, (_, i) => [
        '-chardev',
        `socket,id=c${i},path=${p.port(i)},server=on,wait=off`,
        ...(bootPorts.has(i) ? ['-device', portDevice(i)] : []),
      ]).flat(),
      // The edge's control of the machine (pause.ts): a root-only socket.
      '-chardev',
      `socket,id=qmp,path=${p.qmp},server=on,wait=off`,
      '-mon',
      'chardev=qmp,mode=control',
      // Pages the guest frees go back to the host (guest_agent.c loads virtio_balloon).
      ...(this.options.freePageReporting === false
        ? []
        : ['-device', 'virtio-balloon-device,free-page-reporting=on']),
      // The saved machine arrives on fd 3, opened by the edge (QEMU never opens it).
      ...(restore ? ['-incoming', 'fd:3', '-S'] : []),
      ...qemuJailArgs(hostId),
    ];
    const { pid, exited } = spawnQemu({
      binary: this.options.qemuBinary ?? QEMU_BINARY,
      args,
      cgroupDirs: this.options.cgroups.dirs(p.cgroupsPath),
      logFile: join(p.dir, 'qemu.log'),
      consoleFile: p.console,
      stateFd: restore?.stateFd,
      what: 'microVM',
    });
    try {
      const timeoutMs = this.options.bootTimeoutMs ?? (accel === 'kvm' ? 30_000 : 120_000);
      if (restore) await Promise.race([exited, finishRestore(p, timeoutMs)]);
      await Promise.race([
        exited,
        restore
          ? this.#waitForAgent(rec, timeoutMs, signal)
          : this.#waitForPortOpen(rec, timeoutMs, signal),
      ]);
      return { initPid: pid, chronusPid: pid };
    } catch (err) {
      killQuietly(pid);
      throw err;
    }
  }

  /**
   * A fresh boot is up when the guest agent opened the shared port (QEMU's
   * VSERPORT_CHANGE event, or `frontend-open` of its chardev when that came
   * first): the agent opens it only after it mounted the sandbox root and
   * started the chronus loop, whose socket already listens, so a command
   * sent now is served. (An exec as the probe would cost the boot a fork
   * and exec in the guest.) The shared connection is made meanwhile.
   */
  async #waitForPortOpen(
    rec: BackendSandbox,
    timeoutMs: number,
    signal?: AbortSignal,
  ): Promise<void> {
    const deadline = Date.now() + timeoutMs;
    const left = () => {
      signal?.throwIfAborted();
      const ms = deadline - Date.now();
      if (ms <= 0)
        throw new DsecError('deadline_exceeded', `the microVM did not boot in ${timeoutMs} ms`);
      return ms;
    };
    let qmp: QmpClient | undefined;
    // QEMU creates the socket as it starts.
    while (!qmp) {
      try {
        qmp = await QmpClient.connect(this.paths(rec).qmp, { timeoutMs: left() });
      } catch (err) {
        if (err instanceof DsecError && err.code === 'deadline_exceeded') throw err;
        left();
        await new Promise((r) => setTimeout(r, 10));
      }
    }
    try {
      const opened = qmp.waitEvent(
        'VSERPORT_CHANGE',
        left(),
        (e) => e.data?.id === portDeviceId(0) && e.data.open === true,
      );
      opened.catch(() => undefined);
      const [chardevs] = await Promise.all([
        qmp.execute<{ label: string; 'frontend-open'?: boolean }[]>('query-chardev', undefined, {
          timeoutMs: left(),
        }),
        this.#connection(rec),
      ]);
      if (!chardevs.find((c) => c.label === 'c0')?.['frontend-open']) {
        const aborted = new Promise<never>((_, reject) =>
          signal?.addEventListener('abort', () => reject(signal.reason as Error), { once: true }),
        );
        aborted.catch(() => undefined);
        await Promise.race([opened, aborted]);
      }
    } finally {
      qmp.close();
    }
  }

  /** The agent answers once the guest booted and mounted the sandbox root (a restore). */
  async #waitForAgent(rec: BackendSandbox, timeoutMs: number, signal?: AbortSignal): Promise<void> {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      signal?.throwIfAborted();
      const left = deadline - Date.now();
      if (left <= 0)
        throw new DsecError('deadline_exceeded', `the microVM did not boot in ${timeoutMs} ms`);
      try {
        // Bytes sent before the guest opened its port wait in QEMU: one try usually does.
        const conn = await this.#connection(rec);
        const exit = await withTimeout(run(conn, ['true']), left);
        if (exit === 0) return;
      } catch {
        this.#dropShared(rec.id);
        await new Promise((r) => setTimeout(r, 100));
      }
    }
  }

  async stop(rec: BackendSandbox): Promise<void> {
    const p = this.paths(rec);
    this.#dropShared(rec.id);
    for (const w of this.#ports.get(rec.id)?.waiting ?? []) {
      clearTimeout(w.timer);
      w.reject(new DsecError('sandbox_not_running', `sandbox ${rec.id} stopped`));
    }
    this.#ports.delete(rec.id);
    this.#plugged.delete(rec.id);
    this.#commands.delete(rec.id);
    const pid = await this.#qemuPid(rec);
    const pids = pid !== undefined ? [pid] : [];
    for (const pid of pids) if (await isQemuOf(pid, p.name)) killQuietly(pid);
    for (const pid of pids) await waitGone(pid, STOP_WAIT_MS);
    await this.options.network?.teardown(rec);
    if (this.options.cgroups.exists(p.cgroupsPath))
      await this.options.cgroups.remove(p.cgroupsPath);
    rmSync(p.dir, { recursive: true, force: true });
    for (const layer of rec.layers) this.options.layers.release(layer.digest);
  }

  /** Alive: its QEMU runs, or it is paused (its whole state in `vmstate`, no process). */
  async isRunning(rec: BackendSandbox): Promise<boolean> {
    if (existsSync(this.paths(rec).state)) return true;
    return (await this.#qemuPid(rec)) !== undefined;
  }

  /**
   * The QEMU of the sandbox: the recorded one (`chronusPid` is the current
   * one after a resume, `initPid` the first), else found by name (a resume
   * an edge crash interrupted before it recorded the new process).
   */
  async #qemuPid(rec: BackendSandbox): Promise<number | undefined> {
    const name = this.paths(rec).name;
    for (const pid of new Set([rec.chronusPid, rec.initPid]))
      if (pid !== undefined && (await isQemuOf(pid, name))) return pid;
    return (await findProcesses(name))[0];
  }

  /**
   * Pause (ADR 0017): the VM's memory and device state go to a file and
   * QEMU exits, so a paused microVM holds no host memory. Idempotent: with
   * a complete state file, only a QEMU left behind by a crash is ended.
   */
  async pause(rec: BackendSandbox): Promise<PauseResult> {
    const p = this.paths(rec);
    const memoryBeforeBytes = (await this.memoryBytes(rec)) ?? 0;
    this.#detach(rec.id);
    const pid = await this.#qemuPid(rec);
    let freezeMs = 0;
    let reclaimMs = 0;
    if (!existsSync(p.state)) {
      if (pid === undefined)
        throw new DsecError('sandbox_not_running', `microVM of sandbox ${rec.id} is gone`);
      const t = await saveVm({
        paths: p,
        hostId: ID_BASE + rec.slot * ID_COUNT,
        pid,
        timeoutMs: this.options.bootTimeoutMs ?? 120_000,
      });
      freezeMs = t.stopMs + t.saveMs;
      reclaimMs = t.quitMs;
      this.options.log?.('microvm saved', { id: rec.id, ...t });
    } else if (pid !== undefined) {
      killQuietly(pid);
      await waitGone(pid, STOP_WAIT_MS);
    }
    const t0 = performance.now();
    await reclaimCgroup(this.options.cgroups.dirs(p.cgroupsPath));
    reclaimMs += performance.now() - t0;
    return {
      freezeMs,
      reclaimMs,
      memoryBeforeBytes,
      memoryAfterBytes: (await this.memoryBytes(rec)) ?? 0,
    };
  }

  /**
   * Boots the paused machine from its state (same devices, `-incoming`);
   * the guest agent sees its ports' host side hang up and come back, and
   * serves the new connections. Returns the new QEMU as the channel's pid.
   */
  async resume(rec: BackendSandbox): Promise<{ chronusPid?: number | undefined }> {
    const p = this.paths(rec);
    const pid = await this.#qemuPid(rec);
    if (!existsSync(p.state)) {
      if (pid === undefined)
        throw new DsecError('sandbox_not_running', `microVM of sandbox ${rec.id} is gone`);
      return {}; // running (or resumed by a resume a crash interrupted after `cont`)
    }
    // A restore a crash interrupted before `cont`: start it over.
    if (pid !== undefined) {
      killQuietly(pid);
      await waitGone(pid, STOP_WAIT_MS);
    }
    this.#detach(rec.id);
    const fd = openSync(p.state, 'r');
    try {
      const started = await this.start(rec, undefined, { stateFd: fd });
      return { chronusPid: started.chronusPid };
    } finally {
      closeSync(fd);
    }
  }

  /** Paused for good: a complete state file and no QEMU. */
  async isFrozen(rec: BackendSandbox): Promise<boolean> {
    return existsSync(this.paths(rec).state) && (await this.#qemuPid(rec)) === undefined;
  }

  /** Commands the edge runs in a sandbox through its channels, until each settles. */
  readonly #commands = new Map<string, Set<TrackedCommand>>();
  #commandsOf(id: string): Set<TrackedCommand> {
    let set = this.#commands.get(id);
    if (!set) this.#commands.set(id, (set = new Set()));
    return set;
  }

  /**
   * Drops the edge's connections to a VM about to go away (its ports'
   * waiters fail). A pause ends every command still streaming to the edge
   * (its connection is a chardev of the QEMU that exits; the guest kills the
   * commands of a closed connection, ADR 0017): each fails with
   * `sandbox_not_running` and `details.reason: 'paused'`, not as a lost
   * channel (`unavailable`, which a client would retry).
   */
  #detach(id: string): void {
    for (const c of this.#commands.get(id) ?? [])
      c.fail(
        new DsecError(
          'sandbox_not_running',
          `sandbox ${id} was paused while the command ran: a microVM's pause ends the commands streaming to the edge`,
          { details: { reason: 'paused' } },
        ),
      );
    this.#commands.delete(id);
    this.#dropShared(id);
    this.#plugged.delete(id);
    for (const w of this.#ports.get(id)?.waiting ?? []) {
      clearTimeout(w.timer);
      w.reject(new DsecError('sandbox_not_running', `sandbox ${id} was paused`));
    }
    this.#ports.delete(id);
  }

  /** The agent restarts its own loop in the guest; only a dead VM is an error. */
  async ensureChronus(rec: BackendSandbox): Promise<number | undefined> {
    if (!(await this.isRunning(rec)))
      throw new DsecError('sandbox_not_running', `microVM of sandbox ${rec.id} is gone`);
    return undefined;
  }

  async channel(
    rec: BackendSandbox,
    options: { dedicated?: boolean } = {},
  ): Promise<SandboxChannel> {
    const commands = this.#commandsOf(rec.id);
    if (!options.dedicated)
      return new VmChannel(await this.#connection(rec), () => undefined, commands);
    const port = await this.#takePort(rec.id);
    let released = false;
    const release = () => {
      if (released) return;
      released = true;
      setTimeout(() => this.#freePort(rec.id, port), PORT_COOLDOWN_MS).unref();
    };
    try {
      await this.#plug(rec, port);
      const conn = await ChronusConnection.connect(this.paths(rec).port(port));
      return new VmChannel(conn, release, commands);
    } catch (err) {
      release();
      throw err;
    }
  }

  /**
   * Hot-plugs dedicated port `port` into the guest unless it is already
   * (QEMU refuses a second `device_add` of an id, "Duplicate device ID":
   * after an edge restart or a restore the backend does not know which
   * are, and finds out so). The
   * guest agent opens it on the uevent; the edge's connection, made right
   * after, waits in QEMU until the guest side is open.
   */
  #plug(rec: BackendSandbox, port: number): Promise<void> {
    let state = this.#plugged.get(rec.id);
    if (!state) this.#plugged.set(rec.id, (state = { ports: new Set(), queue: Promise.resolve() }));
    const s = state;
    const plugged = s.queue.then(async () => {
      if (s.ports.has(port)) return;
      const qmp = await QmpClient.connect(this.paths(rec).qmp);
      try {
        await qmp.execute('device_add', {
          driver: 'virtserialport',
          chardev: `c${port}`,
          nr: port + 1,
          name: `dsec.${port}`,
          id: portDeviceId(port),
        });
      } catch (err) {
        if (!/Duplicate device ID|already exists/i.test(String(err))) throw err;
      } finally {
        qmp.close();
      }
      s.ports.add(port);
    });
    s.queue = plugged.catch(() => undefined);
    return plugged;
  }

  /** A free dedicated port; when all are taken, the next one freed (in order of asking). */
  #takePort(id: string): Promise<number> {
    let ports = this.#ports.get(id);
    if (!ports) this.#ports.set(id, (ports = { busy: new Set(), waiting: [] }));
    for (let port = 1; port <= DEDICATED_PORTS; port++) {
      if (!ports.busy.has(port)) {
        ports.busy.add(port);
        return Promise.resolve(port);
      }
    }
    const waiting = ports.waiting;
    return new Promise((resolve, reject) => {
      const waiter = {
        resolve,
        reject,
        timer: setTimeout(() => {
          const at = waiting.indexOf(waiter);
          if (at >= 0) waiting.splice(at, 1);
          reject(
            new DsecError(
              'resource_exhausted',
              `all ${DEDICATED_PORTS} streaming channels of sandbox ${id} stayed in use`,
              { details: { limit: 'channels' } },
            ),
          );
        }, PORT_WAIT_MS),
      };
      waiting.push(waiter);
    });
  }

  #freePort(id: string, port: number): void {
    const ports = this.#ports.get(id);
    if (!ports) return; // the sandbox stopped meanwhile
    const next = ports.waiting.shift();
    if (next) {
      clearTimeout(next.timer);
      next.resolve(port); // handed over: stays busy
    } else ports.busy.delete(port);
  }

  /**
   * The guest kernel's OOM killer, not the host's: its `oom_kill` counter
   * (read only when a command died of SIGKILL) rose since the last look.
   */
  readonly #oomSeen = new Map<string, number>();
  async oomKilled(rec: BackendSandbox): Promise<boolean> {
    const conn = await this.#connection(rec);
    let out = '';
    const h = conn.spawn({ argv: ['cat', '/proc/vmstat'], shell: true });
    h.onStdout((c) => (out += c.toString('latin1')));
    await h.exited;
    const kills = Number(/^oom_kill (\d+)$/m.exec(out)?.[1] ?? 0);
    const seen = this.#oomSeen.get(rec.id) ?? 0;
    this.#oomSeen.set(rec.id, kills);
    return kills > seen;
  }

  /** Host memory of the VM (QEMU's charge in the sandbox's cgroup). */
  async memoryBytes(rec: BackendSandbox): Promise<number | undefined> {
    return this.options.cgroups.memoryUsageBytes(this.paths(rec).cgroupsPath);
  }

  async close(): Promise<void> {
    const all = [...this.#shared.values()];
    this.#shared.clear();
    for (const c of await Promise.allSettled(all)) if (c.status === 'fulfilled') c.value.close();
  }

  #connection(rec: Pick<BackendSandbox, 'id'>): Promise<ChronusConnection> {
    const cached = this.#shared.get(rec.id);
    if (cached) {
      return cached.then(
        (c) => (c.closed ? this.#reconnect(rec, cached) : c),
        () => this.#reconnect(rec, cached),
      );
    }
    return this.#reconnect(rec, undefined);
  }

  #reconnect(rec: Pick<BackendSandbox, 'id'>, stale: Promise<ChronusConnection> | undefined) {
    const current = this.#shared.get(rec.id);
    if (current && current !== stale) return current;
    const connecting = ChronusConnection.connect(this.paths(rec).port(0));
    this.#shared.set(rec.id, connecting);
    connecting.catch(() => this.#shared.get(rec.id) === connecting && this.#shared.delete(rec.id));
    return connecting;
  }

  #dropShared(id: string): void {
    const conn = this.#shared.get(id);
    this.#shared.delete(id);
    void conn?.then(
      (c) => c.close(),
      () => undefined,
    );
  }
}

/** The virtio-serial port `i` (named `dsec.i`, which the guest agent looks for), on chardev `ci`. */
function portDevice(i: number): string {
  return `virtserialport,chardev=c${i},nr=${i + 1},name=dsec.${i},id=${portDeviceId(i)}`;
}

/**
 * A channel of a VM: a dedicated port's connection (closing it frees the
 * port, after the cool-down) or the shared one (`release` does nothing:
 * the shared connection stays); its commands are tracked until they settle
 * so that a pause can fail them with its own error.
 */
class VmChannel implements SandboxChannel {
  #released = false;
  constructor(
    readonly conn: ChronusConnection,
    readonly release: () => void,
    readonly commands: Set<TrackedCommand>,
  ) {}
  get onPidsLimit() {
    return this.conn.onPidsLimit;
  }
  set onPidsLimit(cb) {
    this.conn.onPidsLimit = cb;
  }
  get closed(): boolean {
    return this.conn.closed;
  }
  spawn(request: Parameters<ChronusConnection['spawn']>[0]): SandboxCommand {
    const cmd = new TrackedCommand(this.conn.spawn(request));
    this.commands.add(cmd);
    void cmd.exited.then(
      () => this.commands.delete(cmd),
      () => this.commands.delete(cmd),
    );
    return cmd;
  }
  close(): void {
    this.conn.close();
    if (!this.#released) {
      this.#released = true;
      this.release();
    }
  }
  pause(): void {
    this.conn.pause();
  }
  resume(): void {
    this.conn.resume();
  }
  drained(): Promise<void> {
    return this.conn.drained();
  }
}

/** A command whose `exited` a pause can fail first (with the reason) before its connection closes. */
class TrackedCommand implements SandboxCommand {
  readonly exited: Promise<CommandExit>;
  #fail: (err: Error) => void = () => undefined;
  constructor(readonly inner: SandboxCommand) {
    const failed = new Promise<never>((_, reject) => (this.#fail = reject));
    this.exited = Promise.race([inner.exited, failed]);
    this.exited.catch(() => undefined);
  }
  fail(err: Error): void {
    this.#fail(err);
  }
  get started() {
    return this.inner.started;
  }
  onStdout(cb: (chunk: Buffer) => void): this {
    this.inner.onStdout(cb);
    return this;
  }
  onStderr(cb: (chunk: Buffer) => void): this {
    this.inner.onStderr(cb);
    return this;
  }
  write(data: Buffer | string): boolean {
    return this.inner.write(data);
  }
  endStdin(): void {
    this.inner.endStdin();
  }
  signal(sig: NodeJS.Signals | number): void {
    this.inner.signal(sig);
  }
  killTree(): void {
    this.inner.killTree();
  }
  resize(rows: number, cols: number): void {
    this.inner.resize(rows, cols);
  }
}

async function run(conn: ChronusConnection, argv: string[]): Promise<number | null> {
  const h = conn.spawn({ argv, shell: true });
  return (await h.exited).exitCode;
}

function withTimeout<T>(p: Promise<T>, ms: number): Promise<T> {
  return new Promise((resolve, reject) => {
    const t = setTimeout(() => reject(new Error('timed out')), ms);
    p.then(resolve, reject).finally(() => clearTimeout(t));
  });
}

async function waitGone(pid: number, ms: number): Promise<void> {
  const deadline = Date.now() + ms;
  while (Date.now() < deadline) {
    const stat = await readFile(`/proc/${pid}/stat`, 'utf8').catch(() => '');
    // Gone, or a zombie of an edge that spawned it (reaped by Node).
    if (!stat || / Z /.test(stat)) return;
    await new Promise((r) => setTimeout(r, 20));
  }
}

async function findProcesses(name: string): Promise<number[]> {
  const found: number[] = [];
  for (const entry of await readdir('/proc')) {
    if (!/^\d+$/.test(entry)) continue;
    if (await isQemuOf(Number(entry), name)) found.push(Number(entry));
  }
  return found;
}
