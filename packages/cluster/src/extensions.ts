import type { ApiServerOptions } from '@dsec/apiserver';
import { registerE2bRoutes, type E2bTemplates } from '@dsec/e2b';

/** The E2B-compatible API's settings (docs/e2b.md). */
export interface E2bOptions {
  /** Template name → DSec image (`image[:v][/workspace][+toolkit]…`) or a partial create body. */
  templates?: E2bTemplates | undefined;
  /**
   * Template builds' `fromImage` names read as other images before pulling:
   * `{ "e2bdev/base": "layer:my-base:1" }` (a layer of the store) or a
   * registry reference. `e2bdev/base` defaults to the template `base`'s image.
   */
  imageAliases?: Record<string, string> | undefined;
  /** Serve `<port>-<sandboxId>.<domain>` host names (a wildcard DNS name pointing here). */
  sandboxDomain?: string | undefined;
  /** How often a filesystem watch re-lists its directory (default 250). */
  watchIntervalMs?: number | undefined;
}

/** Pause and idle settings an edge takes (ADR 0012). */
export interface LifecycleOptions {
  /** How long a paused sandbox is kept before it is stopped (default 24 h). */
  pausedTtlMs?: number | undefined;
  /** Pause sandboxes unused for this long (default: off). */
  idleTimeoutMs?: number | undefined;
  /** Swap files the edge may add under its state dir for pauses (default: half the memory, ≤ 64 GiB). */
  pauseSwapMaxBytes?: number | undefined;
}

/**
 * The E2B SDK asks for template `base` unless told otherwise: it maps to the
 * `busybox` image every node builds first (override with `templates.base`).
 */
export const DEFAULT_E2B_TEMPLATES: E2bTemplates = { base: 'busybox' };

/** Mounts the E2B-compatible routes on an apiserver (`ApiServerOptions.extend`). */
export function e2bExtension(options: E2bOptions = {}): ApiServerOptions['extend'] {
  return (app, { service, iam, metrics, limits, images, volumes, builds }) =>
    registerE2bRoutes(app, {
      service,
      iam,
      volumes,
      metrics,
      limits,
      images,
      builds,
      templates: { ...DEFAULT_E2B_TEMPLATES, ...options.templates },
      ...(options.imageAliases ? { imageAliases: options.imageAliases } : {}),
      ...(options.sandboxDomain ? { sandboxDomain: options.sandboxDomain } : {}),
      ...(options.watchIntervalMs ? { watchIntervalMs: options.watchIntervalMs } : {}),
    });
}
