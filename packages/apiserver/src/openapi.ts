import { z } from 'zod';
import type { FastifyInstance } from 'fastify';
import {
  OpenApiGeneratorV31,
  OpenAPIRegistry,
  type ResponseConfig,
  type RouteConfig,
} from '@asteasolutions/zod-to-openapi';
import { ERROR_CODES } from '@dsec/core';
import {
  CommandEventSchema,
  CommandInfoSchema,
  CommandResultSchema,
  CreatedKeySchema,
  EdgeStatusSchema,
  ErrorBodySchema,
  FileInfoSchema,
  FnCallBatchItemSchema,
  FnCallResultSchema,
  ForkResultSchema,
  HealthSchema,
  ImageBuildSchema,
  JobResultSchema,
  LayerInfoSchema,
  ProjectSchema,
  SandboxEventSchema,
  SandboxFusionLanguagesSchema,
  SandboxFusionRunCodeResponseSchema,
  SandboxInfoSchema,
  SessionEventSchema,
  SessionInfoSchema,
  SessionResultSchema,
  SnapshotInfoSchema,
  StdinAnswerSchema,
  WhoamiSchema,
  VolumeInfoSchema,
} from './openapi-schemas.js';
import * as requests from './schemas.js';
import * as ioRequests from './schemas-io.js';
import * as fncallRequests from './schemas-fncall.js';
import * as displayRequests from './schemas-display.js';
import * as buildRequests from './schemas-builds.js';
import { RunCodeBody } from './sandboxfusion/service.js';
/**
 * The OpenAPI 3.1 document of HTTP API v1, built from the zod schemas the
 * routes parse requests with (`schemas.ts`, `schemas-io.ts`) and the answer
 * schemas of `openapi-schemas.ts`. It is the one description of the API:
 * served at `GET /openapi.json`, committed as docs/openapi.json (a test fails
 * when the two differ; `npm run openapi` rewrites it), and the TypeScript
 * SDK's wire types are generated from it. `openapi.test.ts` also checks that
 * every route the server has is described here and the other way round.
 */

export const OPENAPI_VERSION = '3.1.0';

/** Error answers by status, each a shared response naming the codes it may carry. */
const ERROR_RESPONSES = {
  400: 'BadRequest',
  401: 'Unauthenticated',
  403: 'PermissionDenied',
  404: 'NotFound',
  409: 'Conflict',
  413: 'PayloadTooLarge',
  429: 'TooManyRequests',
  500: 'Internal',
  503: 'Unavailable',
  504: 'DeadlineExceeded',
} as const;
type ErrorStatus = keyof typeof ERROR_RESPONSES;

/** Errors any authenticated call may answer with. */
const AUTHED: ErrorStatus[] = [400, 401, 500, 503];
/** Calls on one sandbox: it may be unknown (or another tenant's), stopped, or its edge down. */
const ON_SANDBOX: ErrorStatus[] = [...AUTHED, 404, 409, 504];

const json = (schema: z.ZodTypeAny) => ({ 'application/json': { schema } });
const ndjson = (schema: z.ZodTypeAny) => ({ 'application/x-ndjson': { schema } });
const bytes = { 'application/octet-stream': { schema: z.string().openapi({ format: 'binary' }) } };
const noContent: ResponseConfig = { description: 'Done; no body.' };

// Request schemas as the routes parse them; those with a name become shared components.
const CreateSandboxBody = requests.CreateSandboxBody.openapi('CreateSandboxBody');
const CommandBody = requests.CommandBody.openapi('CommandBody');
const SessionRunBody = ioRequests.SessionRunBody.openapi('SessionRunBody');
const ProjectBody = requests.ProjectBody.openapi('ProjectBody');
const KeyBody = requests.KeyBody.openapi('KeyBody');
const CreateVolumeBody = requests.CreateVolumeBody.openapi('CreateVolumeBody');
const { VolumeParams, VolumeQuery } = requests;
const JobBody = requests.JobBody.openapi('JobBody');
const NetworkPatchBody = requests.NetworkPatchBody.openapi('NetworkPatchBody');
const SnapshotBody = requests.SnapshotBody.openapi('SnapshotBody');
const TimeoutBody = requests.TimeoutBody.openapi('TimeoutBody');
const ForkBody = requests.ForkBody.openapi('ForkBody');
const SignalBody = ioRequests.SignalBody.openapi('SignalBody');
const MkdirBody = ioRequests.MkdirBody.openapi('MkdirBody');
const RemoveBody = ioRequests.RemoveBody.openapi('RemoveBody');
const RenameBody = ioRequests.RenameBody.openapi('RenameBody');
const DisplayInputBody = displayRequests.DisplayInputBody.openapi('DisplayInputBody');
const FnCallBody = fncallRequests.FnCallBody.openapi('FnCallBody');
const FnCallBatchBody = fncallRequests.FnCallBatchBody.openapi('FnCallBatchBody');
const SandboxFusionRunCodeBody = RunCodeBody.openapi('SandboxFusionRunCodeBody');
const {
  CommandParams,
  SessionParams,
  WaitQuery,
  StdinQuery,
  PathQuery,
  WriteQuery,
  PtyQuery,
  ListImagesQuery,
  ImageParams,
  ImageQuery,
} = ioRequests;
const { IdParams, EventsQuery, ListSandboxesQuery } = requests;

