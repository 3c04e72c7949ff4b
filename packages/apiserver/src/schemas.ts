import { z } from 'zod';
import {
  DsecError,
  isSandboxUser,
  parseLayerRef,
  DEFAULT_COMMAND_TIMEOUT_MS,
  MAX_VOLUME_MOUNTS,
  MAX_VOLUME_PATH_CHARS,
  SANDBOX_ID_COUNT,
  VOLUME_NAME_RE,
  VOLUME_SIZE_MB,
} from '@dsec/core';
import type { SandboxSpec } from '@dsec/core';

/**
 * Request schemas of HTTP API v1 (docs/CONVENTIONS.md), the one place where
 * wire input is checked and defaults are applied. Every object is `.strict()`:
 * an unknown field is an error naming that field. Strings are bounded and
 * may not carry NUL bytes (they end up in argv, env and paths).
 */

const KIB = 1024;
const MIB = 1024 * KIB;

const noNul = (s: string) => !s.includes('\0');
const text = (max: number) => z.string().max(max).refine(noNul, 'must not contain NUL bytes');
const layerRef = z
  .string()
  .max(300)
  .refine(
    (s) => parseLayerRef(s) !== undefined,
    'must be a layer reference `name` or `name:version`',
  );
/**
 * Who a sandbox, a command or a file call runs as: `USER` or `USER:GROUP`
 * (docker's `--user`), each a name or an id of the sandbox's own range.
 */
export const userName = z
  .string()
  .regex(
    /^(?:[a-z_][a-z0-9_-]{0,31}|[0-9]{1,5})(?::(?:[a-z_][a-z0-9_-]{0,31}|[0-9]{1,5}))?$/,
    'must be USER or USER:GROUP, each a name or a numeric id',
  )
  .refine(isSandboxUser, `must be USER[:GROUP], each a name or an id below ${SANDBOX_ID_COUNT}`);
/** IDs are opaque to the API layer; IAM and the edges decide whether they exist. */
const opaqueId = z
  .string()
  .min(1)
  .max(128)
  .regex(/^[A-Za-z0-9._:-]+$/, 'must be an ID');
const boundedRecord = <T extends z.ZodTypeAny>(key: z.ZodString, value: T, maxEntries: number) =>
  z
    .record(key, value)
    .refine((r) => Object.keys(r).length <= maxEntries, `at most ${maxEntries} entries`);
const envMap = boundedRecord(
  z.string().regex(/^[A-Za-z_][A-Za-z0-9_]{0,255}$/, 'must be an environment variable name'),
  text(32 * KIB),
  256,
);
const labelMap = boundedRecord(
  z.string().regex(/^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$/, 'must be a label key'),
  text(256),
  64,
);
const int = (min: number, max: number) => z.number().int().min(min).max(max);
const ports = z.array(int(1, 65535)).min(1).max(64);
/** An explicit egress target (issue 5); the edge checks domain syntax and CIDRs in depth. */
export const NetworkTarget = z.union([
  z
    .object({
      domain: z
        .string()
        .max(253)
        .regex(/^(?:\*\.)?[A-Za-z0-9_.-]+$/, 'must be a domain or *.domain'),
      ports: ports.optional(),
    })
    .strict(),
  z
    .object({
      cidr: z
        .string()
        .max(64)
        .regex(/^[0-9A-Fa-f:.]+(?:\/\d{1,3})?$/, 'must be an IPv4 or IPv6 CIDR'),
      ports: ports.optional(),
    })
    .strict(),
]);
const networkTargets = z.array(NetworkTarget).max(256);
const networkRules = boundedRecord(
  z.string().regex(/^[a-z0-9][a-z0-9._-]{0,63}$/, 'must be a rule name'),
  z.boolean(),
  64,
);

