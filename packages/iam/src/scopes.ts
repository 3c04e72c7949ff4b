import { DsecError, formatLayerRef, parseLayerRef } from '@dsec/core';
import type { Principal } from './types.js';

/**
 * Key scopes: what separates a builder principal (may snapshot sandboxes into
 * images) from a runtime principal (may start sandboxes from some images),
 * issue 11. A key without scopes (`scopes` undefined, every key made before
 * scopes existed) keeps all the rights of its role. A scoped key keeps them
 * too, except:
 *
 * - `sandboxes:snapshot` is needed to snapshot (and so to fork) a sandbox;
 * - `images:run:<pattern>` is needed to create a sandbox: every layer it
 *   stacks (image, workspace, toolkits) must match one of the key's run
 *   patterns. A pattern is a layer reference where `*` matches any run of
 *   characters; a pattern without `:version` matches every version
 *   (`images:run:task-*` runs `task-7:latest` and `task-7:v2`, not `base`).
 *
 * - `metrics:read` lets a member key of the root project read `/metrics`
 *   (admins of the root project may without it): a monitoring key.
 *
 * So `['sandboxes:snapshot', 'images:run:base*']` builds task images from
 * `base` without being able to run what it built, and `['images:run:task-*']`
 * runs them without being able to make new ones. A key creates keys only
 * with scopes its own cover (a scoped key cannot mint an unscoped one).
 */
export const SNAPSHOT_SCOPE = 'sandboxes:snapshot';
export const RUN_SCOPE_PREFIX = 'images:run:';
export const METRICS_SCOPE = 'metrics:read';
/** Scopes on one key at most. */
export const MAX_SCOPES = 32;

/** A run pattern: a layer reference that may hold `*`. */
const RUN_PATTERN = /^[a-z0-9*][a-z0-9._*-]{0,127}(?::[A-Za-z0-9*][A-Za-z0-9._*-]{0,127})?$/;

/**
 * Checks and normalises a key's scopes: known forms only, no duplicates,
 * at most `MAX_SCOPES`. Throws `invalid_argument` naming the entry
 * (`scopes.2`).
 */
export function checkScopes(scopes: readonly unknown[]): string[] {
  if (scopes.length > MAX_SCOPES) {
    throw new DsecError('invalid_argument', `at most ${MAX_SCOPES} scopes`, { field: 'scopes' });
  }
  const out: string[] = [];
  scopes.forEach((scope, i) => {
    const ok =
      typeof scope === 'string' &&
      (scope === SNAPSHOT_SCOPE ||
        scope === METRICS_SCOPE ||
        (scope.startsWith(RUN_SCOPE_PREFIX) &&
          RUN_PATTERN.test(scope.slice(RUN_SCOPE_PREFIX.length))));
    if (!ok) {
      throw new DsecError(
        'invalid_argument',
        `scope ${JSON.stringify(scope)} is none of ${SNAPSHOT_SCOPE}, ${METRICS_SCOPE}, ${RUN_SCOPE_PREFIX}<image pattern>`,
        { field: `scopes.${i}` },
      );
    }
    if (!out.includes(scope)) out.push(scope);
  });
  return out;
}

/** True for a key limited by scopes. */
export function isScoped(principal: Principal): boolean {
  return principal.scopes !== undefined;
}

/** Whether the principal may snapshot (unscoped keys may). */
export function maySnapshot(principal: Principal): boolean {
  return principal.scopes === undefined || principal.scopes.includes(SNAPSHOT_SCOPE);
}

/**
 * Whether the principal's role or scopes allow reading metrics: an admin, or
 * a key with `metrics:read`. The caller also requires the root project
 * (metrics show every tenant's load).
 */
export function mayReadMetrics(principal: Principal): boolean {
  return principal.role === 'admin' || (principal.scopes ?? []).includes(METRICS_SCOPE);
}

/** Whether the principal may start a sandbox stacking layer `ref` (unscoped keys may). */
export function mayRunImage(principal: Principal, ref: string): boolean {
  if (principal.scopes === undefined) return true;
  const parsed = parseLayerRef(ref);
  if (!parsed) return false;
  const full = formatLayerRef(parsed);
  return runPatterns(principal.scopes).some((p) => globMatch(p, full));
}

/**
 * The layers of `refs` the principal may not run, in order; empty when it
 * may run them all.
 */
export function unrunnableImages(principal: Principal, refs: readonly string[]): string[] {
  return refs.filter((r) => !mayRunImage(principal, r));
}

/**
 * Whether a key holding `held` may grant `wanted`: each wanted scope must be
 * held, or (a run scope) fall inside a held run pattern. Unscoped holders
 * grant anything; scoped ones never grant "unscoped".
 */
export function scopesCover(
  held: readonly string[] | undefined,
  wanted: readonly string[] | undefined,
): boolean {
  if (held === undefined) return true;
  if (wanted === undefined) return false;
  const patterns = runPatterns(held);
  return wanted.every((w) => {
    if (held.includes(w)) return true;
    if (!w.startsWith(RUN_SCOPE_PREFIX)) return false;
    // A held pattern that matches the wanted pattern as literal text matches every
    // name the wanted one does: each `*` of the wanted one lies inside a held `*`.
    const literal = withVersion(w.slice(RUN_SCOPE_PREFIX.length));
    return patterns.some((p) => globMatch(p, literal));
  });
}

/** Run patterns of a scope list, each with an explicit version part. */
function runPatterns(scopes: readonly string[]): string[] {
  return scopes
    .filter((s) => s.startsWith(RUN_SCOPE_PREFIX))
    .map((s) => withVersion(s.slice(RUN_SCOPE_PREFIX.length)));
}

function withVersion(pattern: string): string {
  return pattern.includes(':') ? pattern : `${pattern}:*`;
}

function globMatch(pattern: string, text: string): boolean {
  const re = new RegExp(
    `^${pattern
      .split('*')
      .map((part) => part.replace(/[.+?^${}()|[\]\\-]/g, '\\$&'))
      .join('.*')}$`,
    's',
  );
  return re.test(text);
}