const PortParams = z.object({
  id: z.string().max(256),
  port: z
    .string()
    .regex(/^[0-9]{1,5}$/)
    .openapi({ description: 'TCP port, 1–65535.' }),
  path: z.string().max(8192).openapi({
    description: 'The rest of the path, slashes included, forwarded to the service.',
  }),
});
const PortRootParams = PortParams.omit({ path: true });

interface Operation {
  method: RouteConfig['method'];
  /** The path as fastify spells it (`:id`, `::action`, `*`). */
  route: string;
  operationId: string;
  tag: string;
  summary: string;
  description?: string;
  auth?: false;
  request?: RouteConfig['request'];
  responses: Record<number, ResponseConfig>;
  errors?: ErrorStatus[];
}

const PORT_METHODS = ['get', 'put', 'post', 'delete', 'patch', 'head', 'options'] as const;

/** Every route of the native API (the E2B-compatible routes of `@dsec/e2b` are not part of it). */
export function operations(): Operation[] {
  const sandbox = { params: IdParams };
  const ops: Operation[] = [
    {
      method: 'get',
      route: '/healthz',
      operationId: 'health',
      tag: 'meta',
      summary: 'Liveness and version',
      auth: false,
      responses: { 200: { description: 'Up.', content: json(HealthSchema) } },
      errors: [],
    },
    {
      method: 'get',
      route: '/metrics',
      operationId: 'metrics',
      tag: 'meta',
      summary: 'Prometheus metrics',
      description:
        'Needs an admin key of the root project, or a root-project key with the `metrics:read` ' +
        "scope (metrics show every tenant's load). Scrapers without a key use the admin listener " +
        '(`metricsListen`, docs/observability.md).',
      responses: {
        200: {
          description: 'Prometheus text exposition format.',
          content: { 'text/plain': { schema: z.string() } },
        },
      },
      errors: [401, 403],
    },
    {
      method: 'get',
      route: '/openapi.json',
      operationId: 'openapi',
      tag: 'meta',
      summary: 'This document',
      auth: false,
      responses: {
        200: {
          description: 'The OpenAPI 3.1 document of the API.',
          content: json(z.record(z.string(), z.unknown())),
        },
      },
      errors: [],
    },
    {
      method: 'get',
      route: '/ui',
      operationId: 'dashboardRoot',
      tag: 'meta',
      summary: 'The dashboard (redirects to `/ui/`)',
      auth: false,
      responses: { 301: { description: 'To `/ui/`.' } },
      errors: [],
    },
    {
      method: 'get',
      route: '/ui/*',
      operationId: 'dashboard',
      tag: 'meta',
      summary: "The dashboard's static files",
      description:
        'The web dashboard (packages/ui); it calls this API with the key the user signs in with ' +
        '(`/ui/#key=KEY`: the fragment never reaches the server). Holds no data, so needs no key.',
      auth: false,
      responses: {
        200: { description: 'A static file.', content: { 'text/html': { schema: z.string() } } },
      },
      errors: [404, 503],
    },
    {
      method: 'get',
      route: '/v1/whoami',
      operationId: 'whoami',
      tag: 'keys',
      summary: 'The calling key',
      responses: { 200: { description: 'The key.', content: json(WhoamiSchema) } },
    },
    {
      method: 'post',
      route: '/v1/sandboxes',
      operationId: 'createSandbox',
      tag: 'sandboxes',
      summary: 'Create a sandbox',
      description:
        'Returns once the sandbox runs. With `requestId` a retry returns the same sandbox (idempotent).',
      request: { body: { content: json(CreateSandboxBody), required: true } },
      responses: { 201: { description: 'Running.', content: json(SandboxInfoSchema) } },
      errors: [...AUTHED, 403, 404, 409, 429, 504],
    },
    {
      method: 'get',
      route: '/v1/sandboxes',
      operationId: 'listSandboxes',
      tag: 'sandboxes',
      summary: 'List sandboxes the key may see',
      description: '`label=k=v` repeats; a sandbox must carry every label given.',
      request: { query: ListSandboxesQuery as unknown as z.AnyZodObject },
      responses: {
        200: {
          description: 'The sandboxes.',
          content: json(z.object({ sandboxes: z.array(SandboxInfoSchema) })),
        },
      },
      // 404: a `projectId` the key cannot see.
      errors: [...AUTHED, 404],
    },
    {
      method: 'get',
      route: '/v1/sandboxes/:id',
      operationId: 'getSandbox',
      tag: 'sandboxes',
      summary: 'A sandbox',
      request: sandbox,
      responses: { 200: { description: 'The sandbox.', content: json(SandboxInfoSchema) } },
      errors: [...AUTHED, 404, 504],
    },
    {
      method: 'delete',
      route: '/v1/sandboxes/:id',
      operationId: 'deleteSandbox',
      tag: 'sandboxes',
      summary: 'Stop a sandbox and free its quota',
      description: 'Stopping a stopped sandbox is a no-op.',
      request: sandbox,
      responses: { 204: noContent },
      errors: [...AUTHED, 404, 504],
    },
    {
      method: 'post',
      route: '/v1/sandboxes/:id/commands',
      operationId: 'runCommand',
      tag: 'commands',
      summary: 'Run a command',
      description:
        'Waits for the command and answers its `CommandResult`. With `Accept: application/x-ndjson` ' +
        'the answer streams `CommandEvent` lines. With `Accept: application/octet-stream` the body is ' +
        'the raw stdout bytes, and the `CommandResult` (stdout and stderr text empty) arrives base64-JSON ' +
        'in the `x-dsec-result` trailer, or an `{ code, message }` error in `x-dsec-error`. With ' +
        '`background: true` it answers 202 `CommandInfo` at once. With `requestId` the command runs at ' +
        'most once per sandbox: a retry gets its output and result.',
      request: { ...sandbox, body: { content: json(CommandBody), required: true } },
      responses: {
        200: {
          description: 'The result, or its stream.',
          content: {
            ...json(CommandResultSchema),
            ...ndjson(CommandEventSchema),
            ...bytes,
          },
          headers: z.object({
            trailer: z.string().optional().openapi({
              description: 'Raw stdout only: `x-dsec-result, x-dsec-error`.',
            }),
          }),
        },
        202: { description: 'Started in the background.', content: json(CommandInfoSchema) },
      },
      errors: ON_SANDBOX,
    },
    {
      method: 'get',
      route: '/v1/sandboxes/:id/commands',
      operationId: 'listCommands',
      tag: 'commands',
      summary: 'The command log',
      description:
        'Running commands, then finished ones still retained (1 h, 256 per sandbox), newest first.',
      request: sandbox,
      responses: {
        200: {
          description: 'The commands.',
          content: json(z.object({ commands: z.array(CommandInfoSchema) })),
        },
      },
      errors: ON_SANDBOX,
    },
    {
      method: 'get',
      route: '/v1/sandboxes/:id/commands/:cid',
      operationId: 'getCommand',
      tag: 'commands',
      summary: 'A command by ID',
      request: { params: CommandParams },
      responses: { 200: { description: 'The command.', content: json(CommandInfoSchema) } },
      errors: ON_SANDBOX,
    },
    {
      method: 'get',
      route: '/v1/sandboxes/:id/commands/:cid/wait',
      operationId: 'waitCommand',
      tag: 'commands',
      summary: 'Wait for a command',
      description: '`deadline_exceeded` when it still runs after `timeoutMs` (it keeps running).',
      request: { params: CommandParams, query: WaitQuery },
      responses: { 200: { description: 'Its result.', content: json(CommandResultSchema) } },
      errors: ON_SANDBOX,
    },
    {
      method: 'get',
      route: '/v1/sandboxes/:id/commands/:cid/output',
      operationId: 'commandOutput',
      tag: 'commands',
      summary: "A command's output stream",
      description:
        'The output kept so far (head and tail within the cap), then live output, then `result`.',
      request: { params: CommandParams },
      responses: { 200: { description: 'The event stream.', content: ndjson(CommandEventSchema) } },
      errors: ON_SANDBOX,
    },
    {
      method: 'post',
      route: '/v1/sandboxes/:id/commands/:cid/kill',
      operationId: 'killCommand',
      tag: 'commands',
      summary: "Kill a command's process tree",
      request: { params: CommandParams },
      responses: { 204: noContent },
      errors: ON_SANDBOX,
    },
    {
      method: 'post',
      route: '/v1/sandboxes/:id/commands/:cid/signal',
      operationId: 'signalCommand',
      tag: 'commands',
      summary: "Signal a command's process group",
      request: { params: CommandParams, body: { content: json(SignalBody), required: true } },
      responses: { 204: noContent },
      errors: ON_SANDBOX,
    },
    {
      method: 'post',
      route: '/v1/sandboxes/:id/commands/:cid/stdin',
      operationId: 'writeStdin',
      tag: 'commands',
      summary: "Stream bytes to a command's stdin",
      description: '409 `conflict` unless the command started with `stdinOpen`.',
      request: { params: CommandParams, query: StdinQuery, body: { content: bytes } },
      responses: { 200: { description: 'Written.', content: json(StdinAnswerSchema) } },
      errors: ON_SANDBOX,
    },
    {
      method: 'post',
      route: '/v1/sandboxes/:id/sessions/:name/run',
      operationId: 'runInSession',
      tag: 'sessions',
      summary: 'Run a line in a shell session',
      description:
        'The session is created on first use (`shell`, `user`, `env`, `cwd` apply then). NDJSON with ' +
        '`Accept: application/x-ndjson`.',
      request: { params: SessionParams, body: { content: json(SessionRunBody), required: true } },
      responses: {
        200: {
          description: 'The result, or its stream.',
          content: { ...json(SessionResultSchema), ...ndjson(SessionEventSchema) },
        },
      },
      errors: ON_SANDBOX,
    },
    {
      method: 'get',
      route: '/v1/sandboxes/:id/sessions',
      operationId: 'listSessions',
      tag: 'sessions',
      summary: 'Shell sessions',
      request: sandbox,
      responses: {
        200: {
          description: 'The sessions.',
          content: json(z.object({ sessions: z.array(SessionInfoSchema) })),
        },
      },
      errors: ON_SANDBOX,
    },
    {
      method: 'delete',
      route: '/v1/sandboxes/:id/sessions/:name',
      operationId: 'closeSession',
      tag: 'sessions',
      summary: "Kill a session's shell and what it started",
      request: { params: SessionParams },
      responses: { 204: noContent },
      errors: ON_SANDBOX,
    },
    {
      method: 'get',
      route: '/v1/sandboxes/:id/files',
      operationId: 'readFile',
      tag: 'files',
      summary: "A file's bytes, streamed",
      request: { ...sandbox, query: PathQuery },
      responses: { 200: { description: 'The contents.', content: bytes } },
      errors: [...ON_SANDBOX, 403],
    },
    {
      method: 'put',
      route: '/v1/sandboxes/:id/files',
      operationId: 'writeFile',
      tag: 'files',
      summary: 'Replace a file atomically',
      description:
        'The raw body streams to a temp file in the same directory, then replaces the path.',
      request: { ...sandbox, query: WriteQuery, body: { content: bytes } },
      responses: { 200: { description: 'Written.', content: json(FileInfoSchema) } },
      errors: [...ON_SANDBOX, 403],
    },
    {
      method: 'get',
      route: '/v1/sandboxes/:id/files/stat',
      operationId: 'statFile',
      tag: 'files',
      summary: "A path's metadata (does not follow a final symlink)",
      request: { ...sandbox, query: PathQuery },
      responses: { 200: { description: 'The metadata.', content: json(FileInfoSchema) } },
      errors: [...ON_SANDBOX, 403],
    },
    {
      method: 'get',
      route: '/v1/sandboxes/:id/files/list',
      operationId: 'listDir',
      tag: 'files',
      summary: "A directory's entries, sorted by name",
      request: { ...sandbox, query: PathQuery },
      responses: {
        200: {
          description: 'The entries.',
          content: json(z.object({ entries: z.array(FileInfoSchema) })),
        },
      },
      errors: [...ON_SANDBOX, 403],
    },
    {
      method: 'post',
      route: '/v1/sandboxes/:id/files/mkdir',
      operationId: 'mkdir',
      tag: 'files',
      summary: 'Make a directory',
      request: { ...sandbox, body: { content: json(MkdirBody), required: true } },
      responses: { 204: noContent },
      errors: [...ON_SANDBOX, 403],
    },
    {
      method: 'post',
      route: '/v1/sandboxes/:id/files/remove',
      operationId: 'removePath',
      tag: 'files',
      summary: 'Remove a path (a tree with `recursive`)',
      request: { ...sandbox, body: { content: json(RemoveBody), required: true } },
      responses: { 204: noContent },
      errors: [...ON_SANDBOX, 403],
    },
    {
      method: 'post',
      route: '/v1/sandboxes/:id/files/rename',
      operationId: 'renamePath',
      tag: 'files',
      summary: 'Rename (move) a path',
      request: { ...sandbox, body: { content: json(RenameBody), required: true } },
      responses: { 204: noContent },
      errors: [...ON_SANDBOX, 403],
    },
    {
      method: 'get',
      route: '/v1/sandboxes/:id/pty',
      operationId: 'openPty',
      tag: 'ports',
      summary: 'An interactive terminal (HTTP upgrade)',
      description:
        'Send `Connection: Upgrade` and `Upgrade: dsec-pty`. After `101 Switching Protocols` both ' +
        'directions carry frames `u8 type | u32be length | payload`: the client sends DATA 0 ' +
        '(keystrokes), RESIZE 1 (u16be rows, u16be cols) and EOF 2; the server sends DATA 0 (output) and ' +
        'finally EXIT 3 (i32be exit code). Errors before the upgrade are plain `Error` answers. ' +
        'Browsers send `Upgrade: websocket` instead, without a key: the first message is ' +
        '`{"type":"auth","key":"..."}`; then binary messages carry terminal bytes both ways, and text ' +
        'messages JSON control: `{"type":"resize","rows","cols"}` and `{"type":"eof"}` from the client, ' +
        '`{"type":"ready"}`, `{"type":"exit","exitCode"}` or `{"type":"error","error":{...}}` from the server.',
      request: { ...sandbox, query: PtyQuery },
      responses: { 101: { description: 'Switching protocols to `dsec-pty` frames.' } },
      errors: ON_SANDBOX,
    },
    {
      method: 'post',
      route: '/v1/sandboxes/:id/pause',
      operationId: 'pauseSandbox',
      tag: 'lifecycle',
      summary: 'Pause (memory back to the host, state kept)',
      description:
        'A no-op when paused; the next command, session, file or port call resumes it. ' +
        '409 `sandbox_not_running` when stopped.',
      request: sandbox,
      responses: { 200: { description: 'Paused.', content: json(SandboxInfoSchema) } },
      errors: ON_SANDBOX,
    },
    {
      method: 'post',
      route: '/v1/sandboxes/:id/resume',
      operationId: 'resumeSandbox',
      tag: 'lifecycle',
      summary: 'Resume a paused sandbox',
      request: sandbox,
      responses: { 200: { description: 'Running.', content: json(SandboxInfoSchema) } },
      errors: ON_SANDBOX,
    },
    {
      method: 'post',
      route: '/v1/sandboxes/:id/timeout',
      operationId: 'setSandboxTimeout',
      tag: 'lifecycle',
      summary: 'Stop the sandbox `seconds` from now',
      request: { ...sandbox, body: { content: json(TimeoutBody), required: true } },
      responses: { 200: { description: 'The new deadline.', content: json(SandboxInfoSchema) } },
      errors: [...ON_SANDBOX, 429],
    },
    {
      method: 'post',
      route: '/v1/sandboxes/:id/snapshot',
      operationId: 'snapshotSandbox',
      tag: 'lifecycle',
      summary: "Capture the sandbox's filesystem as an image",
      description:
        '409 `conflict` when the name is taken; a scoped key needs `sandboxes:snapshot`.',
      request: { ...sandbox, body: { content: json(SnapshotBody), required: true } },
      responses: { 201: { description: 'The image.', content: json(SnapshotInfoSchema) } },
      errors: [...ON_SANDBOX, 403],
    },
    {
      method: 'post',
      route: '/v1/sandboxes/:id/fork',
      operationId: 'forkSandbox',
      tag: 'lifecycle',
      summary: 'Start `count` sandboxes from this one',
      description: 'All or nothing: when one create fails the others are stopped first.',
      request: { ...sandbox, body: { content: json(ForkBody), required: true } },
      responses: { 201: { description: 'The new sandboxes.', content: json(ForkResultSchema) } },
      errors: [...ON_SANDBOX, 403, 429],
    },
    {
      method: 'patch',
      route: '/v1/sandboxes/:id/network',
      operationId: 'updateNetwork',
      tag: 'network',
      summary: 'Change the egress policy live',
      description: 'Rules merge by name; `allow` and `deny` replace the lists when given.',
      request: { ...sandbox, body: { content: json(NetworkPatchBody), required: true } },
      responses: { 200: { description: 'The new policy.', content: json(SandboxInfoSchema) } },
      errors: ON_SANDBOX,
    },
    {
      method: 'get',
      route: '/v1/sandboxes/:id/events',
      operationId: 'listEvents',
      tag: 'network',
      summary: 'Audit events, oldest first',
      request: { ...sandbox, query: EventsQuery },
      responses: {
        200: {
          description: 'The events.',
          content: json(z.object({ events: z.array(SandboxEventSchema) })),
        },
      },
      errors: ON_SANDBOX,
    },
    {
      method: 'get',
      route: '/v1/sandboxes/:id/screenshot',
      operationId: 'screenshot',
      tag: 'display',
      summary: 'A PNG of the screen now',
      description:
        '503 `unavailable` for a sandbox without a display (only `vm` sandboxes have one).',
      request: sandbox,
      responses: {
        200: {
          description: 'The screen.',
          content: { 'image/png': { schema: z.string().openapi({ format: 'binary' }) } },
        },
      },
      errors: ON_SANDBOX,
    },
    {
      method: 'post',
      route: '/v1/sandboxes/:id/input',
      operationId: 'sendInput',
      tag: 'display',
      summary: 'Send keys and pointer events to the screen',
      description:
        'Events in order, or `text` typed key by key. 503 `unavailable` for a sandbox without a display.',
      request: { ...sandbox, body: { content: json(DisplayInputBody), required: true } },
      responses: { 204: noContent },
      errors: ON_SANDBOX,
    },
    {
      method: 'post',
      route: '/v1/volumes',
      operationId: 'createVolume',
      tag: 'volumes',
      summary: 'Create a named volume of the project',
      description:
        'An ext4 store of `sizeMb` on one edge (docs/volumes.md), counted against the `volumeBytes` quota of the project and its ancestors (429 `quota_exceeded`). Names are per project; 409 `conflict` when the project has one of that name. Sandboxes mount it with `volumes` on create and are placed on its edge.',
      request: { body: { content: json(CreateVolumeBody), required: true } },
      responses: { 201: { description: 'The volume.', content: json(VolumeInfoSchema) } },
      errors: [...AUTHED, 404, 409, 429],
    },
    {
      method: 'get',
      route: '/v1/volumes',
      operationId: 'listVolumes',
      tag: 'volumes',
      summary: 'The project’s volumes',
      description: 'Of the key’s project, or of `?projectId=` (the key’s own or a descendant).',
      request: { query: VolumeQuery },
      responses: {
        200: {
          description: 'The volumes, by name.',
          content: json(z.object({ volumes: z.array(VolumeInfoSchema) })),
        },
      },
      errors: [...AUTHED, 404],
    },
    {
      method: 'get',
      route: '/v1/volumes/:name',
      operationId: 'getVolume',
      tag: 'volumes',
      summary: 'One volume, with its use now',
      description: '404 `volume_not_found` when the project has no volume of that name.',
      request: { params: VolumeParams, query: VolumeQuery },
      responses: { 200: { description: 'The volume.', content: json(VolumeInfoSchema) } },
      errors: [...AUTHED, 404],
    },
    {
      method: 'delete',
      route: '/v1/volumes/:name',
      operationId: 'deleteVolume',
      tag: 'volumes',
      summary: 'Delete a volume and its bytes',
      description:
        '409 `volume_in_use` (`details.sandboxes`) while a sandbox mounts it; its bytes leave the quota once it is gone.',
      request: { params: VolumeParams, query: VolumeQuery },
      responses: { 204: noContent },
      errors: [...AUTHED, 404, 409],
    },
    {
      method: 'get',
      route: '/v1/images',
      operationId: 'listImages',
      tag: 'images',
      summary: 'Image layers the key’s project sees',
      description:
        'The platform’s bases, workspaces and toolkits, and the snapshots and forks of the project and its ancestors (`project` names the owner; absent: the platform’s). Where several of these hold one `name:version`, they are listed in the order a create resolves the name: the platform’s first, then the root-most project’s. `?projectId=` lists what that project (the key’s own or a descendant) sees; `?all=true` adds the per-OCI-layer records (`oci-diff:*`) registry imports keep to reuse conversions. 404 `not_found` for a project the key cannot reach.',
      request: { query: ListImagesQuery },
      responses: {
        200: {
          description: 'The layers.',
          content: json(z.object({ layers: z.array(LayerInfoSchema) })),
        },
      },
      errors: [...AUTHED, 404],
    },
    {
      method: 'delete',
      route: '/v1/images/:ref',
      operationId: 'deleteImage',
      tag: 'images',
      summary: 'Delete a layer the project owns',
      description:
        'Removes a snapshot or fork of the key’s project (or of `?projectId=`, a descendant) and gives its bytes back to the project’s `imageBytes` quota. Never the platform’s layers or an ancestor’s: 404 `image_not_found` for any layer the project does not own itself. 409 `conflict` while another layer was snapshotted on top of it (`details.layers`). A scoped key needs `sandboxes:snapshot`.',
      request: { params: ImageParams, query: ImageQuery },
      responses: { 204: noContent },
      errors: [...AUTHED, 403, 404, 409],
    },
    {
      method: 'post',
      route: '/v1/images/builds',
      operationId: 'startImageBuild',
      tag: 'images',
      summary: 'Build a Dockerfile into a layer of the project',
      description:
        'The body is the build context, a tar archive (`Content-Type: application/x-tar`; ustar, pax or GNU; 1 GiB at most: 413 `payload_too_large`). It is unpacked on the node that holds the image store under fixed rules (no absolute path, no `..`, nothing under a symlink of the archive, hard links only to a regular file earlier in the archive, no device node or FIFO; 100 000 entries; 400 `invalid_argument` with `field: context` and `details.reason` `tar_path`, `tar_link`, `tar_entry_kind`, `tar_duplicate`, `tar_malformed`, `context_too_large`), then built by buildah with `RUN` steps under the node’s egress policy (`dsec image build --dockerfile`, docs/images.md). 202 once the context is unpacked; poll `GET /v1/images/builds/{id}`. The layer is the caller’s project’s (`kind: base`), charged to its `imageBytes` quota, invisible to other projects; a name is immutable (a different build under a stored `name:version` fails `conflict`: use a new version). 409 `conflict` for a name the platform or an ancestor holds (`name_taken`) or one being built (`build_running`); 429 `quota_exceeded` past 2 builds of the project at once (`details.resource: builds`) or with no `imageBytes` room; 503 `capacity_exhausted` past the node’s builds at once; 503 `unavailable` (`builds_unavailable`) on an apiserver without a builder (a multi-node cluster’s). A scoped key needs `sandboxes:snapshot` and may not build a name its own run patterns match.',
      request: {
        query: buildRequests.BuildQuery,
        body: {
          content: {
            'application/x-tar': { schema: z.string().openapi({ format: 'binary' }) },
          },
          required: true,
        },
      },
      responses: { 202: { description: 'Building.', content: json(ImageBuildSchema) } },
      errors: [...AUTHED, 403, 409, 413, 429, 504],
    },
    {
      method: 'get',
      route: '/v1/images/builds',
      operationId: 'listImageBuilds',
      tag: 'images',
      summary: 'The project’s builds, newest first',
      description:
        'Running builds and the last 50 finished ones of the key’s project, as this apiserver remembers them (a restart forgets them; the layers stay). No `log`.',
      responses: {
        200: {
          description: 'The builds.',
          content: json(z.object({ builds: z.array(ImageBuildSchema) })),
        },
      },
      errors: AUTHED,
    },
    {
      method: 'get',
      route: '/v1/images/builds/:id',
      operationId: 'getImageBuild',
      tag: 'images',
      summary: 'One build: its status and the tail of its log',
      description:
        '`status` is `building`, `ready` or `failed` (`error`, `errorCode`, `errorDetails`: a failed step names its `instruction`, `line` and `outputTail`). 404 `not_found` for an unknown build or another project’s.',
      request: { params: buildRequests.BuildParams },
      responses: { 200: { description: 'The build.', content: json(ImageBuildSchema) } },
      errors: [...AUTHED, 404],
    },
    {
      method: 'delete',
      route: '/v1/images/builds/:id',
      operationId: 'cancelImageBuild',
      tag: 'images',
      summary: 'Stop a running build',
      description:
        'Stops it (it ends `failed`, `errorCode: aborted`, nothing stored) and answers the build as it ended; a finished build is answered as it is.',
      request: { params: buildRequests.BuildParams },
      responses: { 200: { description: 'The build.', content: json(ImageBuildSchema) } },
      errors: [...AUTHED, 404],
    },
    {
      method: 'get',
      route: '/v1/edges',
      operationId: 'listEdges',
      tag: 'edges',
      summary: 'The fleet (admin key of the root project)',
      responses: {
        200: {
          description: 'The edges.',
          content: json(z.object({ edges: z.array(EdgeStatusSchema) })),
        },
      },
      errors: [...AUTHED, 403],
    },
    {
      method: 'post',
      route: '/v1/projects',
      operationId: 'createProject',
      tag: 'projects',
      summary: 'Create a project under the key’s own',
      request: { body: { content: json(ProjectBody), required: true } },
      responses: { 201: { description: 'Created.', content: json(ProjectSchema) } },
      errors: [...AUTHED, 403, 404, 409],
    },
    {
      method: 'get',
      route: '/v1/projects',
      operationId: 'listProjects',
      tag: 'projects',
      summary: 'The key’s project and its descendants',
      responses: {
        200: {
          description: 'The projects.',
          content: json(z.object({ projects: z.array(ProjectSchema) })),
        },
      },
    },
    {
      method: 'post',
      route: '/v1/keys',
      operationId: 'createKey',
      tag: 'keys',
      summary: 'Create an API key',
      request: { body: { content: json(KeyBody), required: true } },
      responses: { 201: { description: 'Created.', content: json(CreatedKeySchema) } },
      errors: [...AUTHED, 403, 404],
    },
    {
      method: 'delete',
      route: '/v1/keys/:id',
      operationId: 'deleteKey',
      tag: 'keys',
      summary: 'Revoke an API key',
      request: { params: IdParams },
      responses: { 204: noContent },
      errors: [...AUTHED, 403, 404],
    },
  ];
  ops.push(
    {
      method: 'post',
      route: '/v1/fncall',
      operationId: 'fncall',
      tag: 'fncall',
      summary: 'Run one stateless function call in a warm pool',
      description:
        'Runs `code` with the runtime `language` (`python`, `node`, `bash`, …) on an edge with warm ' +
        'capacity for it, and answers how it ended. Nothing the call leaves behind is seen by another. ' +
        'A program that fails is a 200 with its `exitCode` and `outcome`; errors are for the platform ' +
        '(`unavailable` when no edge runs FnCall, `quota_exceeded` past the calls-per-second quota). ' +
        'Calls are stateless: resend them freely (docs/fncall.md).',
      request: { body: { content: json(FnCallBody), required: true } },
      responses: { 200: { description: 'How the call ended.', content: json(FnCallResultSchema) } },
      errors: [...AUTHED, 429, 504],
    },
    {
      method: 'post',
      route: '/v1/fncall/batch',
      operationId: 'fncallBatch',
      tag: 'fncall',
      summary: 'Run many function calls, results streamed as they finish',
      description:
        'Runs `calls` with at most `concurrency` in flight and streams one NDJSON `FnCallBatchItem` ' +
        'line per call, in completion order. The whole batch is checked (400 names the first bad field, ' +
        '`calls.3.language`) and admitted before the stream starts; afterwards each call succeeds or ' +
        'fails on its own line. A client that disconnects aborts the calls still running.',
      request: { body: { content: json(FnCallBatchBody), required: true } },
      responses: {
        200: { description: 'One line per call.', content: ndjson(FnCallBatchItemSchema) },
      },
      errors: [...AUTHED, 413, 429],
    },
    {
      method: 'post',
      route: '/sandboxfusion/run_code',
      operationId: 'sandboxFusionRunCode',
      tag: 'fncall',
      summary: "SandboxFusion's /run_code on FnCall",
      description:
        'SandboxFusion\'s request and answer (docs/fncall.md "SandboxFusion-compatible endpoint"): ' +
        'compiles and runs `code` in `language` with `compile_timeout`, `run_timeout`, ' +
        '`memory_limit_MB`, `stdin`, `files` (base64 by relative path) and `fetch_files`. Unknown ' +
        'fields are ignored, as SandboxFusion does. A language not served, a path with `..`, a ' +
        'limit out of range is 400 `invalid_argument`; a program that fails is a 200.',
      request: { body: { content: json(SandboxFusionRunCodeBody), required: true } },
      responses: {
        200: { description: 'How it ran.', content: json(SandboxFusionRunCodeResponseSchema) },
      },
      errors: [...AUTHED, 403, 413, 429],
    },
    {
      method: 'get',
      route: '/sandboxfusion/v1/ping',
      operationId: 'sandboxFusionPing',
      tag: 'fncall',
      summary: 'SandboxFusion\'s liveness route: `"pong"`',
      auth: false,
      responses: { 200: { description: 'Up.', content: json(z.string()) } },
      errors: [],
    },
    {
      method: 'get',
      route: '/sandboxfusion/languages',
      operationId: 'sandboxFusionLanguages',
      tag: 'fncall',
      summary: 'The SandboxFusion languages served, their runtimes and Debian packages',
      auth: false,
      responses: { 200: { description: 'The list.', content: json(SandboxFusionLanguagesSchema) } },
      errors: [],
    },
  );
  for (const action of ['pause', 'resume', 'stop', 'extend'] as const) {
    ops.push({
      method: 'post',
      route: `/v1/sandboxes::${action}`,
      operationId: `${action}Job`,
      tag: 'lifecycle',
      summary: `${action[0]?.toUpperCase()}${action.slice(1)} every sandbox carrying all of \`labels\``,
      description:
        'Each selected sandbox succeeds or fails on its own; the answer lists both. ' +
        (action === 'extend' ? '`seconds` is required here.' : '`seconds` is for `:extend` only.'),
      request: { body: { content: json(JobBody), required: true } },
      responses: { 200: { description: 'Per sandbox.', content: json(JobResultSchema) } },
      // 404: a `projectId` the key cannot see.
      errors: [...AUTHED, 404],
    });
  }
  for (const [route, params] of [
    ['/v1/sandboxes/:id/ports/:port', PortRootParams],
    ['/v1/sandboxes/:id/ports/:port/*', PortParams],
  ] as const) {
    for (const method of PORT_METHODS) {
      ops.push({
        method,
        route,
        operationId: `port${method[0]?.toUpperCase()}${method.slice(1)}${route.endsWith('*') ? 'Path' : ''}`,
        tag: 'ports',
        summary: 'An HTTP request to a service inside the sandbox',
        description:
          'One HTTP/1.1 request to `127.0.0.1:port` inside the sandbox, bodies streamed both ways. ' +
          'Hop-by-hop headers and every credential of the caller are not forwarded: `Authorization`, ' +
          '`X-API-Key`, `X-Access-Token`, `X-Dsec-*`, and any header, cookie or query parameter that ' +
          'carries a DSec key (400 `invalid_argument` for a path that does). Any status is the service’s own, ' +
          'except answers carrying `x-dsec-error: 1`, which are DSec `Error` answers.',
        request: {
          params,
          ...(method === 'get' || method === 'head' || method === 'options'
            ? {}
            : {
                body: { content: { '*/*': { schema: z.string().openapi({ format: 'binary' }) } } },
              }),
        },
        responses: {
          200: {
            description: 'The service’s answer (any status).',
            content: { '*/*': { schema: z.string().openapi({ format: 'binary' }) } },
          },
        },
        errors: ON_SANDBOX,
      });
    }
  }
  return ops;
}

