/**
 * @dsec/apiserver — the stateless ingress of a DSec cluster, serving HTTP API
 * v1 (docs/CONVENTIONS.md): authenticates API keys against IAM, reserves
 * quota, asks placement for an edge, and forwards every sandbox operation to
 * the edge decoded from the sandbox ID (paper 3.2). Any number of instances
 * can run side by side; none keeps durable state.
 *
 * @example
 * ```ts
 * import { SandboxIdCodec } from '@dsec/core';
 * import { openControlDb } from '@dsec/iam';
 * import { Watcher } from '@dsec/watcher';
 * import { PowerOfKPlacer } from '@dsec/placement';
 * import { buildApiServer } from '@dsec/apiserver';
 *
 * const db = await openControlDb('iam.db');              // or a postgres:// URL
 * const edges = new Map([[edge.edgeId, edge]]);           // EdgeApi clients
 * const watcher = new Watcher({ edges });
 * watcher.start();
 * const app = buildApiServer({
 *   iam: db.iam,
 *   edges,
 *   watcher,
 *   placer: new PowerOfKPlacer({ view: () => watcher.view() }),
 *   ids: new SandboxIdCodec(clusterSecret),
 * });
 * await app.listen({ port: 7070 });
 * ```
 */
export { buildApiServer, API_VERSION, BODY_LIMIT_BYTES } from './server.js';
export type { ApiServerOptions } from './server.js';
export { SandboxService } from './sandbox-service.js';
export { ImageService, type ImageCatalog } from './image-service.js';
export { VolumeService } from './volume-service.js';
export type { VolumeServiceDeps } from './volume-service.js';
export {
  DEFAULT_IMAGE_BUILD_LIMITS,
  ImageBuildService,
  type ImageBuilder,
  type ImageBuildInfo,
  type ImageBuildLimits,
  type ImageBuildRequest,
  type ImageBuildStatus,
} from './image-builds.js';
export { DEFAULT_BUILD_CONTEXT_LIMITS, unpackBuildContext } from './build-context.js';
export type { BuildContextLimits, UnpackedContext } from './build-context.js';
export type {
  EdgeDirectory,
  FleetSource,
  ForkResult,
  JobAction,
  JobResult,
  OpenSandbox,
  SandboxServiceDeps,
} from './sandbox-service.js';
export { FnCallService } from './fncall-service.js';
export type { FnCallBatchItem, FnCallFleetSource, FnCallServiceDeps } from './fncall-service.js';
export { routeFnCall } from './fncall-routing.js';
export type { FnCallEdgeCandidate, FnCallRoute, FnCallRouteRequest } from './fncall-routing.js';
export {
  buildSandboxFusionListener,
  sandboxFusionRoutes,
  SANDBOXFUSION_BODY_LIMIT,
} from './sandboxfusion/routes.js';
export type {
  SandboxFusionListenerOptions,
  SandboxFusionRouteOptions,
} from './sandboxfusion/routes.js';
export {
  fromFnCall,
  runCode,
  runStatus,
  RunCodeBody,
  sandboxFusionLanguages,
  toFnCall,
} from './sandboxfusion/service.js';
export type {
  CommandRunResult,
  RunCodeRequest,
  RunCodeResponse,
  SandboxFusionDeps,
} from './sandboxfusion/service.js';
export { SANDBOXFUSION_LANGUAGES } from './sandboxfusion/languages.js';
export { ApiMetrics } from './metrics.js';
export { API_LIMIT_DEFAULTS, CallerLimits, retryAfterSeconds } from './limits.js';
export type { ApiLimits, StreamTicket } from './limits.js';
export { hostAllowed, hostAllowList, isAllowedHostPattern, MAX_URL_BYTES } from './request-gate.js';
export { sourceOf } from './auth.js';
export { toHttpError } from './errors.js';
export { forwardToPort, responseHeaders } from './routes/ports.js';
export {
  carriesCredential,
  sandboxBoundHeaders,
  sandboxBoundUrl,
} from './routes/port-credentials.js';
export { clientGone } from './routes/io-common.js';
export * as schemas from './schemas.js';
