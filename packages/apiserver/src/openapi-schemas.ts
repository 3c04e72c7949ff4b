import { z } from 'zod';
import { extendZodWithOpenApi } from '@asteasolutions/zod-to-openapi';
import { ERROR_CODES } from '@dsec/core';
import type {
  CommandInfo,
  CommandResult,
  EdgeStatus,
  ErrorCode,
  FileInfo,
  FnCallPoolStatus,
  FnCallGpuUnitStatus,
  FnCallResult,
  LayerInfo,
  SandboxEvent,
  SandboxInfo,
  SessionInfo,
  SessionResult,
  SnapshotInfo,
} from '@dsec/core';
import type { CreatedKey, Project } from '@dsec/iam';
import type { ForkResult, JobResult } from './sandbox-service.js';

/**
 * Response schemas of HTTP API v1, for the OpenAPI document (`openapi.ts`).
 * The request schemas are the ones the routes parse with (`schemas.ts`,
 * `schemas-io.ts`); the answers are built from `@dsec/core` and `@dsec/iam`
 * types, so each schema here is checked against its type at compile time
 * (`Same` below): a field added to a type without its schema, or the other
 * way round, fails the type-check. Objects are open (no
 * `additionalProperties: false`): clients must ignore fields they do not know.
 */

// Adds `.openapi()` to zod's prototype; the generator reads names and descriptions from it.
extendZodWithOpenApi(z);

const isoTime = z.string().openapi({ format: 'date-time' });
const stringMap = z.record(z.string(), z.string());

export const ErrorCodeSchema = z
  .enum(Object.keys(ERROR_CODES) as [ErrorCode, ...ErrorCode[]])
  .openapi('ErrorCode', {
    description:
      'The closed set of error codes (docs/errors.md). Clients match on the code, never the message. ' +
      Object.entries(ERROR_CODES)
        .map(([code, e]) => `\`${code}\` (${e.status}${e.retryable ? ', retryable' : ''})`)
        .join(', '),
  });

export const ErrorBodySchema = z
  .object({
    error: z.object({
      code: ErrorCodeSchema,
      message: z.string(),
      field: z
        .string()
        .optional()
        .openapi({ description: 'The request field at fault, as a dotted path (`argv.0`).' }),
      details: z.record(z.string(), z.unknown()).optional(),
    }),
  })
  .openapi('Error', {
    description: 'Every non-2xx answer of the API (except proxied port answers).',
  });

const NetworkTargetOut = z
  .union([
    z.object({ domain: z.string(), ports: z.array(z.number().int()).optional() }),
    z.object({ cidr: z.string(), ports: z.array(z.number().int()).optional() }),
  ])
  .openapi('NetworkTargetInfo');

export const SandboxSpecSchema = z
  .object({
    backend: z.enum(['container', 'microvm', 'vm', 'fncall']),
    image: z.string(),
    workspace: z.string().optional(),
    toolkits: z.array(z.string()),
    memoryLimitMb: z.number().int(),
    cpuCoresLimit: z.number(),
    pidsLimit: z.number().int(),
    qosClass: z.enum(['latency-sensitive', 'best-effort']).optional(),
    diskLimitMb: z.number().int().optional(),
    ttlSeconds: z.number().int(),
    networkRules: z.record(z.string(), z.boolean()),
    networkAllow: z.array(NetworkTargetOut).optional(),
    networkDeny: z.array(NetworkTargetOut).optional(),
    initUser: z.string(),
    env: stringMap,
    labels: stringMap,
    edgeSelector: stringMap.optional(),
    volumes: z
      .array(z.object({ name: z.string(), path: z.string() }))
      .optional()
      .openapi({ description: 'Volumes mounted at create (docs/volumes.md).' }),
  })
  .openapi('SandboxSpec');

export const VolumeInfoSchema = z
  .object({
    name: z.string(),
    projectId: z.string(),
    sizeMb: z.number().int(),
    edgeId: z.string().openapi({
      description: 'The edge that holds its bytes; sandboxes that mount it run there.',
    }),
    state: z.enum(['creating', 'ready']),
    createdAt: isoTime,
    usedBytes: z
      .number()
      .int()
      .optional()
      .openapi({ description: 'Bytes in use now (single gets only, when the edge answers).' }),
    mountedBy: z
      .array(z.string())
      .optional()
      .openapi({ description: 'Sandboxes that mount it now (single gets only).' }),
  })
  .openapi('VolumeInfo');

