import { randomUUID } from 'node:crypto';
import { writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import type { Readable } from 'node:stream';
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import {
  clientGone,
  retryAfterSeconds,
  sourceOf,
  toHttpError,
  type CallerLimits,
  type ImageBuildInfo,
  type ImageBuildService,
} from '@dsec/apiserver';
import {
  DsecError,
  LAYER_NAME_PATTERN,
  LAYER_PROJECT_PATTERN,
  LAYER_VERSION_PATTERN,
  parseLayerRef,
  type LayerInfo,
} from '@dsec/core';
import type { Iam, Principal } from '@dsec/iam';
import { authenticateE2b, type E2bCaller } from './auth.js';
import { e2bErrorBody } from './errors.js';
import { TemplateFiles, type TemplateFilesLimits } from './template-files.js';
import { resolveTemplate, type E2bTemplates } from './templates.js';

/**
 * E2B's template builds (`Template.build`, `Template.exists`, tags) on
 * DSec's Dockerfile builder (`ImageBuildService`, `POST /v1/images/builds`).
 *
 * The SDK's flow, as the `e2b` JS SDK 2.x drives it: `POST /v3/templates`
 * names the template and its tags and gets a template and build ID; each
 * `COPY` step's files go up as a tar per files hash (`GET
 * /templates/:id/files/:hash` answers whether they are there and a link to
 * PUT them to, `TemplateFiles`); `POST /v2/templates/:id/builds/:build`
 * sends the steps; `GET /templates/:id/builds/:build/status` is polled with
 * a log offset until `ready` or `error` (`reason.step` names the failed
 * step). The steps become a Dockerfile (`templateDockerfile`) built into a
 * layer of the caller's project, `name:b-<buildID>`, then named by each tag
 * (`name:<tag>`; E2B's `default` tag is DSec's `latest`), so
 * `Sandbox.create('name')` and `Sandbox.create('name:tag')` start it
 * through the ordinary template reading (templates.ts). The template ID is
 * the name. Build records are this apiserver's memory; layers and tags are
 * the image store's.
 */

/** The user E2B's templates run as, with its home (E2B's base images have it, with sudo). */
export const TEMPLATE_USER = 'user';
/** Step names E2B's SDK maps to its first and last stack frames. */
const BASE_STEP = 'base';
const FINALIZE_STEP = 'finalize';
/** A tag is never a build's own version (`b-<buildID>`). */
const BUILD_VERSION_PREFIX = 'b-';
const MAX_STEPS = 1000;
const MAX_ARG_BYTES = 64 * 1024;
const MAX_LOG_ENTRIES = 5000;
/** Bytes of the log kept per build (older entries dropped), and of one entry. */
const MAX_LOG_BYTES = 256 * 1024;
const MAX_LOG_LINE = 2048;
const KEEP_BUILDS_PER_PROJECT = 50;
/** Builds asked for and not started yet, per project (the oldest forgotten past it). */
const MAX_WAITING_PER_PROJECT = 100;
/** Pending builds (requested, never started) are forgotten after this. */
const PENDING_TTL_MS = 3600_000;

/** A step of `TemplateBuildStartV2` (E2B's spec/openapi.yml). */
export interface TemplateStep {
  type: string;
  args: string[];
  filesHash?: string | undefined;
}

export interface TemplateBuildStart {
  fromImage?: string | undefined;
  fromTemplate?: string | undefined;
  steps: TemplateStep[];
  startCmd?: string | undefined;
  readyCmd?: string | undefined;
}

/**
 * The Dockerfile a template build stands for, and which E2B step each of
 * its lines belongs to (for `reason.step`). `filesDir(hash)` is where a
 * `COPY` step's uploaded files lie, relative to the context.
 *
 * The base step makes sure the user `user` exists with its home (E2B's
 * templates run as it; passwordless sudo where sudo is installed), then the
 * steps run as `user` in `/home/user` unless they say otherwise, as E2B
 * runs them: `RUN` (with an optional user: `USER` around it), `COPY` (owned
 * by its user, else the current one; its mode), `ENV`, `WORKDIR`, `USER`.
 * `startCmd` is recorded as the image's entrypoint (DSec does not run it at
 * create); `readyCmd` is not used. `invalid_argument` (field `steps`,
 * `details.step`) for a step DSec cannot build.
 */
export function templateDockerfile(
  start: TemplateBuildStart,
  filesDir: (hash: string) => string,
): { dockerfile: string; stepOfLine: Map<number, string> } {
  const lines: string[] = [];
  const stepOfLine = new Map<number, string>();
  const push = (step: string, line: string): void => {
    lines.push(line);
    stepOfLine.set(lines.length, step);
  };
  if (start.fromTemplate !== undefined) {
    throw stepError(
      BASE_STEP,
      'fromTemplate is not supported by DSec: build from an image (fromImage), or start sandboxes from the other template directly',
    );
  }
  if (
    start.fromImage === undefined ||
    !/^[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}$/.test(start.fromImage)
  ) {
    throw stepError(BASE_STEP, 'fromImage must name an image (registry/repository:tag)');
  }
  push(BASE_STEP, `FROM ${start.fromImage}`);
  push(BASE_STEP, 'USER root');
  push(BASE_STEP, `RUN ${json(['/bin/sh', '-c', ENSURE_USER])}`);
  push(BASE_STEP, `USER ${TEMPLATE_USER}`);
  push(BASE_STEP, `WORKDIR /home/${TEMPLATE_USER}`);
  let user = TEMPLATE_USER;
  if (start.steps.length > MAX_STEPS) throw stepError(BASE_STEP, `at most ${MAX_STEPS} steps`);
  start.steps.forEach((s, i) => {
    const step = String(i + 1);
    const args = s.args;
    switch (s.type) {
      case 'RUN': {
        const [cmd, as] = args;
        if (cmd === undefined) throw stepError(step, 'RUN needs a command');
        if (as !== undefined && as !== '' && as !== user) {
          push(step, `USER ${checkUser(as, step)}`);
          push(step, `RUN ${json(['/bin/sh', '-c', cmd])}`);
          push(step, `USER ${user}`);
        } else push(step, `RUN ${json(['/bin/sh', '-c', cmd])}`);
        break;
      }
      case 'COPY': {
        const [src, dest, owner, mode] = args;
        if (src === undefined || dest === undefined)
          throw stepError(step, 'COPY needs a source and a destination');
        if (s.filesHash === undefined) throw stepError(step, 'COPY without its files hash');
        const rel = src.replace(/^\.\//, '');
        if (rel.startsWith('/') || rel.split('/').includes('..'))
          throw stepError(step, `COPY source ${JSON.stringify(src)} must be inside the context`);
        const chown = owner !== undefined && owner !== '' ? checkUser(owner, step) : user;
        const flags = [`--chown=${chown}`];
        if (mode !== undefined && mode !== '') {
          if (!/^[0-7]{3,4}$/.test(mode))
            throw stepError(step, `COPY mode ${JSON.stringify(mode)} is not octal`);
          flags.push(`--chmod=${mode}`);
        }
        push(step, `COPY ${flags.join(' ')} ${json([`${filesDir(s.filesHash)}/${rel}`, dest])}`);
        break;
      }
      case 'ENV': {
        if (args.length === 0 || args.length % 2 !== 0)
          throw stepError(step, 'ENV takes name/value pairs');
        const pairs: string[] = [];
        for (let k = 0; k < args.length; k += 2) {
          const name = args[k]!;
          const value = args[k + 1]!;
          if (!/^[A-Za-z_][A-Za-z0-9_]{0,255}$/.test(name))
            throw stepError(
              step,
              `ENV name ${JSON.stringify(name.slice(0, 100))} is not a variable name`,
            );
          pairs.push(`${name}=${envValue(value, step)}`);
        }
        push(step, `ENV ${pairs.join(' ')}`);
        break;
      }
      case 'WORKDIR': {
        const [dir] = args;
        if (dir === undefined || dir === '' || hasControl(dir))
          throw stepError(step, 'WORKDIR needs a path');
        push(step, `WORKDIR ${dir}`);
        break;
      }
      case 'USER': {
        const [as] = args;
        if (as === undefined) throw stepError(step, 'USER needs a user');
        user = checkUser(as, step);
        push(step, `USER ${user}`);
        break;
      }
      default:
        throw stepError(
          step,
          `steps of type ${JSON.stringify(String(s.type).slice(0, 40))} are not supported`,
        );
    }
  });
  if (start.startCmd !== undefined && start.startCmd !== '') {
    push(FINALIZE_STEP, `ENTRYPOINT ${json(['/bin/sh', '-c', start.startCmd])}`);
  }
  return { dockerfile: lines.join('\n') + '\n', stepOfLine };
}

/** The base step's user set-up: `user` with `/home/user` (useradd, busybox adduser, or by hand), sudo without a password. */
const ENSURE_USER = [
  `if ! id ${TEMPLATE_USER} >/dev/null 2>&1; then`,
  `  useradd -m -s /bin/bash ${TEMPLATE_USER} 2>/dev/null || adduser -D -s /bin/sh ${TEMPLATE_USER} 2>/dev/null ||`,
  `  { echo '${TEMPLATE_USER}:x:1000:1000::/home/${TEMPLATE_USER}:/bin/sh' >>/etc/passwd && echo '${TEMPLATE_USER}:x:1000:' >>/etc/group; };`,
  'fi',
  `mkdir -p /home/${TEMPLATE_USER} && chown ${TEMPLATE_USER}: /home/${TEMPLATE_USER} 2>/dev/null || chown 1000:1000 /home/${TEMPLATE_USER}`,
  `if [ -d /etc/sudoers.d ]; then echo '${TEMPLATE_USER} ALL=(ALL:ALL) NOPASSWD: ALL' >/etc/sudoers.d/${TEMPLATE_USER} && chmod 0440 /etc/sudoers.d/${TEMPLATE_USER}; fi`,
].join('\n');

function json(v: string[]): string {
  for (const a of v)
    if (Buffer.byteLength(a) > MAX_ARG_BYTES)
      throw stepError(FINALIZE_STEP, 'a step argument is too long');
  return JSON.stringify(v);
}

function hasControl(s: string): boolean {
  return /[\u0000-\u001f\u007f]/.test(s);
}

function envValue(value: string, step: string): string {
  if (hasControl(value) || Buffer.byteLength(value) > MAX_ARG_BYTES)
    throw stepError(step, 'ENV values must be one line of at most 64 KiB');
  return `"${value.replace(/[\\"$]/g, (c) => `\\${c}`)}"`;
}

function checkUser(user: string, step: string): string {
  if (!/^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,63})?$/.test(user))
    throw stepError(step, `${JSON.stringify(user.slice(0, 70))} is not a user name`);
  return user;
}

