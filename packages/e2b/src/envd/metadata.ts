import { createHash } from 'node:crypto';
import { readFile } from 'node:fs/promises';
import type { IncomingHttpHeaders } from 'node:http';
import { DsecError, toDsecError } from '@dsec/core';
import type { CommandResult } from '@dsec/core';
import { xattrToolPath } from '@dsec/native';
import { BoundedMap } from '../sandbox-access.js';
import type { OpenedSandbox } from '../sandbox-access.js';

/**
 * E2B's file metadata: `X-Metadata-<key>` on an upload, kept as the file's
 * `user.e2b.<key>` extended attributes in the sandbox and answered in its
 * entries. Sandboxes' own tools may have no xattr support (busybox has no
 * setfattr), so a small static tool (`dsec-xattr`, packages/native) is
 * copied into the sandbox the first time metadata is written there, and run
 * inside it as the caller's user like any command: every path resolves in
 * the sandbox, with that user's rights (a root-run tool would follow a
 * symlink the user swapped in for its file onto root's). It is copied and
 * run only where no one but root may change it: / and /tmp root's and
 * writable by no one else (sticky /tmp may be), the tool root's and 0755,
 * or a user could swap it for a program the next root caller runs. A
 * sandbox where it was never copied has no metadata to read, so reading
 * costs one stat of the tool until then.
 */

/** Where the tool lives in a sandbox (root's, in a sticky /tmp: users cannot swap it). */
const TOOL_DIR = '/tmp';
/** Bytes of one key (the xattr name limit less `user.e2b.`), and of all keys and values of a file. */
export const MAX_METADATA_KEY_BYTES = 246;
export const MAX_METADATA_BYTES = 4096;
/** Paths one `get` reads. */
const MAX_GET_PATHS = 10_000;
const TOOL_TIMEOUT_MS = 30_000;
const PREFIX_BYTES = 'user.e2b.'.length;

const PRINTABLE = /^[\x20-\x7e]*$/;

/**
 * The metadata an upload carries, as envd reads it: `X-Metadata-` stripped,
 * the rest lower-cased; printable ASCII only; the first of a repeated
 * header wins; at most 246 bytes a key and 4096 in all (prefix counted per
 * key). Undefined when there is none.
 */
export function uploadMetadata(
  headers: IncomingHttpHeaders,
  rawHeaders: readonly string[],
): Record<string, string> | undefined {
  if (!Object.keys(headers).some((h) => h.startsWith('x-metadata-'))) return undefined;
  const out: Record<string, string> = {};
  let total = 0;
  for (let i = 0; i + 1 < rawHeaders.length; i += 2) {
    const name = rawHeaders[i]!.toLowerCase();
    if (!name.startsWith('x-metadata-')) continue;
    const key = name.slice('x-metadata-'.length);
    const value = rawHeaders[i + 1]!;
    if (key === '' || !PRINTABLE.test(key) || !PRINTABLE.test(value)) {
      throw new DsecError(
        'invalid_argument',
        'file metadata keys and values must be printable ASCII (0x20-0x7e)',
        { field: rawHeaders[i] },
      );
    }
    if (key.length > MAX_METADATA_KEY_BYTES) {
      throw new DsecError(
        'invalid_argument',
        `a file metadata key is at most ${MAX_METADATA_KEY_BYTES} bytes`,
        { field: rawHeaders[i] },
      );
    }
    if (Object.hasOwn(out, key)) continue;
    out[key] = value;
    total += PREFIX_BYTES + key.length + value.length;
    if (total > MAX_METADATA_BYTES) {
      throw new DsecError(
        'invalid_argument',
        `file metadata is at most ${MAX_METADATA_BYTES} bytes per file (keys, values and the user.e2b. prefix per key)`,
        { field: 'X-Metadata-*' },
      );
    }
  }
  return out;
}

const hex = (s: string) => Buffer.from(s, 'latin1').toString('hex');

/** Parses `get`'s answer: a line per path, "-" or "+" with " KEY=VALUE" (hex) pairs. */
export function parseMetadataLines(
  paths: readonly string[],
  out: string,
): Map<string, Record<string, string>> {
  const lines = out.split('\n');
  const result = new Map<string, Record<string, string>>();
  paths.forEach((p, i) => {
    const line = lines[i];
    if (!line?.startsWith('+')) return;
    const meta: Record<string, string> = {};
    for (const pair of line.slice(1).split(' ')) {
      const eq = pair.indexOf('=');
      if (eq <= 0) continue;
      const key = Buffer.from(pair.slice(0, eq), 'hex').toString('latin1');
      const value = Buffer.from(pair.slice(eq + 1), 'hex').toString('latin1');
      // What the sandbox set by other means is shown only if envd would accept it.
      if (PRINTABLE.test(key) && PRINTABLE.test(value)) meta[key] = value;
    }
    result.set(p, meta);
  });
  return result;
}

export class FileMetadata {
  readonly #installed = new BoundedMap<string, true>(4096);
  #tool: Promise<{ bytes: Buffer; path: string }> | undefined;

