import type { FastifyInstance } from 'fastify';
import type { ApiMetrics, CallerLimits, SandboxService, VolumeService } from '@dsec/apiserver';
import type { Iam } from '@dsec/iam';
import { controlPlaneRoutes } from './control-plane.js';
import { ProcessTable } from './envd/process-table.js';
import { SandboxAccess } from './sandbox-access.js';
import { installSandboxRouting } from './sandbox-routing.js';
import { sandboxRoutes } from './sandbox-routes.js';
import type { E2bTemplates } from './templates.js';
import { e2bVolumeRoutes } from './volume-routes.js';

export interface E2bRoutesDeps {
  /** The apiserver's sandbox service (the same instance its native routes use, or one on the same deps). */
  service: SandboxService;
  /** Authenticates the E2B credentials (`X-API-Key`, `X-Access-Token`): DSec API keys. */
  iam: Iam;
  /** The apiserver's request metrics: the streams that skip the router are counted there too. */
  metrics?: ApiMetrics | undefined;
  /** The apiserver's per-key stream cap and output budget: process and watch streams count. */
  limits?: CallerLimits | undefined;
  /**
   * Template names an operator defines (`{ base: 'busybox', big: { image: 'python', memoryLimitMb: 4096 } }`);
   * any other template is read as `image[/workspace][+toolkit]…` (docs/e2b.md).
   */
  templates?: E2bTemplates | undefined;
  /**
   * The wildcard domain of the host-routed form `<port>-<sandboxId>.<domain>`,
   * answered to clients as the sandbox `domain`. Without it, any host whose
   * first label is `<port>-<E2B sandbox ID>` is routed to the sandbox.
   */
  sandboxDomain?: string | undefined;
  /** Time between two listings of a streamed directory watch. Default 250. */
  watchIntervalMs?: number | undefined;
  /** The apiserver's volumes: E2B's `/volumes` routes (docs/volumes.md). Absent: not served. */
  volumes?: VolumeService | undefined;
}

/**
 * Serves the E2B API on a DSec apiserver (docs/e2b.md): the control plane
 * (`/sandboxes`, `/v2/sandboxes`…) and the in-sandbox daemon (envd: Connect
 * RPC and `/files`) for requests addressed to a sandbox by the
 * `E2b-Sandbox-Id` header or the host `<port>-<sandboxId>.<domain>`.
 * Call before `listen` (it wraps the server's request listener to read the
 * sandbox address before routing); closing the app ends its streams and
 * terminals.
 */
export function registerE2bRoutes(app: FastifyInstance, deps: E2bRoutesDeps): void {
  const access = new SandboxAccess(deps.service);
  const processes = new ProcessTable();
  const shutdown = new AbortController();
  const routing = installSandboxRouting(app.server, deps.sandboxDomain);
  void app.register(async (scope) => {
    controlPlaneRoutes(scope, {
      service: deps.service,
      iam: deps.iam,
      access,
      templates: deps.templates,
      sandboxDomain: deps.sandboxDomain,
      limits: deps.limits,
    });
    if (deps.volumes) e2bVolumeRoutes(scope, deps.volumes);
  });
  void app.register(async (scope) => {
    const close = sandboxRoutes(scope, {
      service: deps.service,
      iam: deps.iam,
      access,
      processes,
      watchIntervalMs: deps.watchIntervalMs ?? 250,
      shutdown: shutdown.signal,
      routing,
      metrics: deps.metrics,
      limits: deps.limits,
    });
    scope.addHook('onClose', async () => close());
  });
  app.addHook('preClose', async () => {
    shutdown.abort(new Error('the server is closing'));
    processes.closeAll();
  });
}
