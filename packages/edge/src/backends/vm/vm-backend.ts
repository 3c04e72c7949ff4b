import {
  chmodSync,
  chownSync,
  closeSync,
  constants,
  existsSync,
  mkdirSync,
  openSync,
  rmSync,
} from 'node:fs';
import { open, readdir, readFile, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { DsecError, validateDisplayInput } from '@dsec/core';
import type { DisplayInput, ImageStore } from '@dsec/core';
import type { CgroupDriver } from '../../cgroups/cgroup-driver.js';
import type { LayerMountCache } from '../../layers/layer-cache.js';
import { runTool } from '../../network/sys.js';
import type { Backend, BackendSandbox, PauseResult, StartedSandbox } from '../backend.js';
import type { SandboxChannel } from '../channel.js';
import {
  accelArgs,
  probeAccel,
  QEMU_BINARY,
  type Accel,
  type MicrovmAssets,
} from '../microvm/assets.js';
import {
  isQemuOf,
  killQuietly,
  makeQemuCgroup,
  qemuJailArgs,
  spawnQemu,
} from '../microvm/qemu-cgroup.js';
import { MicrovmBackend, type MicrovmBackendOptions } from '../microvm/microvm-backend.js';
import { connectMicrovm, netCmdline, tapArgs } from '../microvm/network.js';
import { finishRestore } from '../microvm/pause.js';
import { QmpClient } from '../microvm/qmp.js';
import { makeScratchDisk } from '../scratch-disk.js';
import type { VmImage } from './image.js';
import { pngSize, textToEvents, toQmpEvents, type QmpInputEvent } from './keys.js';

/** Each sandbox's hypervisor runs as its own host uid/gid (the same range per slot as the other backends). */
const ID_BASE = 100_000;
const ID_COUNT = 65_536;
/** Port 0 is the shared channel, 1…7 the dedicated ones (what MicrovmBackend's channel code expects). */
const AGENT_PORTS = 8;
/** Host memory of QEMU on top of guest RAM (TCG's translation cache, VGA memory, devices). */
const QEMU_OVERHEAD_MB = 192;
/** A whole Debian with X does not come up in less. */
const MIN_MEMORY_MB = 384;
/** Writable disk when the spec names no disk limit (sparse: only what is written takes space). */
const DEFAULT_DISK_MB = 4096;
/** At most this many layers (drives) per sandbox, as the microVM's agent mounts. */
const MAX_LAYERS = 24;
const STOP_WAIT_MS = 5_000;
/**
 * Pause between typed characters: the guest's virtio keyboard has a short
 * queue and QEMU drops events the guest has not taken yet; under TCG the
 * guest drains it only every few milliseconds.
 */
const KEY_GAP_MS = 15;
/** The screen's size in pixels. */
export const SCREEN = { width: 1280, height: 800 } as const;

export interface VmBackendOptions {
  /** Per-sandbox directories (overlay, sockets, console log). */
  dir: string;
  image: VmImage;
  /** The microVM kernel and initramfs, when built: the KVM probe boots them (as the microVM backend's does). */
  probeAssets?: MicrovmAssets | undefined;
  store: ImageStore;
  layers: Pick<LayerMountCache, 'acquire' | 'release'>;
  cgroups: CgroupDriver;
  /**
   * The edge's network manager: a VM whose spec opens something gets a tap
   * under its firewall elements and resolver, as a microVM (microvm/network.ts).
   */
  network?: MicrovmBackendOptions['network'];
  cgroupParent: string;
  qemuBinary?: string | undefined;
  accel?: Accel | undefined;
  /** From QEMU's start to the agent answering. Default: 60 s with KVM, 600 s with TCG. */
  bootTimeoutMs?: number | undefined;
  log?: ((msg: string, fields?: Record<string, unknown>) => void) | undefined;
}

/**
 * Full-VM sandboxes (`backend: 'vm'`, paper 2.2 and 8.4): QEMU's q35
 * machine boots the Debian disk image build-image.sh makes (its own kernel
 * and initramfs, booted directly), through a qcow2 overlay per sandbox on
 * the read-only base, with a display (std VGA, Xorg, one xterm), a virtio
 * keyboard and tablet, and the DSec guest agent as a systemd service on
 * virtio-serial ports. The channel is the microVM backend's (the same
 * agent, the same ports and sockets), so commands, sessions and files work
 * exactly as there; this backend adds the machine, the display and input.
 *
 * The sandbox's root is the spec's image, as in a container or microVM:
 * its EROFS layers are read-only virtio disks and the writable layer an
 * ext4 disk of the disk limit, which the image's `dsec-root` service joins
 * under an overlay; the agent and the xterm's shell run chroot'ed in it,
 * under the spec's pids limit (a guest cgroup). The VM's own Debian only
 * provides the kernel, X and the agent (docs/vm.md).
 *
 * Jail: QEMU runs in the sandbox's cgroup (memory, CPU, pids), drops to the
 * sandbox's own uid after opening its files (`-runas`), under QEMU's
 * seccomp filter. Network as a microVM's: a tap under the sandbox's
 * nftables elements and resolver when its spec opens something, else no
 * network device. Pause saves the machine into a file and ends QEMU (the
 * microVM's pause.ts); resume boots it from that file.
 */
export class VmBackend implements Backend {
  readonly kind = 'vm' as const;
  /** Channel, stop, adoption and memory: the microVM backend's code, on this backend's directories. */
  readonly #vm: MicrovmBackend;
  readonly #qmp = new Map<string, Promise<QmpClient>>();
  #accel: Promise<Accel> | undefined;

  readonly #screens: string;

  constructor(readonly options: VmBackendOptions) {
    this.#screens = `${options.dir}-screens`;
    mkdirSync(this.#screens, { recursive: true, mode: 0o711 });
    chmodSync(this.#screens, 0o711);
    this.#vm = new MicrovmBackend({
      dir: options.dir,
      // Never booted by it: only its channel and teardown code run here.
      assets: options.probeAssets ?? { kernel: '', initramfs: '', version: '' },
      store: options.store,
      layers: options.layers,
      cgroups: options.cgroups,
      network: options.network,
      cgroupParent: options.cgroupParent,
      qemuBinary: options.qemuBinary,
      log: options.log,
    });
  }

  /** KVM when the microVM probe boots under it, else TCG (decided once). */
  accel(): Promise<Accel> {
    this.#accel ??= (async () => {
      if (this.options.accel) return this.options.accel;
      const a = this.options.probeAssets ? await probeAccel(this.options.probeAssets) : 'tcg';
      this.options.log?.('vm accelerator', { accel: a });
      return a;
    })();
    return this.#accel;
  }

  paths(rec: Pick<BackendSandbox, 'id'>) {
    const p = this.#vm.paths(rec);
    return {
      ...p,
      overlay: join(p.dir, 'root.qcow2'),
      qmp: join(p.dir, 'qmp.sock'),
      /**
       * A second monitor, for screenshots and input only: QEMU's monitor
       * serves one client at a time, and the microVM code's (pause, port
       * hot-plug) must never wait behind a long typed text.
       */
      displayQmp: join(p.dir, 'display-qmp.sock'),
      /**
       * The one directory QEMU may write to after dropping to the sandbox's
       * uid (screendumps): outside the sandbox's own directory (which QEMU
       * may cross, not list, to reach its migrate/ directory when paused),
       * in a parent any uid may cross but not list.
       */
      screen: join(this.#screens, p.name),
    };
  }

  /**
   * `restore` (from `resume`): the same machine with `-incoming` from the
   * saved state, stopped until it is loaded (pause.ts finishRestore); the
   * overlay, writable disk, cgroup, tap and layer references are the paused
   * sandbox's own.
   */
  async start(
    rec: BackendSandbox,
    signal?: AbortSignal,
    restore?: { stateFd: number },
  ): Promise<StartedSandbox> {
    if (rec.spec.memoryLimitMb < MIN_MEMORY_MB) {
      throw new DsecError(
        'invalid_argument',
        `a vm sandbox needs at least ${MIN_MEMORY_MB} MiB of memory`,
        { field: 'memoryLimitMb' },
      );
    }
    const p = this.paths(rec);
    const hostId = ID_BASE + rec.slot * ID_COUNT;
    mkdirSync(p.dir, { recursive: true, mode: 0o711 });
    if (!restore) {
      rmSync(p.screen, { recursive: true, force: true });
      mkdirSync(p.screen, { mode: 0o700 });
      chownSync(p.screen, hostId, hostId);
      for (const layer of rec.layers) await this.options.layers.acquire(layer);
    }
    // Top layer first (dsec-root stacks them in disk order); identical layers once.
    const digests = [...new Set([...rec.layers].reverse().map((l) => l.digest))];
    if (digests.length === 0 || digests.length > MAX_LAYERS) {
      throw new DsecError(
        'invalid_argument',
        `a vm sandbox's image has 1 to ${MAX_LAYERS} layers, not ${digests.length}`,
        { field: 'image' },
      );
    }
    const img = this.options.image;
    const [layerFiles, accel] = await Promise.all([
      Promise.all(digests.map((d) => this.options.store.blobPath(d, { signal }))),
      this.accel(),
      restore
        ? undefined
        : // The base stays read-only and shared; the VM's Debian writes only to its overlay.
          runTool('qemu-img', [
            'create',
            '-q',
            '-f',
            'qcow2',
            '-F',
            'raw',
            '-b',
            img.disk,
            p.overlay,
          ]),
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
    // QEMU reopens its writable disks by path when a migration (pause) hands
    // them over and when a restore takes them back, as its own uid by then.
    chownSync(p.overlay, hostId, hostId);
    chownSync(p.disk, hostId, hostId);
    // A tap under the sandbox's firewall elements when its spec opens something.
    const link = await connectMicrovm(this.options.network, rec, {
      ownerUid: hostId,
      dir: p.dir,
      restore: Boolean(restore),
    });
    const cmdline = [
      img.cmdline,
      `dsec.layers=${layerFiles.length}`,
      `dsec.pids=${rec.spec.pidsLimit}`,
      ...(link ? netCmdline(link) : []),
    ].join(' ');
    const args = [
      '-name',
      p.name,
      '-M',
      'q35',
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
      img.kernel,
      '-initrd',
      img.initrd,
      '-append',
      cmdline,
      '-serial',
      `file:${p.console}`,
      '-device',
      // The mode the guest's EDID prefers; the image's xterm is sized for it (build-image.sh).
      `VGA,vgamem_mb=16,xres=${SCREEN.width},yres=${SCREEN.height}`,
      '-device',
      'virtio-keyboard-pci',
      '-device',
      'virtio-tablet-pci',
      // The root first: the guest names it vda (root=/dev/vda); the others by serial.
      '-drive',
      `file=${p.overlay},if=none,id=root,format=qcow2,cache=unsafe,discard=unmap`,
      '-device',
      'virtio-blk-pci,drive=root',
      ...layerFiles.flatMap((file, i) => [
        '-drive',
        `file=${file},if=none,id=l${i},format=raw,readonly=on`,
        '-device',
        `virtio-blk-pci,drive=l${i},serial=dsec-l${i}`,
      ]),
      '-drive',
      `file=${p.disk},if=none,id=rw,format=raw,cache=unsafe,discard=unmap`,
      '-device',
      'virtio-blk-pci,drive=rw,serial=dsec-rw',
      // The microVM's NIC on q35's PCI bus instead of virtio-mmio.
      ...(link
        ? tapArgs(link).map((a) => a.replace(/^virtio-net-device,/, 'virtio-net-pci,'))
        : []),
      '-device',
      `virtio-serial-pci,max_ports=${AGENT_PORTS + 1}`,
      ...Array.from({ length: AGENT_PORTS }, (_, i) => [
        '-chardev',
        `socket,id=c${i},path=${p.port(i)},server=on,wait=off`,
        '-device',
        // All present at boot, under the ids the microVM backend hot-plugs
        // (its `device_add` of a present one is answered `Duplicate device ID`).
        `virtserialport,chardev=c${i},nr=${i + 1},name=dsec.${i},id=dsec-port-${i}`,
      ]).flat(),
      '-qmp',
      `unix:${p.qmp},server=on,wait=off`,
      '-chardev',
      `socket,id=display,path=${p.displayQmp},server=on,wait=off`,
      '-mon',
      'chardev=display,mode=control',
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
      what: 'VM',
    });
    try {
      const timeoutMs = this.options.bootTimeoutMs ?? (accel === 'kvm' ? 60_000 : 600_000);
      const started = { initPid: pid, chronusPid: pid };
      if (restore) await Promise.race([exited, finishRestore(p, timeoutMs)]);
      await Promise.race([exited, this.#waitForAgent(rec, started, timeoutMs, signal)]);
      return started;
    } catch (err) {
      killQuietly(pid);
      throw err;
    }
  }

  /** The agent answers once systemd started it (the display comes up on its own). */
  async #waitForAgent(
    rec: BackendSandbox,
    started: StartedSandbox,
    timeoutMs: number,
    signal?: AbortSignal,
  ): Promise<void> {
    const deadline = Date.now() + timeoutMs;
    const live = { ...rec, ...started };
    for (;;) {
      signal?.throwIfAborted();
      const left = deadline - Date.now();
      if (left <= 0)
        throw new DsecError('deadline_exceeded', `the VM did not boot in ${timeoutMs} ms`);
      try {
        const ch = await this.#vm.channel(live);
        const h = ch.spawn({ argv: ['true'], shell: true });
        const exit = await Promise.race([
          h.exited,
          new Promise<never>((_, reject) =>
            setTimeout(() => reject(new Error('timeout')), Math.min(left, 5_000)).unref(),
          ),
        ]);
        if (exit.exitCode === 0) return;
      } catch {
        await new Promise((r) => setTimeout(r, 250));
      }
    }
  }

  async stop(rec: BackendSandbox): Promise<void> {
    this.#dropQmp(rec.id);
    await this.#vm.stop(rec);
    rmSync(this.paths(rec).screen, { recursive: true, force: true });
  }

  isRunning(rec: BackendSandbox): Promise<boolean> {
    return this.#vm.isRunning(rec);
  }

  /**
   * Pause (paper 6.3): the machine's memory and device state go to a file
   * and QEMU exits, as a microVM's (the save path is machine-neutral: QMP
   * `migrate` into the edge's file, pause.ts). Idempotent.
   */
  pause(rec: BackendSandbox): Promise<PauseResult> {
    // The display's monitor goes with the process.
    this.#dropQmp(rec.id);
    return this.#vm.pause(rec);
  }

  /** Boots the paused machine from its state (this backend's q35 machine, `-incoming`). */
  async resume(rec: BackendSandbox): Promise<{ chronusPid?: number | undefined }> {
    const p = this.paths(rec);
    const pid = await qemuPid(rec, p.name);
    if (!existsSync(p.state)) {
      if (pid === undefined)
        throw new DsecError('sandbox_not_running', `the VM of sandbox ${rec.id} is gone`);
      return {}; // running (or resumed by a resume a crash interrupted after `cont`)
    }
    // A restore a crash interrupted before `cont`: start it over.
    if (pid !== undefined) await killAndWait(pid);
    // (The edge's channels to the old process went with the pause.)
    this.#dropQmp(rec.id);
    const fd = openSync(p.state, 'r');
    try {
      const started = await this.start(rec, undefined, { stateFd: fd });
      return { chronusPid: started.chronusPid };
    } finally {
      closeSync(fd);
    }
  }

  isFrozen(rec: BackendSandbox): Promise<boolean> {
    return this.#vm.isFrozen(rec);
  }

  ensureChronus(rec: BackendSandbox): Promise<number | undefined> {
    return this.#vm.ensureChronus(rec);
  }

  channel(rec: BackendSandbox, options?: { dedicated?: boolean }): Promise<SandboxChannel> {
    return this.#vm.channel(rec, options);
  }

  oomKilled(rec: BackendSandbox): Promise<boolean> {
    return this.#vm.oomKilled(rec);
  }

  memoryBytes(rec: BackendSandbox): Promise<number | undefined> {
    return this.#vm.memoryBytes(rec);
  }

  /** A PNG of the screen now (QMP `screendump` into the sandbox's own screen directory). */
  async screenshot(rec: BackendSandbox): Promise<Buffer> {
    const p = this.paths(rec);
    const file = join(
      p.screen,
      `shot-${process.pid}-${Date.now()}-${Math.random().toString(36).slice(2)}.png`,
    );
    try {
      await (
        await this.#client(rec)
      ).execute('screendump', { filename: file, format: 'png' }, { timeoutMs: 30_000 });
      return await readOwnFile(file, ID_BASE + rec.slot * ID_COUNT);
    } finally {
      await rm(file, { force: true });
    }
  }

  /** Keys and pointer events, in order (QMP `input-send-event`). */
  async input(rec: BackendSandbox, input: DisplayInput): Promise<void> {
    validateDisplayInput(input);
    let groups: QmpInputEvent[][];
    if ('text' in input) groups = textToEvents(input.text);
    else {
      const needsSize = input.events.some((e) => e.type === 'move');
      const screen = needsSize ? pngSize(await this.screenshot(rec)) : { width: 1, height: 1 };
      groups = toQmpEvents(input.events, screen);
    }
    const qmp = await this.#client(rec);
    for (const [i, events] of groups.entries()) {
      if (i > 0) await new Promise((r) => setTimeout(r, KEY_GAP_MS));
      await qmp.execute('input-send-event', { events });
    }
  }

  async close(): Promise<void> {
    for (const id of [...this.#qmp.keys()]) this.#dropQmp(id);
    await this.#vm.close();
  }

  #client(rec: BackendSandbox): Promise<QmpClient> {
    const cached = this.#qmp.get(rec.id);
    if (cached) {
      return cached.then(
        (c) => (c.closed ? this.#connectQmp(rec) : c),
        () => this.#connectQmp(rec),
      );
    }
    return this.#connectQmp(rec);
  }

  #connectQmp(rec: BackendSandbox): Promise<QmpClient> {
    const path = this.paths(rec).displayQmp;
    if (!existsSync(path)) {
      return Promise.reject(
        new DsecError('sandbox_not_running', `the VM of sandbox ${rec.id} is gone`),
      );
    }
    const c = QmpClient.connect(path);
    this.#qmp.set(rec.id, c);
    c.catch(() => this.#qmp.get(rec.id) === c && this.#qmp.delete(rec.id));
    return c;
  }

  #dropQmp(id: string): void {
    const c = this.#qmp.get(id);
    this.#qmp.delete(id);
    void c?.then(
      (q) => q.close(),
      () => undefined,
    );
  }
}

/** The sandbox's QEMU: the recorded one, else found by its `-name` (a resume a crash interrupted). */
async function qemuPid(rec: BackendSandbox, name: string): Promise<number | undefined> {
  for (const pid of new Set([rec.chronusPid, rec.initPid]))
    if (pid !== undefined && (await isQemuOf(pid, name))) return pid;
  for (const entry of await readdir('/proc')) {
    if (/^\d+$/.test(entry) && (await isQemuOf(Number(entry), name))) return Number(entry);
  }
  return undefined;
}

async function killAndWait(pid: number): Promise<void> {
  try {
    process.kill(pid, 'SIGKILL');
  } catch {
    return; // already gone
  }
  const deadline = Date.now() + STOP_WAIT_MS;
  while (Date.now() < deadline) {
    const stat = await readFile(`/proc/${pid}/stat`, 'utf8').catch(() => '');
    if (!stat || / Z /.test(stat)) return;
    await new Promise((r) => setTimeout(r, 20));
  }
}

/**
 * Reads a file the sandbox's QEMU wrote, as root, without following what
 * a compromised QEMU could have put there instead: no symlink (O_NOFOLLOW),
 * a regular file with one link, owned by the sandbox's uid.
 */
async function readOwnFile(file: string, uid: number): Promise<Buffer> {
  const fh = await open(file, constants.O_RDONLY | constants.O_NOFOLLOW | constants.O_NONBLOCK);
  try {
    const st = await fh.stat();
    if (!st.isFile() || st.nlink !== 1 || st.uid !== uid) {
      throw new DsecError('internal', 'the screendump is not a file of the sandbox');
    }
    return await fh.readFile();
  } finally {
    await fh.close();
  }
}