function stepError(step: string, message: string): DsecError {
  return new DsecError('invalid_argument', `step ${step}: ${message}`, {
    field: 'steps',
    details: { reason: 'template_step', step },
  });
}

// ---- base image aliases ----------------------------------------------------------

/** E2B's own base image, which `Template().fromBaseImage()` builds from. */
export const E2B_BASE_IMAGE = 'e2bdev/base';
/** An alias value naming a layer of the store rather than a registry image. */
const LAYER_PREFIX = 'layer:';

/**
 * Image references a template build's `fromImage` is read as before
 * anything is pulled (`e2b.imageAliases`): `layer:<name[:version]>` builds
 * on that layer of the store (the one the caller's view resolves the name
 * to, as `Sandbox.create` would), any other value is the registry image
 * the build pulls instead.
 */
export type E2bImageAliases = Record<string, string>;

/** containers/image transports (`oci:/path` reads the host's files), as the builder refuses them. */
const TRANSPORT =
  /^(?:docker:\/\/|(?:docker-archive|docker-daemon|oci|oci-archive|dir|containers-storage|ostree|sif|tarball):)/i;

/** `docker.io/library/x:latest`, `docker.io/x`, `x:latest` and `x` are one name. */
function normalizeImage(ref: string): string {
  let r = ref.toLowerCase();
  r = r.replace(/^(?:docker\.io|index\.docker\.io|registry-1\.docker\.io)\//, '');
  r = r.replace(/^library\//, '');
  return r.endsWith(':latest') ? r.slice(0, -':latest'.length) : r;
}

/** An alias's target checked: a layer reference or a registry reference (config time). */
export function checkImageAlias(from: string, to: string): void {
  const ok = to.startsWith(LAYER_PREFIX)
    ? parseLayerRef(to.slice(LAYER_PREFIX.length)) !== undefined
    : /^[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}$/.test(to) &&
      !/^localhost\/dsec-/i.test(to) &&
      !TRANSPORT.test(to);
  if (!ok || !/^[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}$/.test(from)) {
    throw new DsecError(
      'invalid_argument',
      `image alias ${JSON.stringify(from.slice(0, 130))}: ${JSON.stringify(to.slice(0, 130))} is neither layer:<name[:version]> nor an image reference`,
      { field: 'imageAliases' },
    );
  }
}

/**
 * What a build's `fromImage` stands for: the operator's alias of that
 * exact name (after Docker Hub's spellings: `docker.io/`, `library/`,
 * `:latest`), else, for E2B's `e2bdev/base`, the image of the template
 * `base`; else the name itself, pulled as it is. Only a whole name
 * matches: `e2bdev/base:other`, `evil.example/e2bdev/base` or a digest are
 * not aliased, so a caller picks neither the registry nor the layer an
 * alias leads to. `from` is what the Dockerfile's `FROM` names; `layer`
 * the store layer it stands for.
 */
export function resolveImageAlias(
  fromImage: string,
  aliases: E2bImageAliases = {},
  templates: E2bTemplates = {},
): { from: string; layer?: string } {
  const want = normalizeImage(fromImage);
  let to: string | undefined;
  for (const [name, target] of Object.entries(aliases))
    if (normalizeImage(name) === want) to = target;
  if (to === undefined && want === E2B_BASE_IMAGE && Object.hasOwn(templates, 'base')) {
    to = `${LAYER_PREFIX}${resolveTemplate('base', templates).image}`;
  }
  if (to === undefined) return { from: fromImage };
  if (to.startsWith(LAYER_PREFIX)) return { from: fromImage, layer: to.slice(LAYER_PREFIX.length) };
  return { from: to };
}

// ---- the routes ---------------------------------------------------------------

export interface TemplateBuildDeps {
  iam: Iam;
  builds: ImageBuildService;
  /** Operator-defined template names (they exist for `Template.exists`; `base` is `e2bdev/base`'s default). */
  templates?: E2bTemplates | undefined;
  /** `fromImage` names read as other images or as layers before a build pulls (`resolveImageAlias`). */
  imageAliases?: E2bImageAliases | undefined;
  limits?: CallerLimits | undefined;
  files?: Partial<TemplateFilesLimits> | undefined;
}

interface LogEntry {
  timestamp: string;
  level: 'debug' | 'info' | 'warn' | 'error';
  message: string;
}

interface TemplateBuild {
  project: string;
  principal: Principal;
  name: string;
  buildID: string;
  /** E2B's tags as asked, and the DSec versions they name. */
  tags: string[];
  versions: string[];
  status: 'waiting' | 'building' | 'ready' | 'error';
  log: LogEntry[];
  /** Bytes of the messages in `log`. */
  logBytes: number;
  /** Entries dropped from the front (the log's absolute start). */
  dropped: number;
  reason?: { message: string; step?: string | undefined };
  createdAt: number;
}

/** Registers the template build routes (two scopes: the API-key ones, and the upload link's). */
export function templateBuildRoutes(app: FastifyInstance, deps: TemplateBuildDeps): void {
  for (const [from, to] of Object.entries(deps.imageAliases ?? {})) checkImageAlias(from, to);
  // Stored files count in the project's imageBytes quota (as layers do).
  const files = new TemplateFiles(() => join(deps.builds.workDir, 'e2b-files'), deps.files, {
    bind: async (project, key, bytes) =>
      await deps.iam.bindImageBytes(key, project, key, bytes, {}),
    release: async (key) => {
      await deps.iam.releaseImageBytes(key);
    },
  });
  const builds = new Map<string, TemplateBuild>();
  const callers = new WeakMap<FastifyRequest, E2bCaller>();

  const errorHandler = (err: unknown, req: FastifyRequest, reply: FastifyReply) => {
    const e = toHttpError(err, req.id);
    if (e.status >= 500 && e.code !== 'unavailable' && e.code !== 'capacity_exhausted')
      req.log.error({ err, reqId: req.id }, 'request failed');
    if (e.code === 'rate_limited') reply.header('retry-after', retryAfterSeconds(e.details));
    return reply
      .code(e.status)
      .header('content-type', 'application/json; charset=utf-8')
      .send(e2bErrorBody(e.status, e));
  };

  const own = (p: Principal, templateID: string, buildID: string): TemplateBuild => {
    const b = builds.get(buildID);
    if (!b || b.project !== p.projectId || b.name !== templateID)
      throw new DsecError(
        'not_found',
        `no build ${buildID.slice(0, 64)} of template ${templateID.slice(0, 130)}`,
      );
    return b;
  };

  const log = (b: TemplateBuild, message: string, level: LogEntry['level'] = 'info'): void => {
    const text = message.length > MAX_LOG_LINE ? `${message.slice(0, MAX_LOG_LINE)}…` : message;
    b.log.push({ timestamp: new Date().toISOString(), level, message: text });
    b.logBytes += Buffer.byteLength(text);
    while (b.log.length > MAX_LOG_ENTRIES || (b.logBytes > MAX_LOG_BYTES && b.log.length > 1)) {
      b.logBytes -= Buffer.byteLength(b.log.shift()!.message);
      b.dropped++;
    }
  };

  const forget = (project: string): void => {
    const now = Date.now();
    const mine = [...builds.values()].filter((b) => b.project === project);
    for (const b of mine)
      if (b.status === 'waiting' && now - b.createdAt > PENDING_TTL_MS) builds.delete(b.buildID);
    // Names asked for in a loop and never built are bounded too (the newest are kept).
    const waiting = mine.filter((b) => b.status === 'waiting' && builds.has(b.buildID));
    for (const b of waiting.slice(0, Math.max(0, waiting.length - MAX_WAITING_PER_PROJECT + 1)))
      builds.delete(b.buildID);
    const done = mine.filter((b) => b.status === 'ready' || b.status === 'error');
    for (const b of done.slice(0, Math.max(0, done.length - KEEP_BUILDS_PER_PROJECT)))
      builds.delete(b.buildID);
  };

  void app.register(async (scope) => {
    scope.addHook('onRequest', async (req, reply) => {
      const caller = await authenticateE2b(deps.iam, req.headers, sourceOf(req.raw));
      callers.set(req, caller);
      const leave = deps.limits?.enterRequest(caller.principal.keyId);
      if (leave) reply.raw.once('close', leave).once('finish', leave);
    });
    scope.setErrorHandler(errorHandler);
    const principalOf = (req: FastifyRequest): Principal => {
      const c = callers.get(req);
      if (!c) throw new DsecError('unauthenticated', 'missing API key (X-API-Key)');
      return c.principal;
    };

    scope.post('/v3/templates', async (req, reply) => {
      const principal = principalOf(req);
      const body = objectOf(req.body);
      const { name, tags, versions } = templateName(body);
      // The builder is there (else 503 now, not at the build).
      void deps.builds.workDir;
      // A tag the platform or an ancestor holds under this name would be shadowed by theirs.
      const visible = await deps.builds.deps.images.list(principal, { all: false });
      const held = visible.find(
        (l) => l.name === name && versions.includes(l.version) && l.project !== principal.projectId,
      );
      if (held) {
        throw new DsecError(
          'conflict',
          `${name}:${held.version} is ${held.project === undefined ? "the platform's" : "an ancestor project's"}: choose another template name`,
          { field: 'name', details: { reason: 'name_taken' } },
        );
      }
      const buildID = randomUUID();
      forget(principal.projectId);
      builds.set(buildID, {
        project: principal.projectId,
        principal,
        name,
        buildID,
        tags,
        versions,
        status: 'waiting',
        log: [],
        logBytes: 0,
        dropped: 0,
        createdAt: Date.now(),
      });
      return reply.code(202).send({
        templateID: name,
        buildID,
        public: false,
        names: [name],
        aliases: [name],
        tags,
      });
    });

    scope.get('/templates/:templateID/files/:hash', async (req, reply) => {
      const principal = principalOf(req);
      const { templateID, hash } = req.params as { templateID: string; hash: string };
      TemplateFiles.checkHash(hash);
      checkTemplateId(templateID);
      const project = safeProject(principal.projectId);
      if (await files.present(project, hash)) return reply.code(201).send({ present: true });
      const token = files.token(project, templateID, hash);
      const url = `${originOf(req)}/templates/${encodeURIComponent(templateID)}/files/${hash}?project=${encodeURIComponent(project)}&token=${token}`;
      return reply.code(201).send({ present: false, url });
    });

    scope.post('/v2/templates/:templateID/builds/:buildID', async (req, reply) => {
      const principal = principalOf(req);
      const { templateID, buildID } = req.params as { templateID: string; buildID: string };
      const b = own(principal, templateID, buildID);
      if (b.status !== 'waiting')
        throw new DsecError('conflict', `build ${buildID} was started already`);
      const start = startOf(objectOf(req.body));
      const project = safeProject(principal.projectId);
      const alias =
        start.fromImage !== undefined && start.fromTemplate === undefined
          ? resolveImageAlias(start.fromImage, deps.imageAliases, deps.templates)
          : undefined;
      const { dockerfile, stepOfLine } = templateDockerfile(
        alias ? { ...start, fromImage: alias.from } : start,
        (hash) => `files/${TemplateFiles.checkHash(hash)}`,
      );
      const hashes = [
        ...new Set(start.steps.flatMap((s) => (s.filesHash !== undefined ? [s.filesHash] : []))),
      ];
      b.status = 'building';
      log(b, `Building ${b.name} from ${start.fromImage ?? '?'} (${start.steps.length} steps)`);
      if (alias && (alias.layer !== undefined || alias.from !== start.fromImage))
        log(b, `${start.fromImage}: the node's ${alias.layer ?? alias.from}`);
      if (start.readyCmd) log(b, 'readyCmd is recorded by E2B only: DSec does not run it', 'warn');
      if (start.startCmd)
        log(b, 'startCmd is the image entrypoint: DSec does not run it at create', 'warn');
      let info: ImageBuildInfo;
      try {
        info = await deps.builds.startPrepared(principal, {
          name: `${b.name}:${BUILD_VERSION_PREFIX}${buildID}`,
          signal: clientGone(reply),
          prepare: async (_work, contextDir) => {
            await writeFile(join(contextDir, 'Dockerfile'), dockerfile, { mode: 0o644 });
            for (const hash of hashes)
              await files.unpack(project, hash, join(contextDir, 'files', hash));
            return { dockerfile: 'Dockerfile' };
          },
          onLog: (line) => log(b, line),
          ...(alias?.layer !== undefined ? { storeBases: { [alias.from]: alias.layer } } : {}),
        });
      } catch (err) {
        b.status = 'waiting';
        throw err;
      }
      void deps.builds.wait(principal, info.id).then(
        async (done) => await finish(b, done, stepOfLine),
        (err: unknown) => {
          b.status = 'error';
          b.reason = { message: err instanceof Error ? err.message : String(err) };
        },
      );
      return reply.code(202).send();
    });

    scope.get('/templates/:templateID/builds/:buildID/status', async (req) => {
      const principal = principalOf(req);
      const { templateID, buildID } = req.params as { templateID: string; buildID: string };
      const q = req.query as Record<string, unknown>;
      const offset = intParam(q['logsOffset'], 0, 0, Number.MAX_SAFE_INTEGER, 'logsOffset');
      const limit = intParam(q['limit'], 100, 0, 100, 'limit');
      const b = own(principal, templateID, buildID);
      const from = Math.max(0, offset - b.dropped);
      const entries = b.log.slice(from, from + limit);
      // A failed build answers `error` only once its last lines were read, as E2B's SDK drains them.
      const status = b.status === 'waiting' ? 'waiting' : b.status;
      return {
        templateID,
        buildID,
        status,
        logs: entries.map((e) => `[${e.timestamp}] ${e.message}`),
        logEntries: entries,
        ...(b.reason
          ? {
              reason: {
                message: b.reason.message,
                ...(b.reason.step !== undefined ? { step: b.reason.step } : {}),
                logEntries: b.log.slice(-20),
              },
            }
          : {}),
      };
    });

    scope.get('/templates/aliases/:alias', async (req, reply) => {
      const principal = principalOf(req);
      const { alias } = req.params as { alias: string };
      const layer = await visibleTemplate(principal, alias);
      if (layer === undefined && !Object.hasOwn(deps.templates ?? {}, alias))
        throw new DsecError('not_found', `no template ${JSON.stringify(alias.slice(0, 130))}`);
      return reply.send({
        templateID: alias,
        public: layer === undefined || layer.project !== principal.projectId,
      });
    });

    scope.post('/templates/tags', async (req, reply) => {
      const principal = principalOf(req);
      const body = objectOf(req.body);
      const target = stringField(body, 'target', 300);
      const colon = target.lastIndexOf(':');
      const name = colon < 0 ? target : target.slice(0, colon);
      const fromVersion = colon < 0 ? 'latest' : versionOfTag(target.slice(colon + 1));
      checkTemplateId(name);
      const tags = tagList(body['tags']);
      let tagged: LayerInfo | undefined;
      for (const tag of tags)
        tagged = await deps.builds.tag(
          principal,
          `${name}:${fromVersion}`,
          `${name}:${versionOfTag(tag)}`,
        );
      const source =
        tagged ?? (await ownVersions(principal, name)).find((l) => l.version === fromVersion);
      return reply
        .code(201)
        .send({ tags, buildID: source ? await buildIdOf(principal, source) : '' });
    });

    scope.delete('/templates/tags', async (req, reply) => {
      const principal = principalOf(req);
      const body = objectOf(req.body);
      const name = stringField(body, 'name', 130);
      checkTemplateId(name);
      for (const tag of tagList(body['tags']))
        await deps.builds.untag(principal, `${name}:${versionOfTag(tag)}`);
      return reply.code(204).send();
    });

    scope.get('/templates/:templateID/tags', async (req) => {
      const principal = principalOf(req);
      const { templateID } = req.params as { templateID: string };
      checkTemplateId(templateID);
      const layers = await ownVersions(principal, templateID);
      if (layers.length === 0) throw new DsecError('not_found', `no template ${templateID}`);
      const out = [];
      for (const l of layers) {
        if (l.version.startsWith(BUILD_VERSION_PREFIX)) continue;
        out.push({
          tag: l.version === 'latest' ? 'default' : l.version,
          buildID: await buildIdOf(principal, l),
          createdAt: l.createdAt,
        });
      }
      return out;
    });
  });

  // The upload link: no API key (the SDK PUTs to it as to a presigned URL), the token instead.
  void app.register(async (scope) => {
    scope.setErrorHandler(errorHandler);
    scope.removeAllContentTypeParsers();
    scope.addContentTypeParser('*', (_req, payload, done) => done(null, payload));
    scope.put('/templates/:templateID/files/:hash', async (req, reply) => {
      const { templateID, hash } = req.params as { templateID: string; hash: string };
      const q = req.query as Record<string, unknown>;
      const project = typeof q['project'] === 'string' ? q['project'] : '';
      const token = typeof q['token'] === 'string' ? q['token'] : '';
      TemplateFiles.checkHash(hash);
      if (!LAYER_PROJECT_PATTERN.test(project))
        throw new DsecError('permission_denied', 'the upload link is invalid');
      files.checkToken(token, project, templateID, hash);
      const body = req.body as Readable | undefined;
      if (!body || typeof body.pipe !== 'function')
        throw new DsecError('invalid_argument', 'send the files as the body', { field: 'body' });
      await files.store(project, hash, body, clientGone(reply));
      return reply.code(200).send();
    });
  });

  async function finish(
    b: TemplateBuild,
    done: ImageBuildInfo,
    stepOfLine: Map<number, string>,
  ): Promise<void> {
    if (done.status === 'ready') {
      try {
        for (const v of b.versions)
          await deps.builds.tag(
            b.principal,
            `${b.name}:${BUILD_VERSION_PREFIX}${b.buildID}`,
            `${b.name}:${v}`,
          );
        log(b, `Build ${b.buildID} ready: ${b.tags.map((t) => `${b.name}:${t}`).join(', ')}`);
        b.status = 'ready';
      } catch (err) {
        b.status = 'error';
        b.reason = {
          message: err instanceof Error ? err.message : String(err),
          step: FINALIZE_STEP,
        };
      }
      return;
    }
    const line = done.errorDetails?.['line'];
    const step = typeof line === 'number' ? stepOfLine.get(line) : undefined;
    log(b, done.error ?? 'the build failed', 'error');
    b.reason = { message: done.error ?? 'the build failed', step: step ?? FINALIZE_STEP };
    b.status = 'error';
  }

  async function ownVersions(principal: Principal, name: string): Promise<LayerInfo[]> {
    return (await deps.builds.ownLayers(principal)).filter((l) => l.name === name);
  }

  async function visibleTemplate(
    principal: Principal,
    alias: string,
  ): Promise<LayerInfo | undefined> {
    const colon = alias.lastIndexOf(':');
    const name = colon < 0 ? alias : alias.slice(0, colon);
    const layers = await deps.builds.deps.images.list(principal, { all: false });
    return layers.find(
      (l) => l.name === name && (colon < 0 || l.version === versionOfTag(alias.slice(colon + 1))),
    );
  }

  /** The build a layer came from: its own version `b-<id>`, or the build whose layer has its digest. */
  async function buildIdOf(principal: Principal, layer: LayerInfo): Promise<string> {
    if (layer.version.startsWith(BUILD_VERSION_PREFIX))
      return layer.version.slice(BUILD_VERSION_PREFIX.length);
    const twin = (await ownVersions(principal, layer.name)).find(
      (l) => l.version.startsWith(BUILD_VERSION_PREFIX) && l.digest === layer.digest,
    );
    return twin ? twin.version.slice(BUILD_VERSION_PREFIX.length) : '';
  }
}

/** `name[:tag]` and `tags` of `POST /v3/templates`: the E2B tags and the DSec versions they name. */
function templateName(body: Record<string, unknown>): {
  name: string;
  tags: string[];
  versions: string[];
} {
  const raw =
    typeof body['name'] === 'string'
      ? body['name']
      : typeof body['alias'] === 'string'
        ? body['alias']
        : undefined;
  if (raw === undefined || raw.length > 128)
    throw new DsecError('invalid_argument', 'name is required (at most 128 characters)', {
      field: 'name',
    });
  const colon = raw.lastIndexOf(':');
  const name = colon < 0 ? raw : raw.slice(0, colon);
  checkTemplateId(name);
  const tags = [
    ...(colon < 0 ? [] : [raw.slice(colon + 1)]),
    ...(body['tags'] === undefined ? [] : tagList(body['tags'])),
  ];
  if (tags.length === 0) tags.push('default');
  const unique = [...new Set(tags)];
  return { name, tags: unique, versions: [...new Set(unique.map(versionOfTag))] };
}

function checkTemplateId(name: string): void {
  if (!LAYER_NAME_PATTERN.test(name)) {
    throw new DsecError(
      'invalid_argument',
      `template name ${JSON.stringify(name.slice(0, 130))}: lower-case letters, digits, '.', '_', '-' (DSec image names)`,
      { field: 'name' },
    );
  }
}

/** E2B's `default` tag is DSec's `latest` version; a tag is never a build's own version. */
function versionOfTag(tag: string): string {
  const v = tag === 'default' ? 'latest' : tag;
  if (!LAYER_VERSION_PATTERN.test(v) || v.startsWith(BUILD_VERSION_PREFIX)) {
    throw new DsecError(
      'invalid_argument',
      `tag ${JSON.stringify(tag.slice(0, 130))} is not a tag (letters, digits, '.', '_', '-'; not b-…)`,
      {
        field: 'tags',
      },
    );
  }
  return v;
}

function tagList(v: unknown): string[] {
  if (
    !Array.isArray(v) ||
    v.length === 0 ||
    v.length > 32 ||
    !v.every((t) => typeof t === 'string')
  )
    throw new DsecError('invalid_argument', 'tags: 1 to 32 strings', { field: 'tags' });
  for (const t of v) versionOfTag(t);
  return v;
}

function startOf(body: Record<string, unknown>): TemplateBuildStart {
  const opt = (k: string): string | undefined => {
    const v = body[k];
    if (v === undefined || v === null) return undefined;
    if (typeof v !== 'string' || Buffer.byteLength(v) > MAX_ARG_BYTES)
      throw new DsecError('invalid_argument', `${k} must be a string`, { field: k });
    return v;
  };
  if (body['fromImageRegistry'] !== undefined) {
    throw new DsecError(
      'invalid_argument',
      "fromImageRegistry (registry credentials per build) is not supported: the node's registries and credentials are its config's",
      { field: 'fromImageRegistry' },
    );
  }
  const steps = body['steps'] ?? [];
  if (!Array.isArray(steps) || steps.length > MAX_STEPS)
    throw new DsecError('invalid_argument', `steps: at most ${MAX_STEPS}`, { field: 'steps' });
  return {
    fromImage: opt('fromImage'),
    fromTemplate: opt('fromTemplate'),
    startCmd: opt('startCmd'),
    readyCmd: opt('readyCmd'),
    steps: steps.map((s: unknown, i): TemplateStep => {
      const o = (s ?? {}) as Record<string, unknown>;
      const args = o['args'] ?? [];
      if (
        typeof o['type'] !== 'string' ||
        !Array.isArray(args) ||
        args.length > 512 ||
        !args.every((a) => typeof a === 'string' && Buffer.byteLength(a) <= MAX_ARG_BYTES) ||
        (o['filesHash'] !== undefined && typeof o['filesHash'] !== 'string')
      ) {
        throw new DsecError(
          'invalid_argument',
          `step ${i + 1}: { type, args: strings, filesHash? }`,
          {
            field: 'steps',
            details: { step: String(i + 1) },
          },
        );
      }
      return {
        type: o['type'],
        args: args as string[],
        ...(o['filesHash'] !== undefined
          ? { filesHash: TemplateFiles.checkHash(o['filesHash']) }
          : {}),
      };
    }),
  };
}

function objectOf(b: unknown): Record<string, unknown> {
  if (b === undefined || b === null) return {};
  if (typeof b !== 'object' || Array.isArray(b))
    throw new DsecError('invalid_argument', 'request body must be a JSON object');
  return b as Record<string, unknown>;
}

function stringField(body: Record<string, unknown>, key: string, max: number): string {
  const v = body[key];
  if (typeof v !== 'string' || v === '' || v.length > max)
    throw new DsecError('invalid_argument', `${key} is required`, { field: key });
  return v;
}

function intParam(v: unknown, dflt: number, min: number, max: number, field: string): number {
  if (v === undefined) return dflt;
  const n = typeof v === 'string' && /^\d{1,15}$/.test(v) ? Number(v) : NaN;
  if (!Number.isInteger(n) || n < min || n > max)
    throw new DsecError('invalid_argument', `${field} must be an integer ${min}–${max}`, { field });
  return n;
}

function safeProject(project: string): string {
  if (!LAYER_PROJECT_PATTERN.test(project))
    throw new DsecError('internal', 'unexpected project ID form');
  return project;
}

/** This server as the client reached it (the upload link points back here). */
function originOf(req: FastifyRequest): string {
  const host = req.headers.host ?? '127.0.0.1';
  if (!/^[A-Za-z0-9.[\]:-]{1,300}$/.test(host))
    throw new DsecError('invalid_argument', 'bad Host header');
  return `${req.protocol}://${host}`;
}