/** A volume mount of a create (docs/volumes.md); names and paths are checked in depth by `checkVolumeMounts`. */
export const VolumeMountBody = z
  .object({
    name: z.string().max(63).regex(VOLUME_NAME_RE, 'must be a volume name'),
    path: z
      .string()
      .max(MAX_VOLUME_PATH_CHARS)
      .regex(/^\//, 'must be an absolute path')
      .refine(noNul, 'must not contain NUL bytes'),
  })
  .strict();

export const CreateVolumeBody = z
  .object({
    name: z.string().max(63).regex(VOLUME_NAME_RE, 'must be a volume name'),
    sizeMb: int(VOLUME_SIZE_MB.min, VOLUME_SIZE_MB.max),
    projectId: opaqueId.optional(),
  })
  .strict();

export const VolumeParams = z
  .object({ name: z.string().max(63).regex(VOLUME_NAME_RE, 'must be a volume name') })
  .strict();

export const VolumeQuery = z.object({ projectId: opaqueId.optional() }).strict();

export const CreateSandboxBody = z
  .object({
    backend: z.enum(['container', 'microvm', 'vm', 'fncall']).default('container'),
    image: layerRef,
    workspace: layerRef.optional(),
    toolkits: z.array(layerRef).max(32).default([]),
    memoryLimitMb: int(16, 1_048_576).default(512),
    cpuCoresLimit: z.number().min(0.01).max(256).default(1),
    pidsLimit: int(16, 1_000_000).default(1024),
    diskLimitMb: int(16, 1_048_576).optional(),
    /** CPU QoS class (paper 5.2): best-effort yields to latency-sensitive work. */
    qosClass: z.enum(['latency-sensitive', 'best-effort']).default('latency-sensitive'),
    ttlSeconds: int(1, 604_800).default(3600),
    networkRules: networkRules.default({}),
    networkAllow: networkTargets.optional(),
    networkDeny: networkTargets.optional(),
    initUser: userName.default('root'),
    env: envMap.default({}),
    labels: labelMap.default({}),
    /** Labels the chosen edge must carry (`{ pool: 'gpu', hardware: 'h200' }`). */
    edgeSelector: boundedRecord(
      z.string().regex(/^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$/, 'must be a label key'),
      z.string().regex(/^[A-Za-z0-9._:/-]{0,63}$/, 'must be a label value'),
      16,
    ).optional(),
    /** The project's volumes to mount (docs/volumes.md); the sandbox runs on their edge. */
    volumes: z.array(VolumeMountBody).max(MAX_VOLUME_MOUNTS).optional(),
    projectId: opaqueId.optional(),
    requestId: z
      .string()
      .regex(/^[A-Za-z0-9._:-]{1,128}$/, 'must be 1–128 chars of [A-Za-z0-9._:-]')
      .optional(),
  })
  .strict();
export type CreateSandboxInput = z.infer<typeof CreateSandboxBody>;

export function toSandboxSpec(b: CreateSandboxInput): SandboxSpec {
  return {
    backend: b.backend,
    image: b.image,
    workspace: b.workspace,
    toolkits: b.toolkits,
    memoryLimitMb: b.memoryLimitMb,
    cpuCoresLimit: b.cpuCoresLimit,
    pidsLimit: b.pidsLimit,
    ...(b.diskLimitMb !== undefined ? { diskLimitMb: b.diskLimitMb } : {}),
    qosClass: b.qosClass,
    ttlSeconds: b.ttlSeconds,
    networkRules: b.networkRules,
    ...(b.networkAllow ? { networkAllow: b.networkAllow } : {}),
    ...(b.networkDeny ? { networkDeny: b.networkDeny } : {}),
    initUser: b.initUser,
    env: b.env,
    labels: b.labels,
    ...(b.edgeSelector && Object.keys(b.edgeSelector).length > 0
      ? { edgeSelector: b.edgeSelector }
      : {}),
    ...(b.volumes && b.volumes.length > 0 ? { volumes: b.volumes } : {}),
  };
}

/** Client idempotency keys (sandbox creates, commands). */
export const requestIdString = z
  .string()
  .regex(/^[A-Za-z0-9._:-]{1,128}$/, 'must be 1–128 chars of [A-Za-z0-9._:-]');

export const CommandBody = z
  .object({
    argv: z
      .array(text(128 * KIB))
      .min(1)
      .max(4096)
      .refine((a) => (a[0] ?? '') !== '', 'argv.0 must not be empty')
      .optional(),
    shell: text(MIB).optional(),
    env: envMap.optional(),
    cwd: text(4096)
      .refine((s) => s.length > 0, 'must not be empty')
      .optional(),
    user: userName.optional(),
    stdin: z.string().max(MIB).optional(),
    timeoutMs: int(1, 86_400_000).default(DEFAULT_COMMAND_TIMEOUT_MS),
    maxOutputBytes: int(0, 67_108_864).default(1_048_576),
    /** Idempotency key: the command runs at most once per sandbox (issue 4). */
    requestId: requestIdString.optional(),
    /** Answer `{ commandId, … }` at once (202) instead of waiting for the result. */
    background: z.boolean().default(false),
    /** Keep stdin open for `POST …/commands/:cid/stdin` chunks. */
    stdinOpen: z.boolean().optional(),
  })
  .strict()
  .superRefine((b, ctx) => {
    if ((b.argv === undefined) === (b.shell === undefined)) {
      ctx.addIssue({
        code: z.ZodIssueCode.custom,
        path: ['argv'],
        message: 'give exactly one of argv or shell',
      });
    }
  });
export type CommandInput = z.infer<typeof CommandBody>;

export const ProjectBody = z
  .object({
    name: z
      .string()
      .regex(/^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$/, 'must be 1–63 chars of [A-Za-z0-9._-]'),
    parentId: opaqueId.optional(),
    quota: z
      .object({
        sandboxes: int(0, 1_000_000_000).optional(),
        memoryMb: int(0, 1_000_000_000_000).optional(),
        cpuCores: z.number().min(0).max(1_000_000).optional(),
        fncallsPerSecond: int(0, 1_000_000_000).optional(),
        /** Bytes of layers (snapshots, forks) the subtree may own. */
        imageBytes: int(0, Number.MAX_SAFE_INTEGER).optional(),
        volumeBytes: int(0, Number.MAX_SAFE_INTEGER).optional(),
      })
      .strict()
      .optional(),
  })
  .strict();

export const KeyBody = z
  .object({
    projectId: opaqueId,
    role: z.enum(['admin', 'member']).default('member'),
    name: text(128).optional(),
    /** Key scopes (`sandboxes:snapshot`, `fncall:run`, `volumes:use`, `metrics:read`, `images:run:<pattern>`); IAM checks their form and that the caller holds them. Absent: unscoped. */
    scopes: z.array(z.string().max(300)).max(32).optional(),
  })
  .strict();

/** A TTL from now, within the create bounds. */
const ttl = int(1, 604_800);

/** `POST /v1/sandboxes/:id/timeout`: the sandbox stops `seconds` from now. */
export const TimeoutBody = z.object({ seconds: ttl }).strict();

/**
 * A path to scrub from a snapshot: absolute, no `..` (it names a place in the
 * sandbox, resolved there by the edge); a trailing `/**` takes a whole tree.
 */
const scrubPath = text(4096)
  .refine((s) => s.startsWith('/'), 'must be an absolute path')
  .refine((s) => !s.split('/').includes('..'), 'must not contain ..');

/** `POST /v1/sandboxes/:id/snapshot`. */
export const SnapshotBody = z
  .object({ name: layerRef, scrub: z.array(scrubPath).max(256).default([]) })
  .strict();

/** Forks at most per call: each is a full create, through placement and quota. */
export const MAX_FORKS = 64;

/** `POST /v1/sandboxes/:id/fork`. */
export const ForkBody = z.object({ count: int(1, MAX_FORKS) }).strict();

/** `POST /v1/sandboxes:pause|resume|stop|extend`: a label selector (every label must match). */
export const JobBody = z
  .object({
    labels: labelMap.refine((r) => Object.keys(r).length > 0, 'must name at least one label'),
    projectId: opaqueId.optional(),
    /** `extend` only: the sandboxes stop this many seconds from now. */
    seconds: ttl.optional(),
  })
  .strict();

/** `PATCH /v1/sandboxes/:id/network`: rules merged by name, lists replaced when given. */
export const NetworkPatchBody = z
  .object({
    networkRules: networkRules.optional(),
    allow: networkTargets.optional(),
    deny: networkTargets.optional(),
  })
  .strict();

export const EventsQuery = z
  .object({
    afterId: z
      .string()
      .regex(/^\d{1,15}$/, 'must be an event ID')
      .transform(Number)
      .optional(),
    limit: z
      .string()
      .regex(/^\d{1,4}$/, 'must be 1–1000')
      .transform(Number)
      .refine((n) => n >= 1 && n <= 1000, 'must be 1–1000')
      .optional(),
  })
  .strict();

/** A `label=k=v` query value (repeatable): keys and values as in `labels`. */
const labelFilter = z
  .string()
  .max(400)
  .refine(noNul, 'must not contain NUL bytes')
  .refine(
    (s) => /^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}=/.test(s) && s.length - s.indexOf('=') - 1 <= 256,
    'must be key=value',
  );