  /** The tool's bytes and its path in sandboxes (named by its hash: a new build is a new file). */
  #load(): Promise<{ bytes: Buffer; path: string }> {
    this.#tool ??= (async () => {
      let host: string;
      try {
        host = xattrToolPath();
      } catch (err) {
        throw new DsecError(
          'unavailable',
          `file metadata needs the dsec-xattr tool: ${String((err as Error).message)}`,
        );
      }
      const bytes = await readFile(host);
      const id = createHash('sha256').update(bytes).digest('hex').slice(0, 16);
      return { bytes, path: `${TOOL_DIR}/.dsec-xattr-${id}` };
    })();
    this.#tool.catch(() => (this.#tool = undefined));
    return this.#tool;
  }

  /**
   * Whether only root may change the tool's directory (/ and /tmp root's, not a
   * symlink, writable by no one else unless sticky): lstat, as root. Stable
   * once true, as only root could change it.
   */
  async #safeDir(sb: OpenedSandbox, signal: AbortSignal | undefined): Promise<boolean> {
    for (const dir of ['/', TOOL_DIR]) {
      const info = await sb.io.statFile(sb.id, dir, { user: 'root', signal });
      if (info.type !== 'directory' || info.uid !== 0) return false;
      if ((info.mode & 0o022) !== 0 && (info.mode & 0o1000) === 0) return false;
    }
    return true;
  }

  /** Whether the tool is in the sandbox (a stat, until it is known to be). */
  async #present(sb: OpenedSandbox, signal: AbortSignal | undefined): Promise<string | undefined> {
    const tool = await this.#load().catch(() => undefined);
    if (!tool) return undefined;
    if (this.#installed.has(sb.id)) return tool.path;
    try {
      if (!(await this.#safeDir(sb, signal))) return undefined;
      const info = await sb.io.statFile(sb.id, tool.path, { user: 'root', signal });
      if (
        info.type !== 'file' ||
        info.size !== tool.bytes.length ||
        info.uid !== 0 ||
        (info.mode & 0o022) !== 0
      ) {
        return undefined;
      }
    } catch (err) {
      if (toDsecError(err).code === 'not_found') return undefined;
      throw err;
    }
    this.#installed.set(sb.id, true);
    return tool.path;
  }

  async #install(sb: OpenedSandbox, signal: AbortSignal | undefined): Promise<string> {
    const present = await this.#present(sb, signal);
    if (present) return present;
    const tool = await this.#load();
    if (!(await this.#safeDir(sb, signal))) {
      throw new DsecError(
        'unavailable',
        `the sandbox's ${TOOL_DIR} (or /) may be changed by users other than root, so DSec keeps no file metadata there`,
        { field: 'X-Metadata-*' },
      );
    }
    await sb.io.writeFile(sb.id, tool.path, tool.bytes, { user: 'root', mode: 0o755, signal });
    this.#installed.set(sb.id, true);
    return tool.path;
  }

  /** Replaces the file's metadata with `meta`, as `user` (the one who wrote it). */
  async set(
    sb: OpenedSandbox,
    path: string,
    meta: Record<string, string>,
    user: string | undefined,
    signal: AbortSignal | undefined,
  ): Promise<void> {
    const stdin = Object.entries(meta)
      .map(([k, v]) => `${hex(k)}=${hex(v)}\n`)
      .join('');
    for (let attempt = 0; ; attempt++) {
      const tool = await this.#install(sb, signal);
      let r: CommandResult;
      try {
        r = await sb.io.runCommand(
          sb.id,
          {
            argv: [tool, 'set', path],
            stdin,
            ...(user !== undefined ? { user } : {}),
            timeoutMs: TOOL_TIMEOUT_MS,
            maxOutputBytes: 64 * 1024,
          },
          { signal },
        );
      } catch (err) {
        // Not there any more (the sandbox removed it): copy it once more.
        if (attempt === 0 && toDsecError(err).code === 'invalid_argument') {
          this.#installed.delete(sb.id);
          continue;
        }
        throw err;
      }
      if (r.outcome === 'exited' && r.exitCode === 0) return;
      const why = r.stderr.trim().split('\n').at(-1)?.slice(0, 300) ?? '';
      if (r.outcome === 'exited' && r.exitCode === 4) {
        throw new DsecError(
          'invalid_argument',
          `${path}: the sandbox's file system keeps no user extended attributes, so no metadata`,
          { field: 'X-Metadata-*' },
        );
      }
      // Not there any more (the sandbox cleaned /tmp), or not runnable: copy it once more.
      if (attempt === 0 && (r.exitCode === 126 || r.exitCode === 127 || r.outcome !== 'exited')) {
        this.#installed.delete(sb.id);
        continue;
      }
      throw new DsecError(
        'unavailable',
        `${path}: cannot store file metadata in the sandbox${why ? `: ${why}` : ''}`,
        { field: 'X-Metadata-*' },
      );
    }
  }

  /**
   * The metadata of each path as `user` may read it (absent: none, or unknown);
   * nothing runs where none was ever set.
   */
  async get(
    sb: OpenedSandbox,
    paths: readonly string[],
    user: string | undefined,
    signal: AbortSignal | undefined,
  ): Promise<Map<string, Record<string, string>>> {
    const todo = paths.filter((p) => !p.includes('\n')).slice(0, MAX_GET_PATHS);
    if (todo.length === 0) return new Map();
    const tool = await this.#present(sb, signal);
    if (!tool) return new Map();
    const r = await sb.io
      .runCommand(
        sb.id,
        {
          argv: [tool, 'get'],
          stdin: `${todo.join('\n')}\n`,
          ...(user !== undefined ? { user } : {}),
          timeoutMs: TOOL_TIMEOUT_MS,
          maxOutputBytes: 16 * 1024 * 1024,
        },
        { signal },
      )
      .catch((err: unknown) => {
        // Removed by the sandbox: no metadata to read until one is written again.
        if (toDsecError(err).code !== 'invalid_argument') throw err;
        this.#installed.delete(sb.id);
        return undefined;
      });
    if (r === undefined) return new Map();
    if (r.outcome !== 'exited' || r.exitCode !== 0 || r.truncated) {
      if (r.exitCode === 126 || r.exitCode === 127) this.#installed.delete(sb.id);
      return new Map();
    }
    return parseMetadataLines(todo, r.stdout);
  }

  forget(sandboxId: string): void {
    this.#installed.delete(sandboxId);
  }
}