export const SandboxStateSchema = z
  .enum(['creating', 'running', 'paused', 'stopping', 'stopped', 'failed'])
  .openapi('SandboxState');

export const SandboxInfoSchema = z
  .object({
    id: z.string(),
    edgeId: z.string(),
    projectId: z.string(),
    state: SandboxStateSchema,
    spec: SandboxSpecSchema,
    createdAt: isoTime,
    expiresAt: isoTime.openapi({ description: 'When the TTL stops it (while running).' }),
    reason: z.string().optional(),
    pausedAt: isoTime.optional(),
    pausedExpiresAt: isoTime.optional(),
    memoryBytes: z
      .number()
      .int()
      .optional()
      .openapi({ description: 'Host memory charged to the sandbox now (single gets only).' }),
  })
  .openapi('SandboxInfo');

export const CommandResultSchema = z
  .object({
    commandId: z.string(),
    exitCode: z.number().int(),
    signal: z.string().optional(),
    outcome: z.enum(['exited', 'signaled', 'timeout', 'killed', 'oom']),
    stdout: z.string(),
    stderr: z.string(),
    truncated: z.boolean(),
    stdoutBytes: z.number().int(),
    stderrBytes: z.number().int(),
    durationMs: z.number(),
    reason: z.string().optional(),
  })
  .openapi('CommandResult');

export const CommandInfoSchema = z
  .object({
    commandId: z.string(),
    sandboxId: z.string(),
    requestId: z.string().optional(),
    fingerprint: z.string().optional(),
    session: z.string().optional(),
    argv: z.array(z.string()).optional(),
    shell: z.string().optional(),
    line: z.string().optional(),
    background: z.boolean(),
    state: z.enum(['running', 'finished']),
    startedAt: isoTime,
    finishedAt: isoTime.optional(),
    result: CommandResultSchema.optional(),
  })
  .openapi('CommandInfo');

export const SessionResultSchema = CommandResultSchema.extend({
  session: z.string(),
  shellRestarted: z.boolean(),
  sessionEnded: z.boolean(),
}).openapi('SessionResult');

export const SessionInfoSchema = z
  .object({
    name: z.string(),
    shell: z.string(),
    user: z.string(),
    pid: z.number().int().optional(),
    alive: z.boolean(),
    busy: z.boolean(),
    calls: z.number().int(),
    createdAt: isoTime,
  })
  .openapi('SessionInfo');

export const FileInfoSchema = z
  .object({
    name: z.string(),
    path: z.string(),
    type: z.enum(['file', 'directory', 'symlink', 'fifo', 'socket', 'char', 'block', 'unknown']),
    size: z.number().int(),
    mode: z.number().int(),
    mtime: isoTime,
    uid: z.number().int(),
    gid: z.number().int(),
    target: z.string().optional(),
  })
  .openapi('FileInfo');

export const ImageBuildSchema = z
  .object({
    id: z.string().openapi({ example: 'bld-3n2k…' }),
    name: z.string().openapi({ description: 'The name as the request gave it.' }),
    image: z.string().openapi({
      description: 'The layer it makes, `name:version`, in the caller’s project’s namespace.',
    }),
    status: z.enum(['building', 'ready', 'failed']),
    error: z.string().optional().openapi({ description: 'A failure’s message.' }),
    errorCode: z.string().optional().openapi({ description: 'A failure’s error code.' }),
    errorDetails: z.record(z.unknown()).optional(),
    log: z.string().optional().openapi({
      description: 'The tail of the build’s output (64 KiB by default); absent in listings.',
    }),
    cached: z.boolean().optional(),
    digest: z.string().optional(),
    sizeBytes: z.number().int().optional(),
    createdAt: z.string().datetime(),
    finishedAt: z.string().datetime().optional(),
  })
  .openapi('ImageBuild');