export const ListSandboxesQuery = z
  .object({
    projectId: opaqueId.optional(),
    /** `?label=job=x&label=team=y`: only sandboxes carrying every one of them. */
    label: z.union([labelFilter, z.array(labelFilter).max(64)]).optional(),
  })
  .strict()
  .transform(({ projectId, label }) => ({
    projectId,
    labels:
      label === undefined
        ? undefined
        : Object.fromEntries(
            (Array.isArray(label) ? label : [label]).map((kv) => {
              const i = kv.indexOf('=');
              return [kv.slice(0, i), kv.slice(i + 1)];
            }),
          ),
  }));
export const IdParams = z.object({ id: z.string().max(256) }).strict();

/**
 * Parses `value` or throws `invalid_argument` naming the first offending
 * field as a dotted path (`env.PATH`, `argv.0`, `quota.memoryMb`).
 */
export function parse<S extends z.ZodTypeAny>(
  schema: S,
  value: unknown,
  what = 'request body',
): z.output<S> {
  const r = schema.safeParse(value);
  if (r.success) return r.data as z.output<S>;
  const issue = r.error.issues[0];
  if (!issue) throw new DsecError('invalid_argument', `invalid ${what}`);
  const path = issue.path.map(String);
  if (issue.code === z.ZodIssueCode.unrecognized_keys) path.push(issue.keys[0] ?? '');
  // Keys come from the client: a field path is capped so a huge key cannot bloat the answer.
  const field = path.length > 0 ? path.join('.').slice(0, 256) : undefined;
  const message =
    issue.code === z.ZodIssueCode.unrecognized_keys
      ? `unknown field ${JSON.stringify(field)}`
      : field === undefined
        ? `${what}: ${issue.message === 'Required' ? 'a JSON object is required' : issue.message}`
        : `${field}: ${issue.message}`;
  throw new DsecError('invalid_argument', message, { field });
}
