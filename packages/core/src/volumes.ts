import { DsecError } from './errors.js';
import type { VolumeMount } from './types.js';

/**
 * Volume names: what a tenant picks, so it is never a path. Lower-case
 * letters, digits, `.`, `_`, `-`, starting with a letter or digit, at most
 * 63 characters, no `..`. Names are per project: project B's `data` is not
 * project A's, and the node stores a volume under a digest of both, never
 * under the name itself.
 */
export const VOLUME_NAME_RE = /^[a-z0-9][a-z0-9._-]{0,62}$/;

/** The most volumes one sandbox mounts. */
export const MAX_VOLUME_MOUNTS = 16;

/** The longest mount path inside a sandbox. */
export const MAX_VOLUME_PATH_CHARS = 512;

/** The smallest and largest volume sizes (MiB): ext4 needs some room for itself. */
export const VOLUME_SIZE_MB = { min: 16, max: 1_048_576 } as const;

/** Paths the platform mounts itself: a volume may be neither on nor under them. */
const RESERVED_PATHS = ['/proc', '/dev', '/sys'];

/** Throws `invalid_argument` (field `field`) unless `name` is a valid volume name. */
export function checkVolumeName(name: unknown, field = 'name'): asserts name is string {
  if (typeof name !== 'string' || !VOLUME_NAME_RE.test(name) || name.includes('..')) {
    throw new DsecError(
      'invalid_argument',
      `volume name must match ${VOLUME_NAME_RE.source} without '..' (got ${JSON.stringify(
        typeof name === 'string' ? name.slice(0, 80) : name,
      )})`,
      { field },
    );
  }
}

/** Throws `invalid_argument` unless `sizeMb` is an integer within `VOLUME_SIZE_MB`. */
export function checkVolumeSize(sizeMb: unknown, field = 'sizeMb'): asserts sizeMb is number {
  if (
    typeof sizeMb !== 'number' ||
    !Number.isSafeInteger(sizeMb) ||
    sizeMb < VOLUME_SIZE_MB.min ||
    sizeMb > VOLUME_SIZE_MB.max
  ) {
    throw new DsecError(
      'invalid_argument',
      `sizeMb must be an integer from ${VOLUME_SIZE_MB.min} to ${VOLUME_SIZE_MB.max}`,
      { field },
    );
  }
}

/**
 * Throws `invalid_argument` unless `path` is a normalised absolute path a
 * volume may be mounted on: no empty, `.` or `..` component, no control
 * character, not `/` and neither on nor under `/proc`, `/dev` or `/sys`.
 */
export function checkVolumePath(path: unknown, field = 'path'): asserts path is string {
  const bad = (why: string): never => {
    throw new DsecError('invalid_argument', `volume mount path ${why}`, { field });
  };
  if (typeof path !== 'string') return bad('must be a string');
  if (path.length > MAX_VOLUME_PATH_CHARS)
    bad(`is longer than ${MAX_VOLUME_PATH_CHARS} characters`);
  if (/[\u0000-\u001f\u007f]/.test(path)) bad('contains a control character');
  if (!path.startsWith('/')) bad(`must be absolute (got ${JSON.stringify(path)})`);
  if (path === '/') bad('cannot be /');
  const parts = path.slice(1).split('/');
  if (parts.some((p) => p === '' || p === '.' || p === '..'))
    bad(`must be normalised: no empty, '.' or '..' component (got ${JSON.stringify(path)})`);
  for (const r of RESERVED_PATHS)
    if (path === r || path.startsWith(`${r}/`)) bad(`cannot be on or under ${r}`);
}

/**
 * Checks a create's `volumes`: each name and path valid, at most
 * `MAX_VOLUME_MOUNTS`, no volume twice, and no path on or inside another's
 * (the mounts would shadow each other). Throws `invalid_argument` with the
 * field (`volumes.N.name`, `volumes.N.path`).
 */
export function checkVolumeMounts(mounts: readonly VolumeMount[]): void {
  if (mounts.length > MAX_VOLUME_MOUNTS) {
    throw new DsecError('invalid_argument', `at most ${MAX_VOLUME_MOUNTS} volumes per sandbox`, {
      field: 'volumes',
    });
  }
  const names = new Set<string>();
  mounts.forEach((m, i) => {
    checkVolumeName(m.name, `volumes.${i}.name`);
    checkVolumePath(m.path, `volumes.${i}.path`);
    if (names.has(m.name)) {
      throw new DsecError('invalid_argument', `volume ${m.name} is mounted twice`, {
        field: `volumes.${i}.name`,
      });
    }
    names.add(m.name);
    for (const other of mounts.slice(0, i)) {
      const [a, b] = [`${m.path}/`, `${other.path}/`];
      if (a.startsWith(b) || b.startsWith(a)) {
        throw new DsecError(
          'invalid_argument',
          `volume paths ${other.path} and ${m.path} overlap`,
          { field: `volumes.${i}.path` },
        );
      }
    }
  });
}