export const LayerInfoSchema = z
  .object({
    name: z.string(),
    version: z.string(),
    kind: z.enum(['base', 'workspace', 'toolkit', 'snapshot']),
    digest: z.string(),
    blobDigest: z.string().optional(),
    blobChunksDigest: z.string().optional(),
    sizeBytes: z.number().int(),
    contentBytes: z.number().int(),
    fileCount: z.number().int(),
    createdAt: isoTime,
    source: z.string(),
    project: z.string().optional().openapi({
      description:
        'The project that owns the layer (its snapshots and forks); absent for the platform’s.',
    }),
    config: z
      .object({
        env: z.array(z.string()).optional(),
        cmd: z.array(z.string()).optional(),
        entrypoint: z.array(z.string()).optional(),
        workingDir: z.string().optional(),
        user: z.string().optional(),
      })
      .optional(),
    parents: z.array(z.string()).optional().openapi({
      description:
        'Layer keys, bottom first: `name:version` for the platform’s, `project/name:version` for a project’s.',
    }),
    parentDigests: z.array(z.string()).optional(),
    scrub: z.array(z.string()).optional(),
  })
  .openapi('LayerInfo');

export const SnapshotInfoSchema = z
  .object({
    image: z.string().openapi({ description: 'What `POST /v1/sandboxes` accepts as `image`.' }),
    layer: LayerInfoSchema,
    parents: z.array(z.string()),
    scrub: z.array(z.string()),
    freezeMs: z.number(),
    totalMs: z.number(),
  })
  .openapi('SnapshotInfo');

export const ForkResultSchema = z
  .object({ ids: z.array(z.string()), image: z.string() })
  .openapi('ForkResult');

export const JobResultSchema = z
  .object({
    sandboxes: z.array(z.object({ id: z.string(), state: SandboxStateSchema })),
    failed: z.array(z.object({ id: z.string(), code: ErrorCodeSchema, message: z.string() })),
  })
  .openapi('JobResult');

export const SandboxEventSchema = z
  .object({
    id: z.number().int(),
    sandboxId: z.string(),
    time: isoTime,
    kind: z.enum([
      'network_denied',
      'dns_blocked',
      'output_truncated',
      'oom_killed',
      'pids_limit',
      'command_timeout',
    ]),
    message: z.string(),
    count: z.number().int(),
    details: z.record(z.string(), z.unknown()),
  })
  .openapi('SandboxEvent');

export const FnCallPoolStatusSchema = z
  .object({
    language: z.string(),
    network: z.boolean(),
    idle: z.number().int().openapi({ description: 'Workers started and waiting for a call.' }),
    busy: z.number().int(),
    starting: z.number().int(),
    max: z.number().int(),
    gpu: z
      .object({
        mode: z.enum(['shared', 'exclusive']),
        count: z.number().int().optional(),
        model: z.string().optional(),
      })
      .optional()
      .openapi({ description: 'The GPU request every worker of this pool was given.' }),
  })
  .openapi('FnCallPoolStatus');

export const FnCallGpuUnitStatusSchema = z
  .object({
    kind: z.enum(['gpu', 'mig']),
    uuid: z.string(),
    model: z.string().openapi({ description: "A GPU's name, or a MIG instance's profile." }),
    mode: z.enum(['free', 'shared', 'exclusive']),
    workers: z.number().int(),
    maxSharedWorkers: z.number().int(),
  })
  .openapi('FnCallGpuUnitStatus');

export const FnCallResultSchema = z
  .object({
    exitCode: z.number().int().openapi({
      description:
        'The program’s exit code (128 + signal when a signal ended it, -1 when it never ran).',
    }),
    stdout: z.string(),
    stderr: z.string(),
    truncated: z.boolean(),
    outcome: z.enum([
      'ok',
      'timeout',
      'oom',
      'output_limit',
      'signaled',
      'pids_limit',
      'runtime_error',
    ]),
    durationMs: z.number(),
    reason: z.string().optional(),
    edgeId: z.string().optional(),
  })
  .openapi('FnCallResult', {
    description:
      'How one call ended. `outcome: ok` says only that the program ran to its own exit: read `exitCode`.',
  });

