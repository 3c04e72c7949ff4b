import { spawn } from 'node:child_process';
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
import { open, readFile, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { DsecError, validateDisplayInput } from '@dsec/core';
import type { DisplayInput, ImageStore } from '@dsec/core';
import type { CgroupDriver } from '../../cgroups/cgroup-driver.js';
import type { LayerMountCache } from '../../layers/layer-cache.js';
import { runTool } from '../../network/sys.js';
import type { Backend, BackendSandbox, StartedSandbox } from '../backend.js';
import type { SandboxChannel } from '../channel.js';
import {
  accelArgs,
  probeAccel,
  QEMU_BINARY,
  type Accel,
  type MicrovmAssets,
} from '../microvm/assets.js';
import { makeQemuCgroup } from '../microvm/qemu-cgroup.js';
import { MicrovmBackend, type MicrovmBackendOptions } from '../microvm/microvm-backend.js';
import { QmpClient } from '../microvm/qmp.js';
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
  /** Released at stop like the microVM's (a VM has no network device yet). */
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
 * The image's own OS is the sandbox's root: the spec's image layers are
 * not mounted (they are referenced while the sandbox runs, as for every
 * backend, so the edge's accounting balances).
 *
 * Jail: QEMU runs in the sandbox's cgroup (memory, CPU, pids), drops to the
 * sandbox's own uid after opening its files (`-runas`), under QEMU's
 * seccomp filter; no network device.
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
       * The one directory QEMU may write to after dropping to the sandbox's
       * uid (screendumps): outside the sandbox's own directory, which only
       * root may enter, in a parent any uid may cross but not list.
       */
      screen: join(this.#screens, p.name),
    };
  }

  async start(rec: BackendSandbox, signal?: AbortSignal): Promise<StartedSandbox> {
    if (rec.spec.networkAllow?.length || Object.values(rec.spec.networkRules).some(Boolean)) {
      throw new DsecError(
        'invalid_argument',
        'vm sandboxes have no network yet: egress rules need the container backend',
        { field: 'networkRules' },
      );
    }
    if (rec.spec.memoryLimitMb < MIN_MEMORY_MB) {
      throw new DsecError(
        'invalid_argument',
        `a vm sandbox needs at least ${MIN_MEMORY_MB} MiB of memory`,
        { field: 'memoryLimitMb' },
      );
    }
    const p = this.paths(rec);
    const hostId = ID_BASE + rec.slot * ID_COUNT;
    mkdirSync(p.dir, { recursive: true, mode: 0o700 });
    rmSync(p.screen, { recursive: true, force: true });
    mkdirSync(p.screen, { mode: 0o700 });
    chownSync(p.screen, hostId, hostId);
    for (const layer of rec.layers) await this.options.layers.acquire(layer);
    const img = this.options.image;
    // The base stays read-only and shared; the sandbox writes only to its overlay.
    await runTool('qemu-img', [
      'create',
      '-q',
      '-f',
      'qcow2',
      '-F',
      'raw',
      '-b',
      img.disk,
      p.overlay,
    ]);
    const [accel] = await Promise.all([
      this.accel(),
      makeQemuCgroup(this.options.cgroups, p.cgroupsPath, {
        memoryMb: rec.spec.memoryLimitMb + QEMU_OVERHEAD_MB,
        cpuCores: rec.spec.cpuCoresLimit,
      }),
    ]);
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
      img.cmdline,
      '-serial',
      `file:${p.console}`,
      '-device',
      // The mode the guest's EDID prefers; the image's xterm is sized for it (build-image.sh).
      `VGA,vgamem_mb=16,xres=${SCREEN.width},yres=${SCREEN.height}`,
      '-device',
      'virtio-keyboard-pci',
      '-device',
      'virtio-tablet-pci',
      '-drive',
      `file=${p.overlay},if=none,id=root,format=qcow2,cache=unsafe,discard=unmap`,
      '-device',
      'virtio-blk-pci,drive=root',
      '-device',
      `virtio-serial-pci,max_ports=${AGENT_PORTS + 1}`,
      ...Array.from({ length: AGENT_PORTS }, (_, i) => [
        '-chardev',
        `socket,id=c${i},path=${p.port(i)},server=on,wait=off`,
        '-device',
        `virtserialport,chardev=c${i},nr=${i + 1},name=dsec.${i}`,
      ]).flat(),
      '-qmp',
      `unix:${p.qmp},server=on,wait=off`,
      // As the microVM: the sandbox's own uid after opening its files, then
      // QEMU's seccomp filter (no exec or fork, no obsolete or scheduler syscalls).
      '-runas',
      `${hostId}:${hostId}`,
      '-sandbox',
      'on,obsolete=deny,spawn=deny,resourcecontrol=deny',
    ];
    const procs = this.options.cgroups.dirs(p.cgroupsPath).map((d) => join(d, 'cgroup.procs'));
    const log = openSync(join(p.dir, 'qemu.log'), 'a', 0o600);
    let pid: number | undefined;
    try {
      const child = spawn(
        '/bin/sh',
        [
          '-c',
          'for f in $DSEC_PROCS; do echo $$ > "$f" || exit 97; done; exec "$@"',
          'dsec-vm',
          this.options.qemuBinary ?? QEMU_BINARY,
          ...args,
        ],
        {
          detached: true,
          stdio: ['ignore', log, log],
          env: { PATH: process.env.PATH ?? '/usr/bin:/bin', DSEC_PROCS: procs.join(' ') },
        },
      );
      child.unref();
      pid = child.pid;
      if (pid === undefined) throw new DsecError('unavailable', 'cannot start qemu');
      const exited = new Promise<never>((_, reject) =>
        child.once(
          'exit',
          (code, sig) =>
            void tail(join(p.dir, 'qemu.log'), p.console).then((t) =>
              reject(
                new DsecError('unavailable', `the VM exited while booting (${code ?? sig}): ${t}`),
              ),
            ),
        ),
      );
      exited.catch(() => undefined);
      const timeoutMs = this.options.bootTimeoutMs ?? (accel === 'kvm' ? 60_000 : 600_000);
      const started = { initPid: pid, chronusPid: pid };
      await Promise.race([exited, this.#waitForAgent(rec, started, timeoutMs, signal)]);
      return started;
    } catch (err) {
      if (pid !== undefined) {
        try {
          process.kill(pid, 'SIGKILL');
        } catch {
          // already gone
        }
      }
      throw err;
    } finally {
      closeSync(log);
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
    const path = this.paths(rec).qmp;
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

async function tail(...files: string[]): Promise<string> {
  const parts: string[] = [];
  for (const f of files) {
    const text = await readFile(f, 'utf8').catch(() => '');
    const t = text.trim().split('\n').slice(-3).join(' | ');
    if (t) parts.push(t);
  }
  return parts.join(' || ').slice(-600) || 'no output';
}
