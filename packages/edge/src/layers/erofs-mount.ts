import { execFile } from 'node:child_process';
import { mkdir, readFile, rm, writeFile } from 'node:fs/promises';
import { release, tmpdir } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { DsecError } from '@dsec/core';
import { mountErofs, unmount } from '@dsec/native';

const execFileAsync = promisify(execFile);

/**
 * How layers are mounted: `file` hands the image file to the kernel directly
 * (file-backed EROFS, Linux 6.12+); `loop` goes through a read-only loop
 * device per file that clears itself when the mount goes (older kernels:
 * Debian 12's 6.1, Ubuntu 22.04/24.04). `auto` probes at edge start.
 */
export type ErofsMountMode = 'file' | 'loop';
export type ErofsMountSetting = ErofsMountMode | 'auto';

export const EROFS_MOUNT_SETTINGS: readonly ErofsMountSetting[] = ['auto', 'file', 'loop'];

/** The environment variable that forces a mode where no option does (CI runs the container tests with `loop`). */
export const EROFS_MOUNT_ENV = 'DSEC_EROFS_MOUNT';

export function parseErofsMountSetting(value: string, field = 'erofsMount'): ErofsMountSetting {
  if ((EROFS_MOUNT_SETTINGS as readonly string[]).includes(value))
    return value as ErofsMountSetting;
  throw new DsecError(
    'invalid_argument',
    `${field}: want one of ${EROFS_MOUNT_SETTINGS.join(', ')}, got ${JSON.stringify(value)}`,
    { field },
  );
}

/** `DSEC_EROFS_MOUNT` from `env`, when set and not empty. */
export function erofsMountFromEnv(
  env: NodeJS.ProcessEnv = process.env,
): ErofsMountSetting | undefined {
  const value = env[EROFS_MOUNT_ENV];
  return value ? parseErofsMountSetting(value, EROFS_MOUNT_ENV) : undefined;
}

/** What one probe of this host found; `fileError`/`loopError` say why a way failed. */
export interface ErofsProbe {
  file: boolean;
  loop: boolean;
  fileError?: string;
  loopError?: string;
}

/** The mount operations a probe uses (the native helper in production). */
export interface ProbeMounter {
  mountErofs(image: string, target: string, options: { loop?: boolean }): Promise<void>;
  unmount(targets: string[], options?: { detach?: boolean }): Promise<void>;
}

const PROBE_TEXT = 'dsec erofs probe\n';

/**
 * Builds a one-file EROFS image under `dir` and mounts it each way, reading
 * the file back. `dir` is the probe's own: whatever an interrupted probe left
 * there (a mount, files) is removed first, and everything is removed after.
 * Needs `mkfs.erofs` and root.
 */
export async function probeErofsMount(
  dir: string,
  options: { ways?: ErofsMountMode[]; mounter?: ProbeMounter } = {},
): Promise<ErofsProbe> {
  const mounter = options.mounter ?? { mountErofs, unmount };
  const ways = options.ways ?? ['file', 'loop'];
  const mnt = join(dir, 'mnt');
  const cleanUp = async () => {
    await mounter.unmount([mnt], { detach: true }).catch(() => undefined);
    await rm(dir, { recursive: true, force: true });
  };
  await cleanUp();
  const result: ErofsProbe = { file: false, loop: false };
  try {
    await mkdir(join(dir, 'src'), { recursive: true, mode: 0o700 });
    await mkdir(mnt);
    await writeFile(join(dir, 'src', 'probe'), PROBE_TEXT);
    await execFileAsync('mkfs.erofs', ['--quiet', join(dir, 'image'), join(dir, 'src')]);
    for (const way of ways) {
      try {
        await mounter.mountErofs(join(dir, 'image'), mnt, { loop: way === 'loop' });
        try {
          const text = await readFile(join(mnt, 'probe'), 'utf8');
          if (text !== PROBE_TEXT) throw new Error(`read back ${JSON.stringify(text)}`);
        } finally {
          await mounter.unmount([mnt]);
        }
        result[way] = true;
      } catch (err) {
        result[way === 'file' ? 'fileError' : 'loopError'] = errorText(err);
      }
    }
  } finally {
    await cleanUp();
  }
  return result;
}