/** `/v1/sandboxes/:id/ports/:port/*` → `/v1/sandboxes/{id}/ports/{port}/{path}`; `::` is a literal colon. */
export function openApiPath(route: string): string {
  return route
    .replace(/::/g, '\u0000')
    .replace(/:([A-Za-z0-9_]+)/g, '{$1}')
    .replace(/\*$/, '{path}')
    .replace(/\u0000/g, ':');
}

let cached: Record<string, unknown> | undefined;

/** The document (built once per process: the schemas do not change at run time). */
export function buildOpenApiDocument(version: string): Record<string, unknown> {
  if (cached && (cached.info as { version: string }).version === version) return cached;
  const registry = new OpenAPIRegistry();
  registry.registerComponent('securitySchemes', 'apiKey', {
    type: 'http',
    scheme: 'bearer',
    description: 'A DSec API key: `Authorization: Bearer <key>`.',
  });
  registry.register('Error', ErrorBodySchema);
  for (const [status, name] of Object.entries(ERROR_RESPONSES)) {
    const codes = Object.entries(ERROR_CODES)
      .filter(([, e]) => e.status === Number(status))
      .map(([code]) => `\`${code}\``);
    registry.registerComponent('responses', name, {
      description: `Error: ${codes.join(', ')}.`,
      content: { 'application/json': { schema: { $ref: '#/components/schemas/Error' } } },
    });
  }
  for (const op of operations()) {
    // Any JSON body may be past the 1 MiB limit.
    const jsonBody = op.request?.body?.content && 'application/json' in op.request.body.content;
    const errors = [...(op.errors ?? AUTHED), ...(jsonBody ? [413 as const] : [])];
    const responses: Record<number, ResponseConfig | { $ref: string }> = { ...op.responses };
    for (const status of errors) {
      responses[status] = { $ref: `#/components/responses/${ERROR_RESPONSES[status]}` };
    }
    registry.registerPath({
      method: op.method,
      path: openApiPath(op.route),
      operationId: op.operationId,
      tags: [op.tag],
      summary: op.summary,
      ...(op.description ? { description: op.description } : {}),
      ...(op.auth === false ? { security: [] } : {}),
      ...(op.request ? { request: op.request } : {}),
      responses,
    });
  }
  const doc = new OpenApiGeneratorV31(registry.definitions).generateDocument({
    openapi: OPENAPI_VERSION,
    info: {
      title: 'DSec HTTP API',
      version,
      description:
        'HTTP API v1 of DSec. Every answer carries `x-request-id`. Errors are ' +
        '`{ "error": { "code", "message", "field"?, "details"? } }` with the status of their code. ' +
        'Request bodies are JSON (1 MiB at most) unless a route says otherwise; unknown fields are ' +
        'rejected (400 `invalid_argument`, `field` names the first). Conventions: docs/CONVENTIONS.md.',
      license: { name: 'Apache-2.0', identifier: 'Apache-2.0' },
    },
    servers: [{ url: 'http://127.0.0.1:7420', description: '`dsec up` on this machine' }],
    security: [{ apiKey: [] }],
    tags: [
      'meta',
      'sandboxes',
      'commands',
      'sessions',
      'files',
      'ports',
      'lifecycle',
      'fncall',
      'network',
      'display',
      'images',
      'volumes',
      'edges',
      'projects',
      'keys',
    ].map((name) => ({ name })),
  });
  cached = JSON.parse(JSON.stringify(doc)) as Record<string, unknown>;
  return cached;
}

/** `GET /openapi.json`, without authentication (the document holds no secrets). */
export function openApiRoute(app: FastifyInstance, version: string): void {
  let body: string | undefined;
  app.get('/openapi.json', async (_req, reply) => {
    body ??= JSON.stringify(buildOpenApiDocument(version));
    return reply.header('content-type', 'application/json; charset=utf-8').send(body);
  });
}

/** Every route a server defines, as `METHOD path` (fastify spelling), recorded by `recordRoutes`. */
const routeTables = new WeakMap<FastifyInstance, Set<string>>();

/** Records the routes defined on `app` from now on; read them with `routesOf`. */
export function recordRoutes(app: FastifyInstance): void {
  const table = new Set<string>();
  routeTables.set(app, table);
  app.addHook('onRoute', (r) => {
    for (const m of Array.isArray(r.method) ? r.method : [r.method]) table.add(`${m} ${r.url}`);
  });
}

export function routesOf(app: FastifyInstance): string[] {
  return [...(routeTables.get(app) ?? [])].sort();
}
