import type { FastifyInstance } from 'fastify';
import type {
  ApiMetrics,
  CallerLimits,
  ImageBuildService,
  SandboxService,
  VolumeService,
} from '@dsec/apiserver';
import type { Iam } from '@dsec/iam';
import { controlPlaneRoutes, unknownE2bRoutes } from './control-plane.js';
import { ProcessTable } from './envd/process-table.js';
import { AutoPauser, E2bSandboxAccess } from './lifecycle.js';
import type { E2bImages } from './control-plane.js';
import { installSandboxRouting } from './sandbox-routing.js';
import { sandboxRoutes } from './sandbox-routes.js';
import { templateBuildRoutes, type E2bImageAliases } from './template-build.js';
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
  /** Template builds' `fromImage` names read as other images or layers (`resolveImageAlias`). */
  imageAliases?: E2bImageAliases | undefined;
  /**
   * The wildcard domain of the host-routed form `<port>-<sandboxId>.<domain>`,
   * answered to clients as the sandbox `domain`. Without it, any host whose
   * first label is `<port>-<E2B sandbox ID>` is routed to the sandbox.
   */
  sandboxDomain?: string | undefined;
  /** The apiserver's image service: E2B snapshots are listed and deleted through it. */
  images?: E2bImages | undefined;
  /** Time between two listings of a streamed directory watch. Default 250. */
  watchIntervalMs?: number | undefined;
  /** The apiserver's volumes: E2B's `/volumes` routes (docs/volumes.md). Absent: not served. */
  volumes?: VolumeService | undefined;
  /** The apiserver's Dockerfile builds: with them, `Template.build` works (template-build.ts). */
  builds?: ImageBuildService | undefined;
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
  const access = new E2bSandboxAccess(deps.service);
  const pauser = new AutoPauser({
    service: deps.service,
    access,
    onError: (id, err) => app.log.warn({ err, sandboxId: id }, 'e2b auto-pause failed'),
  });
  const processes = new ProcessTable();
  const shutdown = new AbortController();
  const routing = installSandboxRouting(app.server, deps.sandboxDomain);
  // Before the control plane's scope: its catch-all for unknown E2B routes skips what is served.
  if (deps.builds) {
    templateBuildRoutes(app, {
      iam: deps.iam,
      builds: deps.builds,
      templates: deps.templates,
      imageAliases: deps.imageAliases,
      limits: deps.limits,
    });
  }
  void app.register(async (scope) => {
    controlPlaneRoutes(scope, {
      service: deps.service,
      iam: deps.iam,
      access,
      pauser,
      images: deps.images,
      templates: deps.templates,
      sandboxDomain: deps.sandboxDomain,
      limits: deps.limits,
    });
    if (deps.volumes) e2bVolumeRoutes(scope, deps.volumes);
    unknownE2bRoutes(scope);
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
    pauser.close();
    shutdown.abort(new Error('the server is closing'));
    processes.closeAll();
  });
}
