/**
 * @dsec/e2b — the E2B API on DSec, so the unmodified `e2b` SDKs run against
 * a DSec apiserver with `E2B_API_URL` and `E2B_SANDBOX_URL` set to its URL
 * and `E2B_API_KEY` to a DSec API key (docs/e2b.md says what is covered).
 * The control plane maps onto `SandboxService`; the in-sandbox daemon
 * (envd's process and filesystem services over Connect RPC, and its `/files`
 * transfer) maps onto the edge's `SandboxIoApi`. Authorisation is the native
 * API's: the key's project, another project's sandbox not found.
 *
 * @example
 * ```ts
 * import { buildApiServer, SandboxService } from '@dsec/apiserver';
 * import { registerE2bRoutes } from '@dsec/e2b';
 *
 * const app = buildApiServer(options);
 * registerE2bRoutes(app, { service, iam: options.iam, templates: { base: 'busybox' } });
 * await app.listen({ port: 7420 });
 * // E2B_API_URL=http://host:7420 E2B_SANDBOX_URL=http://host:7420 E2B_API_KEY=<dsec key> node agent.js
 * ```
 */
export { registerE2bRoutes } from './register.js';
export type { E2bRoutesDeps } from './register.js';
export type { E2bTemplateBody, E2bTemplates } from './templates.js';
export { parseTemplateString, resolveTemplate } from './templates.js';
export { resolveImageAlias, E2B_BASE_IMAGE } from './template-build.js';
export type { E2bImageAliases } from './template-build.js';
export { toDsecSandboxId, toE2bSandboxId } from './ids.js';
export { ENVD_VERSION, TEMPLATE_LABEL } from './control-plane.js';
export {
  ENVD_PORT,
  addressOf,
  installSandboxRouting,
  parseSandboxHost,
  routedUrl,
} from './sandbox-routing.js';
export type { SandboxAddress } from './sandbox-routing.js';
