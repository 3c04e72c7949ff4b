import {
  chmodSync,
  closeSync,
  constants,
  fstatSync,
  fchmodSync,
  mkdirSync,
  openSync,
  statSync,
} from 'node:fs';
import Database from 'better-sqlite3';

/**
 * Modes of the state the platform keeps on the host (docs/adr/0010-private-host-state.md).
 * Other host users must reach none of it: databases hold projects, key hashes,
 * audit events and command output; sandbox directories hold what agents wrote.
 *
 * - `PRIVATE_FILE_MODE` (0600): databases and their -wal/-shm, keys, secrets.
 * - `PRIVATE_DIR_MODE` (0700): every directory nothing unprivileged must enter.
 * - `TRAVERSE_DIR_MODE` (0711): only the directories on the path from `/` down
 *   to a sandbox's root filesystem, which the sandbox's mapped root (an
 *   unprivileged host uid) must walk through while its runtime starts it.
 *   Execute without read: it can pass through, nobody can list them, and
 *   every file in them is itself 0600 or in a 0700 directory.
 */
export const PRIVATE_FILE_MODE = 0o600;
export const PRIVATE_DIR_MODE = 0o700;
export const TRAVERSE_DIR_MODE = 0o711;

/**
 * Makes `dir` (and missing parents) with exactly `mode`. `mkdir` creates it
 * with `mode` minus the umask, never more open than asked, so there is no
 * window in which another user can get in; the `chmod` that follows only adds
 * back bits a strict umask removed (0711's execute bits), or tightens a
 * directory an older release left open.
 */
export function ensureDir(dir: string, mode: number): void {
  mkdirSync(dir, { recursive: true, mode });
  if ((statSync(dir).mode & 0o7777) !== mode) chmodSync(dir, mode);
}

/**
 * Creates `file` empty with mode 0600 if it is missing (`O_CREAT` with that
 * mode: private from its first instant); an existing file another release
 * left open is set to 0600.
 */
export function ensurePrivateFile(file: string): void {
  const fd = openSync(
    file,
    constants.O_WRONLY | constants.O_CREAT | constants.O_APPEND,
    PRIVATE_FILE_MODE,
  );
  try {
    if ((fstatSync(fd).mode & 0o7777) !== PRIVATE_FILE_MODE) fchmodSync(fd, PRIVATE_FILE_MODE);
  } finally {
    closeSync(fd);
  }
}

/** Files SQLite keeps beside a database; it creates them with the database file's mode. */
const SQLITE_SIDE_FILES = ['-wal', '-shm', '-journal'];

/**
 * Opens a SQLite database that only root can read. The file is made 0600
 * before SQLite opens it (SQLite would create it 0644), so the -wal and -shm
 * files SQLite creates later inherit 0600; side files an older release left
 * readable are tightened first. `:memory:` opens as usual.
 */
export function openPrivateDatabase(file: string): Database.Database {
  if (file !== ':memory:' && file !== '') {
    ensurePrivateFile(file);
    for (const suffix of SQLITE_SIDE_FILES) {
      try {
        chmodSync(file + suffix, PRIVATE_FILE_MODE);
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code !== 'ENOENT') throw err;
      }
    }
  }
  return new Database(file);
}
