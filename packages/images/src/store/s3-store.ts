import { createHash, randomBytes } from 'node:crypto';
import { createWriteStream } from 'node:fs';
import { chmod, mkdir, open, rename, stat, unlink, type FileHandle } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Readable, Transform } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import type * as S3Sdk from '@aws-sdk/client-s3';
import type { S3Client } from '@aws-sdk/client-s3';
import {
  DsecError,
  formatLayerKey,
  LAYER_NAME_PATTERN,
  LAYER_PROJECT_PATTERN,
  LAYER_VERSION_PATTERN,
  throwIfAborted,
  type ImageStore,
  type LayerInfo,
  type LayerKey,
} from '@dsec/core';
import {
  assertDigest,
  assertLayerBlobsStored,
  assertRange,
  assertSameLayer,
  compareLayers,
  layerDigests,
  normalizeLayerInfo,
  storeKey,
  validateLayerInfo,
} from './validate.js';

const MiB = 1024 * 1024;
const RECORD_SUFFIX = '.json';
const MAX_PARTS = 10_000;
const HASH_CHUNK_BYTES = MiB;
/** S3's bucket naming rules (no dots next to each other or dashes is not checked). */
const BUCKET_PATTERN = /^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$/;
/** Key characters S3 documents as safe; anything else would need escaping in URLs. */
const PREFIX_PATTERN = /^[A-Za-z0-9!_.*'()/-]*$/;

export interface S3ImageStoreOptions {
  bucket: string;
  /** Key prefix for everything the store writes (`team/images/`); default none. A `/` is added. */
  prefix?: string;
  /** An S3-compatible endpoint (`http://127.0.0.1:9000`, MinIO, Ceph RGW); AWS S3 when absent. */
  endpoint?: string;
  /** Default `us-east-1`. */
  region?: string;
  /** Path-style URLs (`endpoint/bucket/key`); default: true when `endpoint` is set. */
  forcePathStyle?: boolean;
  /** Default: the SDK's chain (env `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, profile, IMDS). */
  credentials?: { accessKeyId: string; secretAccessKey: string; sessionToken?: string };
  /** Where `blobPath` keeps verified whole-blob copies; default `<tmpdir>/dsec-image-cache-<uid>`. */
  cacheDir?: string;
  /** Blobs above this size go up as a multipart upload; default 64 MiB. */
  multipartThresholdBytes?: number;
  /** Multipart part size; default `ceil(size / 10000)` clamped to 16–64 MiB. AWS needs ≥ 5 MiB. */
  partSizeBytes?: number;
  /** Parts in flight at once; default 4. */
  partConcurrency?: number;
  /** Attempts per request, retries included; default 3. */
  maxAttempts?: number;
  /** Time to open a connection; default 5000. */
  connectTimeoutMs?: number;
  /** Time a connection may sit idle mid-request; default 60000. */
  idleTimeoutMs?: number;
}

type Sdk = typeof S3Sdk;
let sdkPromise: Promise<Sdk> | undefined;
// Loaded on first use: the SDK costs ~200 ms to import, which `dsec` should not
// pay for commands that never touch S3.
function loadSdk(): Promise<Sdk> {
  sdkPromise ??= import('@aws-sdk/client-s3');
  return sdkPromise;
}

/** putLayer calls in flight per store and ref, across instances in this process. */
const layerLocks = new Map<string, Promise<void>>();
/** Whole-blob downloads in flight per cache file, shared by concurrent `blobPath` calls. */
const downloads = new Map<string, Download>();

interface Download {
  promise: Promise<string>;
  waiters: number;
  controller: AbortController;
}

/**
 * An ImageStore in an S3 bucket (AWS S3 or a compatible server: MinIO, Ceph
 * RGW). Remote: `blobPath` downloads a verified whole copy into `cacheDir`;
 * `readBlobRange` fetches only the bytes asked for (on-demand data blobs).
 *
 * Layout under `prefix`: `blobs/sha256/<hex>` (written once, by digest) and
 * the same records as the dir store, the platform's at
 * `layers/<name>/<version>.json` and a project's at
 * `projects/<project>/layers/<name>/<version>.json`.
 * `putBlob` hashes the file first, skips the upload when the object is already
 * there with the right size, and re-hashes while uploading so a file changed
 * in between is refused rather than stored under the wrong digest.
 *
 * `putLayer` creates a record only if absent (`If-None-Match: *`) and reads
 * it back on 412. Cross-process atomicity relies on the server honouring
 * `If-None-Match` on PUT, as AWS S3, MinIO and Ceph RGW do; some (s3rver)
 * ignore it, so within one process putLayer is also serialized per ref and
 * reads before it writes. As with the dir store, nothing is locked across
 * `removeLayer` and a `putLayer` that reuses the same blob.
 *
 * Errors: a missing object is `image_not_found`; a missing bucket is
 * `invalid_argument` (field `bucket`); refused or timed-out connections and
 * 5xx answers are `unavailable`; denied requests are `permission_denied`; a
 * cancelled signal is `aborted`.
 */
export class S3ImageStore implements ImageStore {
  readonly kind = 's3';
  readonly local = false;
  readonly bucket: string;
  /** Empty, or ends with `/`. */
  readonly prefix: string;
  readonly endpoint: string | undefined;
  readonly region: string;
  readonly forcePathStyle: boolean;
  readonly cacheDir: string;
  private readonly options: S3ImageStoreOptions;
  private clientPromise: Promise<S3Client> | undefined;

  /** Throws `invalid_argument` naming the option at fault; connects lazily. */
  constructor(options: S3ImageStoreOptions) {
    if (typeof options.bucket !== 'string' || !BUCKET_PATTERN.test(options.bucket)) {
      throw new DsecError(
        'invalid_argument',
        `bucket ${JSON.stringify(options.bucket)} is not a valid S3 bucket name`,
        { field: 'bucket' },
      );
    }
    this.bucket = options.bucket;
    this.prefix = normalizePrefix(options.prefix ?? '');
    if (options.endpoint !== undefined) assertEndpoint(options.endpoint);
    this.endpoint = options.endpoint?.replace(/\/+$/, '');
    this.region = options.region ?? 'us-east-1';
    if (!/^[a-z0-9-]{1,64}$/.test(this.region)) {
      throw new DsecError(
        'invalid_argument',
        `region ${JSON.stringify(this.region)} is malformed`,
        {
          field: 'region',
        },
      );
    }
    this.forcePathStyle = options.forcePathStyle ?? this.endpoint !== undefined;
    for (const key of [
      'multipartThresholdBytes',
      'partSizeBytes',
      'partConcurrency',
      'maxAttempts',
      'connectTimeoutMs',
      'idleTimeoutMs',
    ] as const) {
      const v = options[key];
      if (v !== undefined && !(Number.isSafeInteger(v) && v > 0)) {
        throw new DsecError('invalid_argument', `${key} must be a positive integer`, {
          field: key,
        });
      }
    }
    this.cacheDir =
      options.cacheDir ?? join(tmpdir(), `dsec-image-cache-${process.getuid?.() ?? 'user'}`);
    this.options = options;
  }

  /** `s3://bucket/prefix?endpoint=…&region=…`: no credentials, ever. */
  get location(): string {
    const params = new URLSearchParams();
    if (this.endpoint !== undefined) params.set('endpoint', this.endpoint);
    params.set('region', this.region);
    if (this.forcePathStyle !== (this.endpoint !== undefined)) {
      params.set('forcePathStyle', String(this.forcePathStyle));
    }
    return `s3://${this.bucket}/${this.prefix}?${params.toString()}`;
  }

  private get where(): string {
    return this.endpoint ?? `AWS S3 (${this.region})`;
  }

  private client(): Promise<S3Client> {
    this.clientPromise ??= loadSdk().then((sdk) => {
      // We pin Node 20 and this SDK version; its "Node 22 needed from 2027" notice is noise.
      process.env.AWS_SDK_JS_NODE_VERSION_SUPPORT_WARNING_DISABLED ??= 'true';
      const o = this.options;
      return new sdk.S3Client({
        region: this.region,
        ...(this.endpoint !== undefined ? { endpoint: this.endpoint } : {}),
        forcePathStyle: this.forcePathStyle,
        ...(o.credentials ? { credentials: o.credentials } : {}),
        maxAttempts: o.maxAttempts ?? 3,
        // Checksums only where S3 requires them: compatible servers differ in support.
        requestChecksumCalculation: 'WHEN_REQUIRED',
        responseChecksumValidation: 'WHEN_REQUIRED',
        requestHandler: {
          connectionTimeout: o.connectTimeoutMs ?? 5000,
          socketTimeout: o.idleTimeoutMs ?? 60_000,
        },
      });
    });
    return this.clientPromise;
  }

  private blobKey(digest: string): string {
    assertDigest(digest);
    return `${this.prefix}blobs/sha256/${digest.slice('sha256:'.length)}`;
  }

  private recordKey(key: LayerKey): string {
    const owner = key.project === undefined ? '' : `projects/${key.project}/`;
    return `${this.prefix}${owner}layers/${key.name}/${key.version}${RECORD_SUFFIX}`;
  }

  /** `name:version` of a record's key in either layout; undefined for any other object. */
  private recordRef(key: string): string | undefined {
    if (!key.startsWith(this.prefix) || !key.endsWith(RECORD_SUFFIX)) return undefined;
    const parts = key.slice(this.prefix.length, -RECORD_SUFFIX.length).split('/');
    const [name, version] =
      parts.length === 3 && parts[0] === 'layers'
        ? [parts[1]!, parts[2]!]
        : parts.length === 5 &&
            parts[0] === 'projects' &&
            parts[2] === 'layers' &&
            LAYER_PROJECT_PATTERN.test(parts[1]!)
          ? [parts[3]!, parts[4]!]
          : ['', ''];
    return LAYER_NAME_PATTERN.test(name) && LAYER_VERSION_PATTERN.test(version)
      ? `${name}:${version}`
      : undefined;
  }

  private cacheFile(digest: string): string {
    return join(this.cacheDir, 'blobs', 'sha256', digest.slice('sha256:'.length));
  }

  async putBlob(
    file: string,
    options: { signal?: AbortSignal; onProgress?: (bytesDone: number) => void } = {},
  ): Promise<{ digest: string; sizeBytes: number }> {
    const { signal } = options;
    throwIfAborted(signal);
    const input = await open(file, 'r').catch((err: unknown) => {
      throw new DsecError('invalid_argument', `cannot read ${file}`, { field: 'file', cause: err });
    });
    try {
      const st = await input.stat();
      if (!st.isFile()) {
        throw new DsecError('invalid_argument', `${file} is not a regular file`, { field: 'file' });
      }
      const sizeBytes = st.size;
      const digest = await hashFile(input, signal);
      const key = this.blobKey(digest);
      const existing = await this.head(key, signal);
      if (existing === sizeBytes) {
        options.onProgress?.(sizeBytes);
        return { digest, sizeBytes };
      }
      const threshold = this.options.multipartThresholdBytes ?? 64 * MiB;
      if (sizeBytes <= threshold) {
        await this.putSingle(input, file, key, digest, sizeBytes, options);
      } else {
        await this.putMultipart(input, file, key, digest, sizeBytes, options);
      }
      return { digest, sizeBytes };
    } finally {
      await input.close();
    }
  }

  private async putSingle(
    input: FileHandle,
    file: string,
    key: string,
    digest: string,
    sizeBytes: number,
    options: { signal?: AbortSignal; onProgress?: (bytesDone: number) => void },
  ): Promise<void> {
    const sdk = await loadSdk();
    const client = await this.client();
    const verify = verifyingStream(file, digest, sizeBytes, options.onProgress);
    const source = input.createReadStream({ start: 0, autoClose: false });
    source.on('error', (err) => verify.destroy(err));
    source.pipe(verify);
    try {
      await client.send(
        new sdk.PutObjectCommand({
          Bucket: this.bucket,
          Key: key,
          Body: verify,
          ContentLength: sizeBytes,
          ContentType: 'application/octet-stream',
        }),
        signalOpt(options.signal),
      );
    } catch (err) {
      throw verify.failure ?? this.mapError(err, `upload of ${digest}`, options.signal);
    } finally {
      source.unpipe(verify);
      source.destroy();
    }
  }

  private async putMultipart(
    input: FileHandle,
    file: string,
    key: string,
    digest: string,
    sizeBytes: number,
    options: { signal?: AbortSignal; onProgress?: (bytesDone: number) => void },
  ): Promise<void> {
    const { signal } = options;
    const partSize =
      this.options.partSizeBytes ??
      Math.min(64 * MiB, Math.max(16 * MiB, Math.ceil(sizeBytes / MAX_PARTS / MiB) * MiB));
    const partCount = Math.max(1, Math.ceil(sizeBytes / partSize));
    if (partCount > MAX_PARTS) {
      throw new DsecError(
        'invalid_argument',
        `${file} needs ${partCount} parts of ${partSize} bytes; S3 allows ${MAX_PARTS}`,
        { field: 'file' },
      );
    }
    const sdk = await loadSdk();
    const client = await this.client();
    const created = await client
      .send(
        new sdk.CreateMultipartUploadCommand({
          Bucket: this.bucket,
          Key: key,
          ContentType: 'application/octet-stream',
        }),
        signalOpt(signal),
      )
      .catch((err: unknown) => {
        throw this.mapError(err, `upload of ${digest}`, signal);
      });
    const uploadId = created.UploadId;
    if (!uploadId) throw new DsecError('internal', `${this.where} gave no multipart upload ID`);
    // Parts stop at the first failure, and the server drops what was sent.
    const stop = new AbortController();
    const partSignal = signal ? AbortSignal.any([signal, stop.signal]) : stop.signal;
    const parts: { PartNumber: number; ETag: string }[] = [];
    const inFlight = new Set<Promise<void>>();
    let failure: unknown;
    let done = 0;
    try {
      const hash = createHash('sha256');
      for (let i = 0; i < partCount && failure === undefined; i++) {
        throwIfAborted(signal);
        const length = Math.min(partSize, sizeBytes - i * partSize);
        const body = await readExactly(input, i * partSize, length, file);
        hash.update(body);
        const partNumber = i + 1;
        const upload: Promise<void> = client
          .send(
            new sdk.UploadPartCommand({
              Bucket: this.bucket,
              Key: key,
              UploadId: uploadId,
              PartNumber: partNumber,
              Body: body,
              ContentLength: body.length,
            }),
            { abortSignal: partSignal },
          )
          .then((out) => {
            if (!out.ETag) throw new DsecError('internal', `part ${partNumber} came back untagged`);
            parts.push({ PartNumber: partNumber, ETag: out.ETag });
            done += body.length;
            options.onProgress?.(done);
          })
          .catch((err: unknown) => {
            failure ??= err;
            stop.abort();
          })
          .finally(() => inFlight.delete(upload));
        inFlight.add(upload);
        if (inFlight.size >= (this.options.partConcurrency ?? 4)) await Promise.race(inFlight);
      }
      await Promise.all(inFlight);
      if (failure !== undefined) throw this.mapError(failure, `upload of ${digest}`, signal);
      if (`sha256:${hash.digest('hex')}` !== digest) throw changedWhileStoring(file);
      parts.sort((a, b) => a.PartNumber - b.PartNumber);
      await client
        .send(
          new sdk.CompleteMultipartUploadCommand({
            Bucket: this.bucket,
            Key: key,
            UploadId: uploadId,
            MultipartUpload: { Parts: parts },
          }),
          signalOpt(signal),
        )
        .catch((err: unknown) => {
          throw this.mapError(err, `upload of ${digest}`, signal);
        });
    } catch (err) {
      stop.abort();
      await Promise.allSettled(inFlight);
      // Best effort, and deliberately without the caller's (possibly aborted) signal.
      await client
        .send(
          new sdk.AbortMultipartUploadCommand({
            Bucket: this.bucket,
            Key: key,
            UploadId: uploadId,
          }),
        )
        .catch(() => undefined);
      throw err;
    }
  }

  async hasBlob(digest: string): Promise<boolean> {
    return (await this.head(this.blobKey(digest))) !== undefined;
  }

  async statBlob(
    digest: string,
    options: { signal?: AbortSignal } = {},
  ): Promise<{ sizeBytes: number }> {
    const key = this.blobKey(digest);
    throwIfAborted(options.signal);
    const size = await this.head(key, options.signal);
    if (size === undefined) throw new DsecError('image_not_found', `no blob ${digest}`);
    return { sizeBytes: size };
  }

  async readBlobRange(
    digest: string,
    offset: number,
    length: number,
    options: { signal?: AbortSignal } = {},
  ): Promise<Buffer> {
    assertRange(offset, length);
    const key = this.blobKey(digest);
    throwIfAborted(options.signal);
    if (length === 0) {
      await this.statBlob(digest, options);
      return Buffer.alloc(0);
    }
    const sdk = await loadSdk();
    const client = await this.client();
    try {
      const out = await client.send(
        new sdk.GetObjectCommand({
          Bucket: this.bucket,
          Key: key,
          Range: `bytes=${offset}-${offset + length - 1}`,
        }),
        signalOpt(options.signal),
      );
      const bytes = out.Body ? await out.Body.transformToByteArray() : new Uint8Array();
      const buf = Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
      const start = /^bytes (\d+)-/.exec(out.ContentRange ?? '')?.[1];
      if (start === undefined) {
        // No Content-Range: the whole object came back (a server that ignores Range, or empty).
        return buf.subarray(offset, offset + length);
      }
      if (Number(start) !== offset) {
        throw new DsecError(
          'internal',
          `${this.where} answered range ${out.ContentRange} for offset ${offset}`,
        );
      }
      return buf.subarray(0, length);
    } catch (err) {
      // At or past the end: S3 answers 416, the interface answers empty.
      if (statusOf(err) === 416) return Buffer.alloc(0);
      if (isNotFound(err)) throw new DsecError('image_not_found', `no blob ${digest}`);
      // Servers differ on ranges of empty objects (s3rver sends a truncated
      // body): when the transfer itself failed, an empty answer may be right.
      if (statusOf(err) === undefined && !options.signal?.aborted) {
        const size = await this.head(key, options.signal).catch(() => undefined);
        if (size !== undefined && offset >= size) return Buffer.alloc(0);
      }
      throw this.mapError(err, `blob ${digest}`, options.signal);
    }
  }

  async blobPath(digest: string, options: { signal?: AbortSignal } = {}): Promise<string> {
    const key = this.blobKey(digest);
    throwIfAborted(options.signal);
    const path = this.cacheFile(digest);
    if (await isFile(path)) return path;
    let download = downloads.get(path);
    // One that every earlier caller gave up on is finishing its abort: start afresh.
    if (!download || download.controller.signal.aborted) {
      const controller = new AbortController();
      const fresh: Download = {
        promise: this.download(key, digest, path, controller.signal).finally(() => {
          if (downloads.get(path) === fresh) downloads.delete(path);
        }),
        waiters: 0,
        controller,
      };
      // Waiters that gave up no longer listen; the rejection is theirs, not unhandled.
      fresh.promise.catch(() => undefined);
      downloads.set(path, fresh);
      download = fresh;
    }
    return await waitShared(download, options.signal);
  }

  private async download(
    key: string,
    digest: string,
    path: string,
    signal: AbortSignal,
  ): Promise<string> {
    const sdk = await loadSdk();
    const client = await this.client();
    const dir = join(this.cacheDir, 'blobs', 'sha256');
    await mkdir(dir, { recursive: true });
    const tmp = join(dir, tempName());
    try {
      const out = await client
        .send(new sdk.GetObjectCommand({ Bucket: this.bucket, Key: key }), {
          abortSignal: signal,
        })
        .catch((err: unknown) => {
          if (isNotFound(err)) throw new DsecError('image_not_found', `no blob ${digest}`);
          throw this.mapError(err, `blob ${digest}`, signal);
        });
      if (!(out.Body instanceof Readable)) {
        throw new DsecError('internal', `${this.where} sent blob ${digest} without a body`);
      }
      const hash = createHash('sha256');
      const hashing = new Transform({
        transform(chunk: Buffer, _enc, cb) {
          hash.update(chunk);
          cb(null, chunk);
        },
      });
      await pipeline(out.Body, hashing, createWriteStream(tmp, { flags: 'wx', mode: 0o600 }), {
        signal,
      }).catch((err: unknown) => {
        throw this.mapError(err, `blob ${digest}`, signal);
      });
      const got = `sha256:${hash.digest('hex')}`;
      if (got !== digest) {
        throw new DsecError(
          'internal',
          `blob ${digest} in ${this.location} is corrupt: its bytes hash to ${got}`,
          { details: { digest, actual: got } },
        );
      }
      const fh = await open(tmp, 'r');
      try {
        await fh.sync();
      } finally {
        await fh.close();
      }
      await chmod(tmp, 0o444);
      await rename(tmp, path);
      return path;
    } finally {
      await unlink(tmp).catch(() => undefined);
    }
  }

  /** Deletes an unreferenced blob; `conflict` while a layer record still uses it. */
  async deleteBlob(digest: string): Promise<void> {
    assertDigest(digest);
    const user = (await this.listLayers()).find((l) => layerDigests(l).includes(digest));
    if (user) {
      throw new DsecError('conflict', `blob ${digest} is used by layer ${formatLayerKey(user)}`, {
        details: { layer: formatLayerKey(user) },
      });
    }
    await this.deleteBlobObject(digest);
  }

  private async deleteBlobObject(digest: string): Promise<void> {
    await this.deleteObject(this.blobKey(digest), `blob ${digest}`);
    await unlink(this.cacheFile(digest)).catch(() => undefined);
  }

  async putLayer(layer: LayerInfo): Promise<void> {
    validateLayerInfo(layer);
    const record = normalizeLayerInfo(layer);
    const lockKey = `${this.location}|${formatLayerKey(record)}`;
    const previous = layerLocks.get(lockKey) ?? Promise.resolve();
    const mine = previous.then(() => this.putLayerLocked(record));
    const tail = mine.catch(() => undefined);
    layerLocks.set(lockKey, tail);
    try {
      await mine;
    } finally {
      if (layerLocks.get(lockKey) === tail) layerLocks.delete(lockKey);
    }
  }

  private async putLayerLocked(record: LayerInfo): Promise<void> {
    await assertLayerBlobsStored(record, (digest) => this.hasBlob(digest));
    const ref = formatLayerKey(record);
    const key = this.recordKey(record);
    const existing = await this.readRecord(key, ref).catch((err: unknown) => {
      if (err instanceof DsecError && err.code === 'image_not_found') return undefined;
      throw err;
    });
    if (existing) return assertSameLayer(existing, record);
    const sdk = await loadSdk();
    const client = await this.client();
    const body = JSON.stringify(record, null, 2) + '\n';
    try {
      await client.send(
        new sdk.PutObjectCommand({
          Bucket: this.bucket,
          Key: key,
          Body: body,
          ContentLength: Buffer.byteLength(body),
          ContentType: 'application/json',
          IfNoneMatch: '*',
        }),
      );
    } catch (err) {
      // 412: another writer created it first; 409: a concurrent conditional write is in progress.
      const status = statusOf(err);
      if (status !== 412 && status !== 409) throw this.mapError(err, `layer ${ref}`);
      assertSameLayer(await this.readRecord(key, ref), record);
    }
  }

  async getLayer(ref: string, options?: { project?: string | undefined }): Promise<LayerInfo> {
    return await this.readRecord(this.recordKey(storeKey(ref, options)), ref);
  }

  async listLayers(options?: { projects?: readonly string[] | undefined }): Promise<LayerInfo[]> {
    const sdk = await loadSdk();
    const client = await this.client();
    const found: { key: string; ref: string }[] = [];
    // The platform's records, then every project's or the ones asked for (blobs are never listed).
    const projects = options?.projects;
    const prefixes =
      projects === undefined
        ? ['layers/', 'projects/']
        : [
            'layers/',
            ...[...new Set(projects)]
              .filter((p) => LAYER_PROJECT_PATTERN.test(p))
              .map((p) => `projects/${p}/layers/`),
          ];
    for (const under of prefixes) {
      let token: string | undefined;
      do {
        const page = await client
          .send(
            new sdk.ListObjectsV2Command({
              Bucket: this.bucket,
              Prefix: this.prefix + under,
              ...(token !== undefined ? { ContinuationToken: token } : {}),
            }),
          )
          .catch((err: unknown) => {
            throw this.mapError(err, 'the layer index');
          });
        for (const object of page.Contents ?? []) {
          const ref = object.Key === undefined ? undefined : this.recordRef(object.Key);
          if (ref !== undefined) found.push({ key: object.Key!, ref });
        }
        token = page.IsTruncated ? page.NextContinuationToken : undefined;
      } while (token !== undefined);
    }
    const records = await mapBounded(found, 8, async (f) => {
      try {
        return await this.readRecord(f.key, f.ref);
      } catch (err) {
        // Removed between the listing and the read: not a layer any more.
        if (err instanceof DsecError && err.code === 'image_not_found') return undefined;
        throw err;
      }
    });
    return records.filter((r): r is LayerInfo => r !== undefined).sort(compareLayers);
  }

  async removeLayer(ref: string, options?: { project?: string | undefined }): Promise<void> {
    const key = this.recordKey(storeKey(ref, options));
    const removed = await this.readRecord(key, ref);
    await this.deleteObject(key, `layer ${ref}`);
    const inUse = new Set((await this.listLayers()).flatMap(layerDigests));
    for (const digest of layerDigests(removed)) {
      if (!inUse.has(digest)) await this.deleteBlobObject(digest);
    }
  }

  /** The object's size, or undefined when there is none. */
  private async head(key: string, signal?: AbortSignal): Promise<number | undefined> {
    const sdk = await loadSdk();
    const client = await this.client();
    try {
      const out = await client.send(
        new sdk.HeadObjectCommand({ Bucket: this.bucket, Key: key }),
        signalOpt(signal),
      );
      return out.ContentLength ?? 0;
    } catch (err) {
      if (isNotFound(err)) return undefined;
      throw this.mapError(err, key, signal);
    }
  }

  private async deleteObject(key: string, what: string): Promise<void> {
    const sdk = await loadSdk();
    const client = await this.client();
    await client
      .send(new sdk.DeleteObjectCommand({ Bucket: this.bucket, Key: key }))
      .catch((err: unknown) => {
        if (isNotFound(err)) return;
        throw this.mapError(err, what);
      });
  }

  private async readRecord(key: string, ref: string): Promise<LayerInfo> {
    const sdk = await loadSdk();
    const client = await this.client();
    let text: string;
    try {
      const out = await client.send(new sdk.GetObjectCommand({ Bucket: this.bucket, Key: key }));
      text = out.Body ? await out.Body.transformToString('utf8') : '';
    } catch (err) {
      if (isNotFound(err))
        throw new DsecError('image_not_found', `no layer ${ref}`, { cause: err });
      throw this.mapError(err, `layer ${ref}`);
    }
    try {
      const layer = JSON.parse(text) as LayerInfo;
      validateLayerInfo(layer);
      // A record must sit where its name and version say, or lookups would lie.
      if (key !== this.recordKey(layer)) throw new Error(`record names ${formatLayerKey(layer)}`);
      return layer;
    } catch (err) {
      throw new DsecError('internal', `layer record ${key} in ${this.location} is corrupt`, {
        cause: err,
      });
    }
  }

  /** Translates an SDK or network failure into the closed error set. */
  private mapError(err: unknown, what: string, signal?: AbortSignal): DsecError {
    if (err instanceof DsecError) return err;
    const e = err as { name?: unknown; code?: unknown; Code?: unknown; message?: unknown };
    const name = String(e.Code ?? e.name ?? '');
    const code = String(e.code ?? '');
    const status = statusOf(err);
    const message = typeof e.message === 'string' ? e.message : String(err);
    if (signal?.aborted || name === 'AbortError' || code === 'ABORT_ERR') {
      return new DsecError('aborted', `${what}: operation aborted`, { cause: err });
    }
    if (name === 'NoSuchBucket') {
      return new DsecError(
        'invalid_argument',
        `bucket ${this.bucket} does not exist at ${this.where}; create it first (aws s3 mb s3://${this.bucket})`,
        { field: 'bucket', cause: err },
      );
    }
    if (
      ['AccessDenied', 'InvalidAccessKeyId', 'SignatureDoesNotMatch', 'Forbidden'].includes(name) ||
      status === 403 ||
      name === 'CredentialsProviderError'
    ) {
      return new DsecError(
        'permission_denied',
        `${this.where} refused access to ${what} (${name && name !== 'Unknown' ? name : `HTTP ${status}`}); check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY`,
        { cause: err },
      );
    }
    if (isNotFound(err)) return new DsecError('image_not_found', `no ${what}`, { cause: err });
    if (
      NETWORK_CODES.has(code) ||
      name === 'TimeoutError' ||
      (status !== undefined && status >= 500)
    ) {
      return new DsecError('unavailable', `S3 endpoint ${this.where} unavailable: ${message}`, {
        cause: err,
        details: { endpoint: this.where },
      });
    }
    return new DsecError('internal', `${what} in ${this.location}: ${message}`, { cause: err });
  }
}

const NETWORK_CODES = new Set([
  'ECONNREFUSED',
  'ECONNRESET',
  'ETIMEDOUT',
  'EHOSTUNREACH',
  'ENETUNREACH',
  'ENOTFOUND',
  'EAI_AGAIN',
  'EPIPE',
  'ECONNABORTED',
]);

function statusOf(err: unknown): number | undefined {
  return (err as { $metadata?: { httpStatusCode?: number } } | undefined)?.$metadata
    ?.httpStatusCode;
}

function isNotFound(err: unknown): boolean {
  const e = err as { name?: unknown; Code?: unknown } | undefined;
  const name = String(e?.Code ?? e?.name ?? '');
  if (name === 'NoSuchBucket') return false;
  return name === 'NoSuchKey' || name === 'NotFound' || statusOf(err) === 404;
}

function signalOpt(signal: AbortSignal | undefined): { abortSignal?: AbortSignal } {
  return signal ? { abortSignal: signal } : {};
}

function normalizePrefix(prefix: string): string {
  const trimmed = prefix.replace(/^\/+/, '').replace(/\/+$/, '');
  if (trimmed === '') return '';
  if (
    !PREFIX_PATTERN.test(trimmed) ||
    trimmed.split('/').some((s) => s === '' || s === '.' || s === '..')
  ) {
    throw new DsecError(
      'invalid_argument',
      `prefix ${JSON.stringify(prefix)} must be /-separated segments of A-Z a-z 0-9 ! _ . * ' ( ) -`,
      { field: 'prefix' },
    );
  }
  return trimmed + '/';
}

function assertEndpoint(endpoint: string): void {
  let url: URL | undefined;
  try {
    url = new URL(endpoint);
  } catch {
    url = undefined;
  }
  if (
    !url ||
    (url.protocol !== 'http:' && url.protocol !== 'https:') ||
    url.username !== '' ||
    url.password !== '' ||
    url.search !== '' ||
    url.hash !== ''
  ) {
    throw new DsecError(
      'invalid_argument',
      `endpoint ${JSON.stringify(endpoint.replace(/\/\/[^/?#]*@/, '//***@'))} must be an http(s) URL without credentials or query, e.g. http://127.0.0.1:9000`,
      { field: 'endpoint' },
    );
  }
}

function changedWhileStoring(file: string): DsecError {
  return new DsecError('invalid_argument', `${file} changed while it was being stored`, {
    field: 'file',
  });
}

/** Passes the file through, counting and re-hashing; fails the upload if the file changed. */
function verifyingStream(
  file: string,
  digest: string,
  sizeBytes: number,
  onProgress: ((bytesDone: number) => void) | undefined,
): Transform & { failure?: DsecError } {
  const hash = createHash('sha256');
  let done = 0;
  const stream: Transform & { failure?: DsecError } = new Transform({
    transform(chunk: Buffer, _enc, cb) {
      hash.update(chunk);
      done += chunk.length;
      if (done > sizeBytes) {
        stream.failure = changedWhileStoring(file);
        cb(stream.failure);
        return;
      }
      onProgress?.(done);
      cb(null, chunk);
    },
    flush(cb) {
      if (done !== sizeBytes || `sha256:${hash.digest('hex')}` !== digest) {
        stream.failure = changedWhileStoring(file);
        cb(stream.failure);
        return;
      }
      cb();
    },
  });
  return stream;
}

async function hashFile(input: FileHandle, signal: AbortSignal | undefined): Promise<string> {
  const hash = createHash('sha256');
  const buf = Buffer.allocUnsafe(HASH_CHUNK_BYTES);
  let position = 0;
  for (;;) {
    throwIfAborted(signal);
    const { bytesRead } = await input.read(buf, 0, buf.length, position);
    if (bytesRead === 0) break;
    hash.update(buf.subarray(0, bytesRead));
    position += bytesRead;
  }
  return `sha256:${hash.digest('hex')}`;
}

async function readExactly(
  input: FileHandle,
  position: number,
  length: number,
  file: string,
): Promise<Buffer> {
  const buf = Buffer.allocUnsafe(length);
  let got = 0;
  while (got < length) {
    const { bytesRead } = await input.read(buf, got, length - got, position + got);
    if (bytesRead === 0) throw changedWhileStoring(file);
    got += bytesRead;
  }
  return buf;
}

/** Waits for a shared download; the download stops only when every waiter has given up. */
async function waitShared(download: Download, signal: AbortSignal | undefined): Promise<string> {
  download.waiters++;
  if (!signal) return await download.promise;
  let onAbort: (() => void) | undefined;
  try {
    return await Promise.race([
      download.promise,
      new Promise<never>((_, reject) => {
        onAbort = () => {
          reject(new DsecError('aborted', 'operation aborted', { cause: signal.reason }));
        };
        if (signal.aborted) onAbort();
        else signal.addEventListener('abort', onAbort, { once: true });
      }),
    ]);
  } catch (err) {
    if (signal.aborted && --download.waiters === 0) download.controller.abort();
    throw err;
  } finally {
    if (onAbort) signal.removeEventListener('abort', onAbort);
  }
}

async function mapBounded<T, R>(
  items: readonly T[],
  limit: number,
  fn: (item: T) => Promise<R>,
): Promise<R[]> {
  const out = new Array<R>(items.length);
  let next = 0;
  const worker = async (): Promise<void> => {
    while (next < items.length) {
      const i = next++;
      out[i] = await fn(items[i]!);
    }
  };
  await Promise.all(Array.from({ length: Math.min(limit, items.length) }, worker));
  return out;
}

async function isFile(path: string): Promise<boolean> {
  try {
    return (await stat(path)).isFile();
  } catch {
    return false;
  }
}

function tempName(): string {
  return `.tmp-${process.pid}-${randomBytes(8).toString('hex')}`;
}
