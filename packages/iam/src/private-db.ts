import { chmodSync, closeSync, constants, fchmodSync, fstatSync, openSync } from 'node:fs';
import Database from 'better-sqlite3';

const PRIVATE_FILE_MODE = 0o600;

/**
 * Opens IAM's SQLite database so that only its owner (root) can read it: it
 * holds projects, key hashes and the audit log. The file is created 0600
 * (`O_CREAT` with that mode) before SQLite opens it, since SQLite would make
 * it 0644 and gives its -wal and -shm files the database file's mode; files
 * an older release left readable are set to 0600 first. `:memory:` and `''`
 * (a temporary database) open as usual. The edge opens its databases the
 * same way (`@dsec/edge` state/host-state.ts).
 */
export function openPrivateDatabase(path: string): Database.Database {
  if (path !== ':memory:' && path !== '') {
    const fd = openSync(
      path,
      constants.O_WRONLY | constants.O_CREAT | constants.O_APPEND,
      PRIVATE_FILE_MODE,
    );
    try {
      if ((fstatSync(fd).mode & 0o7777) !== PRIVATE_FILE_MODE) fchmodSync(fd, PRIVATE_FILE_MODE);
    } finally {
      closeSync(fd);
    }
    for (const suffix of ['-wal', '-shm', '-journal']) {
      try {
        chmodSync(path + suffix, PRIVATE_FILE_MODE);
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code !== 'ENOENT') throw err;
      }
    }
  }
  return new Database(path);
}
