import { createHmac, randomBytes, timingSafeEqual } from 'node:crypto';
import { createReadStream, createWriteStream } from 'node:fs';
import { mkdir, open, readdir, rename, rm, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { Transform, type Readable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { createGunzip } from 'node:zlib';
import { unpackBuildContext, type BuildContextLimits } from '@dsec/apiserver';
import { DsecError, isDsecError } from '@dsec/core';

/**
 * The files of E2B template builds' `COPY` steps. The SDK asks for an upload
 * link per files hash (`GET /templates/:id/files/:hash`) and PUTs a tar
 * (gzipped by default) of the step's sources there without its API key, as
 * to a presigned S3 URL; so the link carries a token: an HMAC of the
 * project, template, hash and expiry under a secret of this process, valid
 * for an hour, for that one hash. Files are kept per project under
 * `<dir>/<project>/<hash>.tar` (bounded in count and bytes, oldest dropped
 * first), so a second build with the same files uploads nothing. A file is
 * named by the hash the SDK computed; DSec does not recompute it (E2B's hash
 * covers file metadata DSec does not see), so a project can only ever
 * mislabel its own files.
 */
export interface TemplateFilesLimits {
  /** Bytes of one upload (after decompression too). Default 1 GiB. */
  maxFileBytes: number;
  /** Files kept per project. Default 64. */
  maxFilesPerProject: number;
  /** Bytes kept per project. Default 4 GiB. */
  maxProjectBytes: number;
  /** How long an upload link works. Default one hour. */
  linkTtlMs: number;
  /**
   * Uploads of one project arriving at once (429 `quota_exceeded` past it;
   * the SDK PUTs every `COPY` step's files at once). A link works for an
   * hour and for any number of PUTs, so the bytes all of a project's
   * uploads in progress have written (before and after decompression) are
   * bounded too, by `maxProjectBytes`. Default 64.
   */
  maxUploadsPerProject: number;
}

export const DEFAULT_TEMPLATE_FILES_LIMITS: TemplateFilesLimits = {
  maxFileBytes: 2 ** 30,
  maxFilesPerProject: 64,
  maxProjectBytes: 4 * 2 ** 30,
  linkTtlMs: 3600_000,
  maxUploadsPerProject: 64,
};

const HASH = /^[a-f0-9]{64}$/;

/**
 * Where the stored files are charged: IAM's `imageBytes` of the project
 * (summed over its ancestors' limits, so a tenant's child projects cannot
 * each keep their own `maxProjectBytes` outside its quota).
 */
export interface TemplateFilesCharge {
  /** Charges `bytes` under `key` (replacing what `key` held); `quota_exceeded` past the quota. */
  bind(project: string, key: string, bytes: number): Promise<void>;
  release(key: string): Promise<void>;
}

export class TemplateFiles {
  readonly limits: TemplateFilesLimits;
  readonly #secret = randomBytes(32);
  /** Uploads in progress per project, and the bytes they have written. */
  readonly #uploading = new Map<string, { count: number; bytes: number }>();

  constructor(
    readonly dir: () => string,
    limits: Partial<TemplateFilesLimits> = {},
    readonly charge?: TemplateFilesCharge | undefined,
  ) {
    this.limits = { ...DEFAULT_TEMPLATE_FILES_LIMITS, ...limits };
  }

  /** `invalid_argument` unless `hash` is E2B's files hash (64 lower-case hex digits). */
  static checkHash(hash: string): string {
    if (!HASH.test(hash)) {
      throw new DsecError('invalid_argument', 'a files hash is 64 hex digits', { field: 'hash' });
    }
    return hash;
  }

  #path(project: string, hash: string): string {
    return join(this.dir(), project, `${TemplateFiles.checkHash(hash)}.tar`);
  }

  async present(project: string, hash: string): Promise<boolean> {
    return (await stat(this.#path(project, hash)).catch(() => undefined))?.isFile() === true;
  }

  /** The token of an upload link for `hash` of `project`'s template `templateID`. */
  token(project: string, templateID: string, hash: string, now = Date.now()): string {
    const expires = now + this.limits.linkTtlMs;
    return `${expires}.${this.#mac(project, templateID, hash, expires)}`;
  }

  /** The project a token was made for, when it is valid for this template and hash now; else `permission_denied`. */
  checkToken(token: string, project: string, templateID: string, hash: string): void {
    const m = /^(\d{1,15})\.([A-Za-z0-9_-]{43})$/.exec(token);
    const expires = m ? Number(m[1]) : 0;
    const ok =
      m !== null &&
      expires > Date.now() &&
      safeEqual(m[2]!, this.#mac(project, templateID, hash, expires));
    if (!ok) throw new DsecError('permission_denied', 'the upload link is invalid or expired');
  }

  #mac(project: string, templateID: string, hash: string, expires: number): string {
    return createHmac('sha256', this.#secret)
      .update(`e2b-template-files\n${project}\n${templateID}\n${hash}\n${expires}`)
      .digest('base64url');
  }

  /**
   * Stores an upload (a tar, gzipped or not, as the SDK sends it) as a plain
   * tar, refusing one past `maxFileBytes` before or after decompression; a
   * file of that hash already kept stays as it is.
   */
  async store(project: string, hash: string, body: Readable, signal?: AbortSignal): Promise<void> {
    const final = this.#path(project, hash);
    // Counted and taken with no await between: concurrent PUTs see each other.
    const running = this.#uploading.get(project) ?? { count: 0, bytes: 0 };
    if (running.count >= this.limits.maxUploadsPerProject) {
      throw new DsecError(
        'quota_exceeded',
        `the project uploads ${this.limits.maxUploadsPerProject} template files already; retry once one is done`,
        { details: { resource: 'templateUploads', limit: this.limits.maxUploadsPerProject } },
      );
    }
    running.count++;
    this.#uploading.set(project, running);
    let mine = 0;
    const charge = (n: number): DsecError | undefined => {
      mine += n;
      running.bytes += n;
      if (running.bytes <= this.limits.maxProjectBytes) return undefined;
      return new DsecError(
        'quota_exceeded',
        `the project's template file uploads in progress hold more than ${this.limits.maxProjectBytes} bytes`,
        { details: { resource: 'templateUploadBytes', limit: this.limits.maxProjectBytes } },
      );
    };
    try {
      await this.#store(project, hash, final, body, charge, signal);
    } finally {
      running.bytes -= mine;
      if (--running.count === 0) this.#uploading.delete(project);
    }
  }

  async #store(
    project: string,
    hash: string,
    final: string,
    body: Readable,
    charge: (bytes: number) => DsecError | undefined,
    signal: AbortSignal | undefined,
  ): Promise<void> {
    await mkdir(join(this.dir(), project), { recursive: true, mode: 0o700 });
    const tmp = `${final}.${randomBytes(6).toString('hex')}.part`;
    const raw = `${tmp}.raw`;
    try {
      await pipeline(
        body,
        bounded(this.limits.maxFileBytes, charge),
        createWriteStream(raw, { flags: 'wx', mode: 0o600 }),
        {
          ...(signal ? { signal } : {}),
        },
      );
      const fh = await open(raw, 'r');
      const magic = Buffer.alloc(2);
      await fh.read(magic, 0, 2, 0);
      await fh.close();
      if (magic[0] === 0x1f && magic[1] === 0x8b) {
        await pipeline(
          createReadStream(raw),
          createGunzip(),
          bounded(this.limits.maxFileBytes, charge),
          createWriteStream(tmp, { flags: 'wx', mode: 0o600 }),
        ).catch((err: unknown) => {
          if (isDsecError(err)) throw err;
          throw new DsecError('invalid_argument', 'the upload is not a valid gzip stream', {
            field: 'body',
            cause: err,
          });
        });
        await rm(raw, { force: true });
      } else {
        await rename(raw, tmp);
      }
      // Charged before it is kept: past the project's quota it is refused and removed.
      await this.charge?.bind(project, chargeKey(project, hash), (await stat(tmp)).size);
      await rename(tmp, final);
    } catch (err) {
      if (isDsecError(err)) throw err;
      throw new DsecError('invalid_argument', 'the upload broke off', {
        field: 'body',
        cause: err,
      });
    } finally {
      await rm(raw, { force: true });
      await rm(tmp, { force: true });
    }
    await this.#evict(project, hash);
  }

  /** Unpacks the files of `hash` into `dest` (a fresh directory) under the build context's rules. */
  async unpack(
    project: string,
    hash: string,
    dest: string,
    limits?: BuildContextLimits,
  ): Promise<void> {
    const path = this.#path(project, hash);
    if (!(await this.present(project, hash))) {
      throw new DsecError(
        'invalid_argument',
        `no files were uploaded for hash ${hash}: the build refers to files it did not send`,
        { field: 'steps', details: { reason: 'files_missing', filesHash: hash } },
      );
    }
    await mkdir(dest, { recursive: true, mode: 0o755 });
    await unpackBuildContext(path, dest, limits);
  }

  /** Drops the oldest files of `project` past its bounds (never `keep`, the one just stored). */
  async #evict(project: string, keep: string): Promise<void> {
    const dir = join(this.dir(), project);
    const files: { name: string; size: number; mtime: number }[] = [];
    for (const name of await readdir(dir).catch(() => [] as string[])) {
      if (!name.endsWith('.tar')) continue;
      const st = await stat(join(dir, name)).catch(() => undefined);
      if (st?.isFile()) files.push({ name, size: st.size, mtime: st.mtimeMs });
    }
    files.sort((a, b) => a.mtime - b.mtime);
    let bytes = files.reduce((n, f) => n + f.size, 0);
    let count = files.length;
    for (const f of files) {
      if (count <= this.limits.maxFilesPerProject && bytes <= this.limits.maxProjectBytes) break;
      if (f.name === `${keep}.tar`) continue;
      await rm(join(dir, f.name), { force: true });
      await this.charge?.release(chargeKey(project, f.name.slice(0, -4))).catch(() => undefined);
      count--;
      bytes -= f.size;
    }
  }
}

/** The IAM reservation of a stored file (`image_reservations`, beside layers' keys). */
function chargeKey(project: string, hash: string): string {
  return `e2b-files:${project}/${hash}`;
}

function bounded(max: number, charge: (bytes: number) => DsecError | undefined): Transform {
  let bytes = 0;
  return new Transform({
    transform(chunk: Buffer, _enc, done) {
      bytes += chunk.length;
      const over = charge(chunk.length);
      if (over) {
        done(over);
        return;
      }
      if (bytes > max) {
        done(
          new DsecError('payload_too_large', `the upload is larger than ${max} bytes`, {
            field: 'body',
            details: { maxFileBytes: max },
          }),
        );
        return;
      }
      done(null, chunk);
    },
  });
}

function safeEqual(a: string, b: string): boolean {
  const x = Buffer.from(a);
  const y = Buffer.from(b);
  return x.length === y.length && timingSafeEqual(x, y);
}
