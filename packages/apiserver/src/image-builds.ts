import { createWriteStream } from 'node:fs';
import { mkdir, mkdtemp, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { Transform, type Readable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import {
  DsecError,
  formatLayerKey,
  formatLayerRef,
  isDsecError,
  parseLayerRef,
  randomId,
  type LayerInfo,
} from '@dsec/core';
import { isScoped, mayRunImage, maySnapshot, SNAPSHOT_SCOPE } from '@dsec/iam';
import type { Iam, Principal } from '@dsec/iam';
import {
  DEFAULT_BUILD_CONTEXT_LIMITS,
  unpackBuildContext,
  type BuildContextLimits,
} from './build-context.js';
import type { ImageService } from './image-service.js';

/** One build as the node's builder runs it (`ImageBuilder.build`). */
export interface ImageBuildRequest {
  /** The owner of the result: the caller's project (its namespace, its `imageBytes` quota). */
  project: string;
  name: string;
  version: string;
  /** The unpacked context, a directory of the apiserver's own under `ImageBuilder.workDir`. */
  contextDir: string;
  /** The Dockerfile, relative to the context (default `Dockerfile`). */
  dockerfile?: string | undefined;
  buildArgs: Record<string, string>;
  target?: string | undefined;
  timeoutMs: number;
  /**
   * Stages `FROM` these references start from these layers of the store
   * (resolved in the caller's view), never pulled (`buildDockerfile`'s `storeBases`).
   */
  storeBases?: Record<string, { ref: string; project?: string | undefined; digest: string }>;
  signal: AbortSignal;
  /** One line of the build's output (buildah's `STEP` lines and each step's output). */
  onLog(line: string): void;
}

/**
 * The Dockerfile builder of the node holding the image store (`dsec up`
 * wires `buildDockerfile` of `@dsec/images`, buildah and the node's egress
 * machinery): the apiserver itself never runs a build.
 */
export interface ImageBuilder {
  /** Scratch space on the same file system as the builder's: uploaded contexts land here. */
  workDir: string;
  build(request: ImageBuildRequest): Promise<{ layer: LayerInfo; cached: boolean }>;
  /** Removes a layer the build stored in `project`'s namespace (one over its quota). */
  remove(ref: string, project: string): Promise<void>;
  /**
   * Records `to` as a second name of `from` (same blobs) in `project`'s
   * namespace, replacing a record `to` held; answers the new record.
   */
  tag?(project: string, from: string, to: string): Promise<LayerInfo>;
}

export interface ImageBuildLimits extends BuildContextLimits {
  /** Bytes of the uploaded archive (413 `payload_too_large` past it). Default 1 GiB. */
  maxContextBytes: number;
  /** Builds of one project running at once (429 `quota_exceeded`). Default 2. */
  maxBuildsPerProject: number;
  /** Builds of the node running at once (503 `capacity_exhausted`). Default 4. */
  maxBuilds: number;
  /** A build's default and greatest timeout. Default 30 minutes and 2 hours. */
  defaultTimeoutMs: number;
  maxTimeoutMs: number;
  /** The log tail kept per build, in bytes (older lines are dropped). Default 64 KiB. */
  maxLogBytes: number;
  /** Finished builds remembered per project (oldest forgotten first). Default 50. */
  keepFinished: number;
  /** Time the whole upload may take (a trickling client holds a build slot). Default 10 minutes. */
  uploadTimeoutMs: number;
}

export const DEFAULT_IMAGE_BUILD_LIMITS: ImageBuildLimits = {
  ...DEFAULT_BUILD_CONTEXT_LIMITS,
  maxContextBytes: 2 ** 30,
  maxBuildsPerProject: 2,
  maxBuilds: 4,
  defaultTimeoutMs: 30 * 60_000,
  maxTimeoutMs: 2 * 3600_000,
  maxLogBytes: 64 * 1024,
  keepFinished: 50,
  uploadTimeoutMs: 10 * 60_000,
};

/** One line of output is cut here before it is kept. */
const MAX_LOG_LINE = 2048;

export type ImageBuildStatus = 'building' | 'ready' | 'failed';

/** `GET /v1/images/builds/:id`. */
export interface ImageBuildInfo {
  id: string;
  /** The name as the request gave it. */
  name: string;
  /** The layer it makes, `name:version`, in the caller's project's namespace. */
  image: string;
  status: ImageBuildStatus;
  /** A failure's message; `errorCode` and `errorDetails` are its error's code and details. */
  error?: string;
  errorCode?: string;
  errorDetails?: Record<string, unknown>;
  /** The tail of the build's output (at most `maxLogBytes`). */
  log?: string;
  /** True when an identical build was stored and nothing ran. */
  cached?: boolean;
  /** The built layer's digest and size, once ready. */
  digest?: string;
  sizeBytes?: number;
  createdAt: string;
  finishedAt?: string;
}

export interface StartBuildInput {
  name: string;
  dockerfile?: string | undefined;
  buildArgs?: Record<string, string> | undefined;
  target?: string | undefined;
  timeoutMs?: number | undefined;
  /** The archive (application/x-tar). */
  body: Readable;
  /** Aborts the upload (the client left). */
  signal?: AbortSignal | undefined;
}

interface BuildRecord {
  info: ImageBuildInfo;
  project: string;
  /** The top-level project (the tenant) above `project`, whose builds share one bound. */
  tenant: string;
  log: string[];
  logBytes: number;
  controller: AbortController;
  done: Promise<void>;
}

/**
 * Dockerfile builds over the API (`POST /v1/images/builds`): the context
 * arrives as a tar archive, is unpacked under `unpackBuildContext`'s rules
 * into the builder's scratch space and built there by the node's builder
 * into a layer of the caller's project, charged to its `imageBytes` quota.
 * The answer comes once the context is unpacked (202, `building`); the
 * build runs on and is polled (`GET /v1/images/builds/:id`), listed, or
 * cancelled (`DELETE`). Build records live in this apiserver's memory: a
 * restart forgets them (the layers stay), and another apiserver does not
 * know them.
 *
 * Who may build: an unscoped key, or a scoped one with `sandboxes:snapshot`
 * (a builder's right) under a name its own run patterns do not match, as
 * for snapshots. A name another namespace of the project's view holds
 * (the platform's, an ancestor's) is `conflict`: the build would be
 * shadowed. Bounds: the archive's bytes and entries, builds at once per
 * project and per node, the timeout, the log kept.
 */
export class ImageBuildService {
  readonly limits: ImageBuildLimits;
  readonly #builds = new Map<string, BuildRecord>();

  constructor(
    readonly deps: {
      iam: Iam;
      images: ImageService;
      builder?: ImageBuilder | undefined;
      limits?: Partial<ImageBuildLimits> | undefined;
    },
  ) {
    this.limits = { ...DEFAULT_IMAGE_BUILD_LIMITS, ...deps.limits };
  }

  /** The builder's scratch space (`unavailable` without a builder). */
  get workDir(): string {
    return this.#builder().workDir;
  }

  /** Resolves once build `id` of the caller's project has finished, with how it ended. */
  async wait(principal: Principal, id: string): Promise<ImageBuildInfo> {
    const record = this.#own(principal, id);
    await record.done;
    return this.#view(record);
  }

  /** A build from an uploaded tar context (`POST /v1/images/builds`). */
  async start(principal: Principal, input: StartBuildInput): Promise<ImageBuildInfo> {
    return await this.startPrepared(principal, {
      ...input,
      prepare: async (work, contextDir) => {
        const tar = join(work, 'context.tar');
        const upload = AbortSignal.any([
          ...(input.signal ? [input.signal] : []),
          AbortSignal.timeout(this.limits.uploadTimeoutMs),
        ]);
        await receive(input.body, tar, this.limits.maxContextBytes, upload);
        const unpacked = await unpackBuildContext(tar, contextDir, this.limits, input.signal);
        await rm(tar, { force: true });
        // The builder opens the Dockerfile by path: it must be a regular file the archive
        // made, under directories it made (never through one of its symlinks).
        const dockerfile = input.dockerfile ?? 'Dockerfile';
        if (unpacked.kindOf(dockerfile) !== 'file') {
          throw new DsecError(
            'invalid_argument',
            `the build context holds no regular file ${JSON.stringify(dockerfile.slice(0, 200))} (a symlink is not followed)`,
            { field: 'dockerfile' },
          );
        }
        // buildah reads the ignore files on the host, following links: one that is a symlink
        // the archive made (`.dockerignore -> /etc/shadow`, `-> /dev/zero`) would be read
        // through it, outside the context.
        for (const ignore of ['.dockerignore', '.containerignore', `${dockerfile}.dockerignore`]) {
          const kind = unpacked.kindOf(ignore);
          if (kind !== undefined && kind !== 'file') {
            throw new DsecError(
              'invalid_argument',
              `${JSON.stringify(ignore.slice(0, 200))} in the build context must be a regular file (a ${kind} is not followed)`,
              { field: 'context', details: { reason: 'tar_link', path: ignore.slice(0, 300) } },
            );
          }
        }
        return { dockerfile };
      },
    });
  }

  /**
   * A build whose context `prepare` writes into `contextDir` (a fresh
   * directory of the builder's scratch space; `work` beside it is scratch
   * too) and whose Dockerfile it names: the E2B template build writes a
   * Dockerfile it translated and the files the SDK uploaded. The same
   * checks, slots, quota and record as `start`; `onLog` also gets every
   * line of the build's output.
   */
  async startPrepared(
    principal: Principal,
    input: Omit<StartBuildInput, 'body' | 'dockerfile'> & {
      prepare(work: string, contextDir: string): Promise<{ dockerfile: string }>;
      onLog?: ((line: string) => void) | undefined;
      /**
       * `FROM` reference → layer `name[:version]` the stage starts from
       * instead of pulling it: the layer the caller's view resolves the
       * name to (the platform's first), so a build never starts from a
       * layer its caller could not start a sandbox from;
       * `invalid_argument` when the view holds none (naming only the layer).
       */
      storeBases?: Record<string, string> | undefined;
    },
  ): Promise<ImageBuildInfo> {
    const { iam } = this.deps;
    const builder = this.#builder();
    const project = principal.projectId;
    if (!maySnapshot(principal)) {
      await iam.audit(principal.keyId, 'images.build', input.name, 'denied', {
        reason: 'no snapshot scope',
      });
      throw new DsecError(
        'permission_denied',
        `building an image needs the ${SNAPSHOT_SCOPE} scope`,
      );
    }
    const ref = parseLayerRef(input.name);
    if (!ref) {
      throw new DsecError(
        'invalid_argument',
        'name must be an image name `name` or `name:version` (lower-case letters, digits, `.`, `_`, `-`)',
        { field: 'name' },
      );
    }
    const image = formatLayerRef(ref);
    if (isScoped(principal) && mayRunImage(principal, image)) {
      await iam.audit(principal.keyId, 'images.build', image, 'denied', {
        reason: 'name within own run scope',
      });
      throw new DsecError(
        'permission_denied',
        `this key may run ${image}, so it may not build it (a builder key and a runtime key are separate)`,
        { field: 'name' },
      );
    }
    const timeoutMs = input.timeoutMs ?? this.limits.defaultTimeoutMs;
    if (!Number.isInteger(timeoutMs) || timeoutMs <= 0 || timeoutMs > this.limits.maxTimeoutMs) {
      throw new DsecError(
        'invalid_argument',
        `timeout must be a positive number of seconds, at most ${this.limits.maxTimeoutMs / 1000}`,
        { field: 'timeout' },
      );
    }
    // A name the project's view holds in a namespace resolved before its own would shadow the build.
    const visible = await this.deps.images.list(principal, { all: false }).catch((err: unknown) => {
      if (isDsecError(err, 'unavailable')) return [] as LayerInfo[];
      throw err;
    });
    const holder = visible.find((l) => formatLayerRef(l) === image && l.project !== project);
    if (holder) {
      throw new DsecError(
        'conflict',
        `${image} is ${holder.project === undefined ? "the platform's" : "an ancestor project's"}; a build under that name would never be used`,
        { field: 'name', details: { reason: 'name_taken' } },
      );
    }
    const storeBases: NonNullable<ImageBuildRequest['storeBases']> = {};
    for (const [from, layerRef] of Object.entries(input.storeBases ?? {})) {
      const want = parseLayerRef(layerRef);
      const layer = want && visible.find((l) => formatLayerRef(l) === formatLayerRef(want));
      if (!layer) {
        throw new DsecError(
          'invalid_argument',
          `FROM ${from.slice(0, 130)}: its base image ${layerRef.slice(0, 130)} is not there`,
          { field: 'fromImage', details: { reason: 'store_base', ref: layerRef.slice(0, 300) } },
        );
      }
      storeBases[from] = {
        ref: formatLayerRef(layer),
        ...(layer.project !== undefined ? { project: layer.project } : {}),
        digest: layer.digest,
      };
    }
    // The bound per project holds for a tenant's whole tree: its child projects (it may make
    // a thousand of each) share its slots, else one tenant takes every slot of the node.
    const lineage = await iam.lineage(project);
    const tenant = lineage[1] ?? lineage[0] ?? project;
    // Slots next, checked and taken with no await between (concurrent requests see each other);
    // a refused build reads no byte of its upload.
    const running = [...this.#builds.values()].filter((b) => b.info.status === 'building');
    if (running.some((b) => b.project === project && b.info.image === image)) {
      throw new DsecError('conflict', `${image} is being built already`, {
        field: 'name',
        details: { reason: 'build_running' },
      });
    }
    if (running.filter((b) => b.tenant === tenant).length >= this.limits.maxBuildsPerProject) {
      throw new DsecError(
        'quota_exceeded',
        `the project runs ${this.limits.maxBuildsPerProject} builds already; wait for one to finish`,
        { details: { resource: 'builds', limit: this.limits.maxBuildsPerProject } },
      );
    }
    if (running.length >= this.limits.maxBuilds) {
      throw new DsecError('capacity_exhausted', 'the node runs as many builds as it takes', {
        details: { resource: 'builds', limit: this.limits.maxBuilds },
      });
    }
    const id = randomId('bld');
    const info: ImageBuildInfo = {
      id,
      name: input.name,
      image,
      status: 'building',
      createdAt: new Date().toISOString(),
    };
    const record: BuildRecord = {
      info,
      project,
      tenant,
      log: [],
      logBytes: 0,
      controller: new AbortController(),
      done: Promise.resolve(),
    };
    // Holds the slot while the upload arrives.
    this.#builds.set(id, record);
    let work: string | undefined;
    try {
      await mkdir(builder.workDir, { recursive: true, mode: 0o700 });
      work = await mkdtemp(join(builder.workDir, 'api-build-'));
      const contextDir = join(work, 'context');
      await mkdir(contextDir, { mode: 0o755 });
      const { dockerfile } = await input.prepare(work, contextDir);
      // Nothing is held while it builds (the bound of a build's layer is unknown): the room
      // left is checked now, the layer charged what it weighs once it is stored.
      const reservation = randomId('img');
      await iam.reserveImageBytes(project, reservation, undefined, {
        actorKeyId: principal.keyId,
      });
      await iam.audit(principal.keyId, 'images.build', image, 'ok', { buildId: id });
      const dir = work;
      work = undefined;
      record.done = this.#run(
        record,
        builder,
        principal,
        {
          project,
          name: ref.name,
          version: ref.version,
          contextDir,
          dockerfile,
          buildArgs: input.buildArgs ?? {},
          target: input.target,
          timeoutMs,
          ...(Object.keys(storeBases).length > 0 ? { storeBases } : {}),
          signal: record.controller.signal,
          onLog: (line) => {
            this.#log(record, line);
            input.onLog?.(line);
          },
        },
        reservation,
      ).finally(() => rm(dir, { recursive: true, force: true }));
      return this.#view(record);
    } catch (err) {
      this.#builds.delete(id);
      if (work !== undefined) await rm(work, { recursive: true, force: true });
      throw err;
    }
  }

  async #run(
    record: BuildRecord,
    builder: ImageBuilder,
    principal: Principal,
    request: ImageBuildRequest,
    reservation: string,
  ): Promise<void> {
    const { iam } = this.deps;
    try {
      const { layer, cached } = await builder.build(request);
      if (!cached) {
        try {
          await iam.bindImageBytes(
            reservation,
            request.project,
            formatLayerKey(layer),
            layer.sizeBytes,
            {
              actorKeyId: principal.keyId,
            },
          );
        } catch (err) {
          await builder.remove(formatLayerRef(layer), request.project).catch(() => undefined);
          throw err;
        }
      }
      Object.assign(record.info, {
        status: 'ready',
        cached,
        digest: layer.digest,
        sizeBytes: layer.sizeBytes,
      } satisfies Partial<ImageBuildInfo>);
    } catch (err) {
      const e = isDsecError(err)
        ? err
        : new DsecError('internal', 'the build failed on the node (see its log)', { cause: err });
      Object.assign(record.info, {
        status: 'failed',
        error: e.code === 'internal' ? 'the build failed on the node (see its log)' : e.message,
        errorCode: e.code,
        ...(e.details ? { errorDetails: e.details } : {}),
      } satisfies Partial<ImageBuildInfo>);
    } finally {
      await iam.releaseImageBytes(reservation).catch(() => undefined);
      record.info.finishedAt = new Date().toISOString();
      this.#forgetOld(record.project);
    }
  }

  /**
   * Gives the layer `from` (`name:version`, of the caller's project's own
   * namespace) a second name `to` in the same namespace: the same blobs, no
   * new bytes charged (the E2B template tags). A record `to` held already is
   * replaced. `image_not_found` when the project owns no `from`.
   */
  async tag(principal: Principal, from: string, to: string): Promise<LayerInfo> {
    const builder = this.#builder();
    if (!builder.tag) throw new DsecError('unavailable', 'this builder cannot tag layers');
    const source = parseLayerRef(from);
    const target = parseLayerRef(to);
    if (!source || !target)
      throw new DsecError('invalid_argument', 'tags name layers as `name:version`', {
        field: 'tags',
      });
    const project = principal.projectId;
    const owned = await this.ownLayers(principal);
    if (!owned.some((l) => formatLayerRef(l) === formatLayerRef(source)))
      throw new DsecError('image_not_found', `no layer ${formatLayerRef(source)}`, {
        field: 'target',
      });
    // A record `to` held goes as `DELETE /v1/images/:ref` removes it: not while another layer
    // stacks on it (its blobs would go from under that layer), its bytes given back.
    if (
      formatLayerRef(source) !== formatLayerRef(target) &&
      owned.some((l) => formatLayerRef(l) === formatLayerRef(target))
    )
      await this.deps.images.remove(principal, formatLayerRef(target), {});
    const layer = await builder.tag(project, formatLayerRef(source), formatLayerRef(target));
    // The tag is a record of its own that keeps the blobs on disk after the layer it names is
    // deleted (`DELETE /v1/images/:ref` gives that layer's bytes back): so it is charged what
    // it weighs, under its own key, replacing the charge of a record `to` held. Past the quota
    // the tag is removed again.
    const key = formatLayerKey(layer);
    try {
      await this.deps.iam.bindImageBytes(key, project, key, layer.sizeBytes, {
        actorKeyId: principal.keyId,
      });
    } catch (err) {
      await builder.remove(formatLayerRef(layer), project).catch(() => undefined);
      await this.deps.iam.releaseImageBytes(key).catch(() => undefined);
      throw err;
    }
    await this.deps.iam.audit(principal.keyId, 'images.tag', formatLayerRef(target), 'ok', {
      from: formatLayerRef(source),
    });
    return layer;
  }

  /**
   * Removes a tag `ref` (a record of the project's own namespace), leaving
   * the blobs other records use, and gives its bytes back: the same removal
   * as `DELETE /v1/images/:ref` (a record other layers stack on stays).
   */
  async untag(principal: Principal, ref: string): Promise<void> {
    this.#builder();
    const parsed = parseLayerRef(ref);
    if (!parsed) throw new DsecError('invalid_argument', 'not a layer name', { field: 'tags' });
    const owned = await this.ownLayers(principal);
    if (!owned.some((l) => formatLayerRef(l) === formatLayerRef(parsed)))
      throw new DsecError('image_not_found', `no layer ${formatLayerRef(parsed)}`, {
        field: 'tags',
      });
    await this.deps.images.remove(principal, formatLayerRef(parsed), {});
  }

  /** The layers the caller's project owns itself (not its ancestors', not the platform's). */
  async ownLayers(principal: Principal): Promise<LayerInfo[]> {
    const layers = await this.deps.images.list(principal, { all: false });
    return layers.filter((l) => l.project === principal.projectId);
  }

  /** A build of the caller's project; `not_found` for any other (another project's too). */
  get(principal: Principal, id: string): ImageBuildInfo {
    return this.#view(this.#own(principal, id));
  }

  /** The caller's project's builds, newest first. */
  list(principal: Principal): ImageBuildInfo[] {
    return [...this.#builds.values()]
      .filter((b) => b.project === principal.projectId)
      .reverse()
      .map((b) => this.#view(b, false));
  }

  /** Stops a running build (it ends `failed`, `aborted`); a finished one is left as it is. */
  async cancel(principal: Principal, id: string): Promise<ImageBuildInfo> {
    const record = this.#own(principal, id);
    if (record.info.status === 'building') {
      record.controller.abort(new DsecError('aborted', 'the build was cancelled'));
      await record.done;
    }
    return this.#view(record);
  }

  /** Waits for every running build (tests, shutdown). */
  async settle(): Promise<void> {
    await Promise.all([...this.#builds.values()].map((b) => b.done));
  }

  /** Cancels every running build and waits for them. */
  async close(): Promise<void> {
    for (const b of this.#builds.values())
      b.controller.abort(new DsecError('aborted', 'the apiserver is shutting down'));
    await this.settle();
  }

  #builder(): ImageBuilder {
    if (!this.deps.builder) {
      throw new DsecError(
        'unavailable',
        'this apiserver has no image builder: builds run on the node that holds the image store (`dsec up`); in a cluster, build with `dsec image build --dockerfile` on that node',
        { details: { reason: 'builds_unavailable' } },
      );
    }
    return this.deps.builder;
  }

  #own(principal: Principal, id: string): BuildRecord {
    const record = this.#builds.get(id);
    if (!record || record.project !== principal.projectId) {
      throw new DsecError('not_found', `no build ${JSON.stringify(id.slice(0, 100))}`, {
        field: 'id',
      });
    }
    return record;
  }

  #view(record: BuildRecord, withLog = true): ImageBuildInfo {
    return {
      ...record.info,
      ...(withLog && record.log.length > 0 ? { log: record.log.join('\n') } : {}),
    };
  }

  #log(record: BuildRecord, raw: string): void {
    const line = raw.length > MAX_LOG_LINE ? `${raw.slice(0, MAX_LOG_LINE)}…` : raw;
    record.log.push(line);
    record.logBytes += Buffer.byteLength(line) + 1;
    while (record.logBytes > this.limits.maxLogBytes && record.log.length > 1)
      record.logBytes -= Buffer.byteLength(record.log.shift()!) + 1;
  }

  #forgetOld(project: string): void {
    const finished = [...this.#builds.values()].filter(
      (b) => b.project === project && b.info.status !== 'building',
    );
    for (const b of finished.slice(0, Math.max(0, finished.length - this.limits.keepFinished)))
      this.#builds.delete(b.info.id);
  }
}

/** Writes the upload to `file`, refusing one past `maxBytes` (413) as soon as it gets there. */
async function receive(
  body: Readable,
  file: string,
  maxBytes: number,
  signal: AbortSignal | undefined,
): Promise<void> {
  let bytes = 0;
  const counter = new Transform({
    transform(chunk: Buffer, _enc, done) {
      bytes += chunk.length;
      if (bytes > maxBytes) {
        done(
          new DsecError('payload_too_large', `the build context is larger than ${maxBytes} bytes`, {
            field: 'context',
            details: { reason: 'context_too_large', maxContextBytes: maxBytes },
          }),
        );
        return;
      }
      done(null, chunk);
    },
  });
  try {
    await pipeline(body, counter, createWriteStream(file, { flags: 'wx', mode: 0o600 }), {
      ...(signal ? { signal } : {}),
    });
  } catch (err) {
    if (isDsecError(err)) throw err;
    if (signal?.aborted) {
      throw new DsecError('deadline_exceeded', 'the build context did not arrive in time', {
        field: 'context',
        details: { reason: 'upload_timeout' },
      });
    }
    throw new DsecError('invalid_argument', 'the build context upload broke off', {
      field: 'context',
      cause: err,
    });
  }
}