/** One NDJSON line of `POST /v1/fncall/batch`. */
export const FnCallBatchItemSchema = z
  .union([
    z.object({ index: z.number().int(), result: FnCallResultSchema }),
    z.object({
      index: z.number().int(),
      error: z.object({ code: ErrorCodeSchema, message: z.string() }),
    }),
  ])
  .openapi('FnCallBatchItem', {
    description:
      'One finished call of a batch, in completion order: `index` is its place in `calls`. ' +
      'Exactly one line per call; a failed call is a line with its error, not a failed batch.',
  });

const resourceTriple = z.object({
  memoryMb: z.number(),
  cpuCores: z.number(),
  sandboxes: z.number().int(),
});

export const EdgeStatusSchema = z
  .object({
    edgeId: z.string(),
    url: z.string(),
    healthy: z.boolean(),
    backends: z.array(z.enum(['container', 'microvm', 'vm', 'fncall'])),
    capacity: resourceTriple,
    used: resourceTriple,
    sandboxesByProject: z.record(z.string(), z.number().int()),
    labels: stringMap,
    layers: z.array(z.string()).optional(),
    pressure: z
      .object({
        measuredAt: isoTime,
        memoryTotalMb: z.number(),
        memoryAvailableMb: z.number(),
        sandboxMemoryMb: z.number(),
        cpuPressurePercent: z.number(),
        sandboxCpuPercent: z.number(),
        threads: z.number().int(),
        threadsLimit: z.number().int(),
        diskFreeMb: z.number(),
        refusing: z
          .object({
            resource: z.enum(['sandboxes', 'memory', 'cpu', 'pids', 'disk']),
            measure: z.string(),
            current: z.number(),
            limit: z.number(),
          })
          .optional(),
      })
      .optional(),
    fncall: z.array(FnCallPoolStatusSchema).optional().openapi({
      description: 'Warm FnCall pools on this edge (absent on edges without FnCall).',
    }),
    gpus: z.array(FnCallGpuUnitStatusSchema).optional().openapi({
      description: "The edge's GPU units and their assignment (absent on edges without GPUs).",
    }),
    cordoned: z.boolean().optional().openapi({
      description:
        'Set by `dsec edge cordon`: placement sends this edge nothing new (absent when not).',
    }),
  })
  .openapi('EdgeStatus');

const quota = z.object({
  sandboxes: z.number().int().optional(),
  memoryMb: z.number().int().optional(),
  cpuCores: z.number().optional(),
  fncallsPerSecond: z.number().int().optional(),
  imageBytes: z.number().int().optional(),
  volumeBytes: z.number().int().optional(),
});

export const ProjectSchema = z
  .object({
    id: z.string(),
    name: z.string(),
    parentId: z.string().nullable().openapi({ description: '`null` for the root project.' }),
    quota,
    createdAt: isoTime,
  })
  .openapi('Project');

const role = z.enum(['admin', 'member']);

export const CreatedKeySchema = z
  .object({
    id: z.string(),
    key: z.string().openapi({ description: 'The secret; shown only in this answer.' }),
    projectId: z.string(),
    role,
    scopes: z.array(z.string()).optional(),
  })
  .openapi('CreatedKey');

export const WhoamiSchema = z
  .object({
    keyId: z.string(),
    projectId: z.string(),
    role,
    scopes: z.array(z.string()).optional().openapi({ description: 'Absent for an unscoped key.' }),
  })
  .openapi('Whoami');

export const HealthSchema = z.object({ ok: z.boolean(), version: z.string() }).openapi('Health');

export const StdinAnswerSchema = z
  .object({ bytes: z.number().int().openapi({ description: 'Bytes written to stdin.' }) })
  .openapi('StdinAnswer');

/** One line of an `application/x-ndjson` command stream. */
export const CommandEventSchema = z
  .discriminatedUnion('type', [
    z.object({
      type: z.literal('stdout'),
      data: z.string().openapi({ format: 'byte', description: 'Output bytes, base64.' }),
    }),
    z.object({
      type: z.literal('stderr'),
      data: z.string().openapi({ format: 'byte', description: 'Output bytes, base64.' }),
    }),
    z.object({ type: z.literal('result'), result: CommandResultSchema }),
    z.object({
      type: z.literal('error'),
      error: z.object({ code: ErrorCodeSchema, message: z.string() }),
    }),
  ])
  .openapi('CommandEvent', {
    description:
      'One NDJSON line of a streamed command: output events in order, then exactly one `result` or `error`. ' +
      'Unknown event types may be added; clients skip them.',
  });

