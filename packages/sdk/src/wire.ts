import type { components, operations } from './gen/openapi.js';

/**
 * The wire types of HTTP API v1, taken from `gen/openapi.ts`, which is
 * generated from docs/openapi.json (itself generated from the apiserver's
 * schemas): requests and answers are typed by what the server declares, not
 * by a second hand-written copy. `npm run openapi` regenerates both files.
 */
type Schemas = components['schemas'];

/** The JSON body of an operation's answer with `status`. */
export type Answer<
  Op extends keyof operations,
  Status extends keyof operations[Op]['responses'],
> = operations[Op]['responses'][Status] extends { content: { 'application/json': infer T } }
  ? T
  : never;

/** The JSON body an operation takes. */
export type Body<Op extends keyof operations> = operations[Op]['requestBody'] extends
  { content: { 'application/json': infer T } } | undefined
  ? T
  : never;

export type SandboxInfo = Schemas['SandboxInfo'];
export type VolumeInfo = Schemas['VolumeInfo'];
export type SandboxSpec = Schemas['SandboxSpec'];
export type SandboxState = Schemas['SandboxState'];
export type CommandResult = Schemas['CommandResult'];
export type CommandInfo = Schemas['CommandInfo'];
export type SessionResult = Schemas['SessionResult'];
export type SessionInfo = Schemas['SessionInfo'];
export type FileInfo = Schemas['FileInfo'];
export type FileType = FileInfo['type'];
export type LayerInfo = Schemas['LayerInfo'];
export type SnapshotInfo = Schemas['SnapshotInfo'];
export type ForkResult = Schemas['ForkResult'];
export type EdgeStatus = Schemas['EdgeStatus'];
export type SandboxEvent = Schemas['SandboxEvent'];
export type SandboxEventKind = SandboxEvent['kind'];
export type Project = Schemas['Project'];
export type CreatedKey = Schemas['CreatedKey'];
export type Whoami = Schemas['Whoami'];
export type Health = Schemas['Health'];
export type ErrorCode = Schemas['ErrorCode'];
/** The answer of a whole-job operation (`pauseJob`, …): every selected sandbox, one list or the other. */
export type JobResult = Schemas['JobResult'];
/** One NDJSON line of a streamed command (base64 output, then a result or an error). */
export type CommandWireEvent = Schemas['CommandEvent'];

export type CreateSandboxBody = Schemas['CreateSandboxBody'];
export type CommandBody = Schemas['CommandBody'];
export type SessionRunBody = Schemas['SessionRunBody'];
export type ProjectBody = Schemas['ProjectBody'];
export type KeyBody = Schemas['KeyBody'];
export type JobBody = Schemas['JobBody'];
export type SnapshotBody = Schemas['SnapshotBody'];
export type ForkBody = Schemas['ForkBody'];
export type TimeoutBody = Schemas['TimeoutBody'];
export type SignalBody = Schemas['SignalBody'];
export type MkdirBody = Schemas['MkdirBody'];
export type RemoveBody = Schemas['RemoveBody'];
export type RenameBody = Schemas['RenameBody'];
/** A live change of a sandbox's egress policy: rules are merged by name, lists replaced when given. */
export type NetworkPolicyPatch = Schemas['NetworkPatchBody'];
/** Named network rules from the catalogue (`{ pypi: true, npm: false }`). */
export type NetworkRules = NonNullable<CreateSandboxBody['networkRules']>;
/** One explicit egress target: `{ domain: '*.example.com', ports: [443] }` or `{ cidr }`. */
export type NetworkTarget = NonNullable<CreateSandboxBody['networkAllow']>[number];
export type QosClass = NonNullable<CreateSandboxBody['qosClass']>;