/** The running kernel's version as [major, minor] (0, 0 when unreadable). */
export function kernelVersion(text = release()): [number, number] {
  const m = /^(\d+)\.(\d+)/.exec(text);
  return m ? [Number(m[1]), Number(m[2])] : [0, 0];
}

/** File-backed EROFS mounts arrived in Linux 6.12. */
export function kernelHasFileBackedErofs(version = kernelVersion()): boolean {
  return version[0] > 6 || (version[0] === 6 && version[1] >= 12);
}

/**
 * The mode an edge uses: `setting` when it names one, else the probe's
 * verdict (file-backed where it works: no loop device per layer). Without
 * `mkfs.erofs` the kernel version decides. Fails when neither way works.
 */
export async function resolveErofsMount(
  setting: ErofsMountSetting,
  options: {
    probeDir: string;
    mounter?: ProbeMounter;
    log?: ((msg: string, fields?: Record<string, unknown>) => void) | undefined;
  },
): Promise<ErofsMountMode> {
  if (setting !== 'auto') return setting;
  let probe: ErofsProbe;
  try {
    const mounter = options.mounter ? { mounter: options.mounter } : {};
    // The loop way is only tried where the file-backed one fails (one mount per start).
    probe = await probeErofsMount(options.probeDir, { ...mounter, ways: ['file'] });
    if (!probe.file) {
      const loop = await probeErofsMount(options.probeDir, { ...mounter, ways: ['loop'] });
      probe = {
        ...probe,
        loop: loop.loop,
        ...(loop.loopError ? { loopError: loop.loopError } : {}),
      };
    }
  } catch (err) {
    const mode = kernelHasFileBackedErofs() ? 'file' : 'loop';
    options.log?.('EROFS mount probe could not run; choosing by kernel version', {
      mode,
      kernel: release(),
      error: errorText(err),
    });
    return mode;
  }
  if (probe.file) return 'file';
  if (probe.loop) {
    options.log?.('file-backed EROFS mounts fail here; layers mount through loop devices', {
      kernel: release(),
      error: probe.fileError,
    });
    return 'loop';
  }
  throw new DsecError(
    'internal',
    `EROFS layers cannot be mounted on this host (kernel ${release()}): file-backed: ${probe.fileError}; loop device: ${probe.loopError}. Run \`dsec doctor\`.`,
  );
}

function errorText(err: unknown): string {
  return err instanceof Error ? err.message : String(err);
}

/**
 * `{ mountErofs, unmount }` for code outside an edge that mounts layers
 * (image collapse, imports, benches): the mode is resolved on the first
 * mount, from `setting` (default `DSEC_EROFS_MOUNT`, else a probe in
 * `probeDir`, default a directory of this process under the temp dir).
 */
export function hostErofsMounter(
  options: {
    probeDir?: string;
    setting?: ErofsMountSetting | undefined;
    log?: ((msg: string, fields?: Record<string, unknown>) => void) | undefined;
  } = {},
): {
  mountErofs(
    image: string,
    target: string,
    mountOptions?: { blobDevice?: string; signal?: AbortSignal },
  ): Promise<void>;
  unmount(targets: string[], unmountOptions?: { detach?: boolean }): Promise<void>;
} {
  let mode: Promise<ErofsMountMode> | undefined;
  return {
    async mountErofs(image, target, mountOptions = {}) {
      mode ??= resolveErofsMount(options.setting ?? erofsMountFromEnv() ?? 'auto', {
        probeDir: options.probeDir ?? join(tmpdir(), `dsec-erofs-probe-${process.pid}`),
        log: options.log,
      });
      const resolved = await mode.catch((err: unknown) => {
        mode = undefined;
        throw err;
      });
      await mountErofs(image, target, { ...mountOptions, loop: resolved === 'loop' });
    },
    unmount: (targets, unmountOptions) => unmount(targets, unmountOptions),
  };
}