export const SessionEventSchema = z
  .discriminatedUnion('type', [
    z.object({ type: z.literal('stdout'), data: z.string().openapi({ format: 'byte' }) }),
    z.object({ type: z.literal('stderr'), data: z.string().openapi({ format: 'byte' }) }),
    z.object({ type: z.literal('result'), result: SessionResultSchema }),
    z.object({
      type: z.literal('error'),
      error: z.object({ code: ErrorCodeSchema, message: z.string() }),
    }),
  ])
  .openapi('SessionEvent', { description: 'As `CommandEvent`, with a `SessionResult`.' });

// Each schema describes exactly the type the server sends (both directions assignable).
type Same<A, B> = [A] extends [B] ? ([B] extends [A] ? true : false) : false;
type Check<T extends true> = T;
export type ResponseSchemasMatchTypes = [
  Check<Same<z.infer<typeof SandboxInfoSchema>, SandboxInfo>>,
  Check<Same<z.infer<typeof CommandResultSchema>, CommandResult>>,
  Check<Same<z.infer<typeof CommandInfoSchema>, CommandInfo>>,
  Check<Same<z.infer<typeof SessionResultSchema>, SessionResult>>,
  Check<Same<z.infer<typeof SessionInfoSchema>, SessionInfo>>,
  Check<Same<z.infer<typeof FileInfoSchema>, FileInfo>>,
  Check<Same<z.infer<typeof LayerInfoSchema>, LayerInfo>>,
  Check<Same<z.infer<typeof SnapshotInfoSchema>, SnapshotInfo>>,
  Check<Same<z.infer<typeof ForkResultSchema>, ForkResult>>,
  Check<Same<z.infer<typeof JobResultSchema>, JobResult>>,
  Check<Same<z.infer<typeof SandboxEventSchema>, SandboxEvent>>,
  Check<Same<z.infer<typeof EdgeStatusSchema>, EdgeStatus>>,
  Check<Same<z.infer<typeof FnCallResultSchema>, FnCallResult>>,
  Check<Same<z.infer<typeof FnCallPoolStatusSchema>, FnCallPoolStatus>>,
  Check<Same<z.infer<typeof FnCallGpuUnitStatusSchema>, FnCallGpuUnitStatus>>,
  Check<Same<z.infer<typeof ProjectSchema>, Project>>,
  Check<Same<z.infer<typeof CreatedKeySchema>, CreatedKey>>,
];

/** SandboxFusion's `CommandRunResult` (docs/fncall.md "SandboxFusion-compatible endpoint"). */
const SandboxFusionCommandResult = z
  .object({
    status: z.enum(['Finished', 'Error', 'TimeLimitExceeded']),
    execution_time: z.number().nullable(),
    return_code: z.number().int().nullable(),
    stdout: z.string().nullable(),
    stderr: z.string().nullable(),
  })
  .openapi('SandboxFusionCommandResult');

/** SandboxFusion's `RunCodeResponse`. */
export const SandboxFusionRunCodeResponseSchema = z
  .object({
    status: z.enum(['Success', 'Failed', 'SandboxError']),
    message: z.string(),
    compile_result: SandboxFusionCommandResult.nullable(),
    run_result: SandboxFusionCommandResult.nullable(),
    executor_pod_name: z.string().nullable(),
    files: z
      .record(z.string(), z.string())
      .openapi({ description: 'Fetched files, base64, by path.' }),
  })
  .openapi('SandboxFusionRunCodeResponse', {
    description:
      "SandboxFusion's answer: `Success` (every step finished with code 0), `Failed` (a non-zero code or a time limit), `SandboxError` (the sandbox failed the call).",
  });

export const SandboxFusionLanguagesSchema = z
  .array(
    z.object({
      language: z.string(),
      runtime: z.string(),
      compiled: z.boolean(),
      maxMemoryMb: z.number().int(),
      debian: z.string(),
    }),
  )
  .openapi('SandboxFusionLanguages');
