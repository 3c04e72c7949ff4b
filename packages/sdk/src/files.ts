import { createReadStream, createWriteStream } from 'node:fs';
import { rename, rm } from 'node:fs/promises';
import { Readable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import type { FileInfo } from './wire.js';
import { readAll } from './commands.js';
import type { HttpTransport } from './transport.js';
import type { CallOptions } from './types.js';

/** How long a file transfer may wait for the server to start answering. */
const TRANSFER_START_TIMEOUT_MS = 120_000;

export interface FileCallOptions extends CallOptions {
  /** User the operation runs as inside the sandbox (default: the sandbox's `initUser`). */
  user?: string | undefined;
}

export interface WriteOptions extends FileCallOptions {
  /** Permission bits, e.g. `0o755` (default: an existing file's, else 0o644). */
  mode?: number | undefined;
}

/**
 * `sandbox.files`: files inside the sandbox, resolved in the sandbox's own
 * root (no symlink or `..` leaves it). Writes are atomic (temp file +
 * rename). Contents stream both ways with back-pressure, so uploads and
 * downloads of any size never sit whole in memory.
 */
export class Files {
  readonly #http: HttpTransport;
  readonly #base: string;
  readonly #timeoutMs: number;

  /** @internal */
  constructor(http: HttpTransport, sandboxId: string, defaultTimeoutMs: number) {
    this.#http = http;
    this.#base = `/v1/sandboxes/${encodeURIComponent(sandboxId)}/files`;
    this.#timeoutMs = defaultTimeoutMs;
  }

  /** A file's contents as text (UTF-8), or bytes with `format: 'bytes'`. */
  read(path: string, options?: FileCallOptions & { format?: 'text' }): Promise<string>;
  read(path: string, options: FileCallOptions & { format: 'bytes' }): Promise<Buffer>;
  async read(
    path: string,
    options: FileCallOptions & { format?: 'text' | 'bytes' } = {},
  ): Promise<string | Buffer> {
    const bytes = await readAll(await this.readStream(path, options));
    return options.format === 'bytes' ? bytes : bytes.toString('utf8');
  }

  /** A file's contents as a stream (throws `not_found` & co. before the first byte). */
  async readStream(path: string, options: FileCallOptions = {}): Promise<Readable> {
    return this.#http.raw({
      method: 'GET',
      path: `${this.#base}${query({ path, user: options.user })}`,
      signal: options.signal,
      timeoutMs: options.timeoutMs ?? TRANSFER_START_TIMEOUT_MS,
    });
  }

  /** Replaces (or creates) a file atomically with text or bytes. */
  write(path: string, data: string | Uint8Array, options: WriteOptions = {}): Promise<FileInfo> {
    return this.writeStream(
      path,
      typeof data === 'string' ? Buffer.from(data) : Buffer.from(data),
      options,
    );
  }

  /** Replaces (or creates) a file atomically from a stream, with back-pressure. */
  async writeStream(
    path: string,
    data: Readable | AsyncIterable<Uint8Array> | Buffer,
    options: WriteOptions = {},
  ): Promise<FileInfo> {
    const body = Buffer.isBuffer(data) || data instanceof Readable ? data : Readable.from(data);
    const mode = options.mode === undefined ? undefined : options.mode.toString(8);
    const res = await this.#http.raw({
      method: 'PUT',
      path: `${this.#base}${query({ path, user: options.user, mode })}`,
      headers: { 'content-type': 'application/octet-stream' },
      body,
      signal: options.signal,
      timeoutMs: options.timeoutMs ?? TRANSFER_START_TIMEOUT_MS,
    });
    return JSON.parse((await readAll(res)).toString('utf8')) as FileInfo;
  }

  /** Uploads a local file (any size, streamed). */
  upload(localPath: string, remotePath: string, options: WriteOptions = {}): Promise<FileInfo> {
    return this.writeStream(remotePath, createReadStream(localPath), options);
  }

  /** Downloads a file to a local path (streamed; written to a temp file, then renamed). */
  async download(
    remotePath: string,
    localPath: string,
    options: FileCallOptions = {},
  ): Promise<{ bytes: number }> {
    const res = await this.readStream(remotePath, options);
    const tmp = `${localPath}.dsec-part-${process.pid}`;
    let bytes = 0;
    res.on('data', (c: Buffer) => (bytes += c.length));
    try {
      await pipeline(res, createWriteStream(tmp), { signal: options.signal });
      await rename(tmp, localPath);
    } catch (err) {
      await rm(tmp, { force: true });
      throw err;
    }
    return { bytes };
  }

  /** A file's metadata; does not follow a final symlink (`target` says where it points). */
  stat(path: string, options: FileCallOptions = {}): Promise<FileInfo> {
    return this.#get<FileInfo>(`/stat${query({ path, user: options.user })}`, options);
  }

  /** A directory's entries (names may hold any byte but `/` and NUL), sorted by name. */
  async list(path: string, options: FileCallOptions = {}): Promise<FileInfo[]> {
    const r = await this.#get<{ entries: FileInfo[] }>(
      `/list${query({ path, user: options.user })}`,
      options,
    );
    return r.entries;
  }

  /** Creates a directory; `parents` makes missing parents too and accepts an existing one. */
  async mkdir(
    path: string,
    options: FileCallOptions & { parents?: boolean | undefined; mode?: number | undefined } = {},
  ): Promise<void> {
    await this.#post(
      '/mkdir',
      { path, parents: options.parents, mode: options.mode, user: options.user },
      options,
    );
  }

  /** Removes a file, a symlink, an empty directory, or with `recursive` a whole tree. */
  async remove(
    path: string,
    options: FileCallOptions & { recursive?: boolean | undefined } = {},
  ): Promise<void> {
    await this.#post(
      '/remove',
      { path, recursive: options.recursive, user: options.user },
      options,
    );
  }

  /** Renames (moves) a path; an existing target is an error unless `overwrite`. */
  async rename(
    from: string,
    to: string,
    options: FileCallOptions & { overwrite?: boolean | undefined } = {},
  ): Promise<void> {
    await this.#post(
      '/rename',
      { from, to, overwrite: options.overwrite, user: options.user },
      options,
    );
  }

  #get<T>(suffix: string, options: CallOptions): Promise<T> {
    return this.#http.json<T>({
      method: 'GET',
      path: `${this.#base}${suffix}`,
      signal: options.signal,
      timeoutMs: options.timeoutMs ?? this.#timeoutMs,
      idempotent: true,
    });
  }

  async #post(suffix: string, body: unknown, options: CallOptions): Promise<void> {
    await this.#http.json<undefined>({
      method: 'POST',
      path: `${this.#base}${suffix}`,
      body,
      signal: options.signal,
      timeoutMs: options.timeoutMs ?? this.#timeoutMs,
    });
  }
}

function query(params: Record<string, string | undefined>): string {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined) q.set(k, v);
  return `?${q.toString()}`;
}
