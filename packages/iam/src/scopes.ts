import { DsecError, formatLayerRef, parseLayerRef } from '@dsec/core';
import { globCovers, globMatch, wildcardCount } from './glob.js';
import type { Principal } from './types.js';

/**
 * Key scopes: what separates a builder principal (may snapshot sandboxes into
 * images) from a runtime principal (may start sandboxes from some images),
 * issue 11. A key without scopes (`scopes` undefined, every key made before
 * scopes existed) keeps all the rights of its role. A scoped key keeps them
 * too, except:
 *
 * - `sandboxes:snapshot` is needed to snapshot (and so to fork) a sandbox;
 * - `fncall:run` is needed to call FnCall runtimes (`/v1/fncall`): code run
 *   there stacks no layer a run pattern could name, so without it a key
 *   limited to `images:run:task-*` would still run any code on the
 *   platform's runtimes;
 * - `images:run:<pattern>` is needed to create a sandbox: every layer it
 *   stacks (image, workspace, toolkits) must match one of the key's run
 *   patterns. A pattern is a layer reference where `*` matches any run of
 *   characters; a pattern without `:version` matches every version
 *   (`images:run:task-*` runs `task-7:latest` and `task-7:v2`, not `base`).
 *   At most `MAX_PATTERN_WILDCARDS` stars per pattern; patterns are matched
 *   by hand in O(n·m) (`glob.ts`), never compiled to a RegExp.
 *
 * - `volumes:use` is needed to create, list, read, delete or mount the
 *   project's volumes (docs/volumes.md): a volume is state that outlives
 *   sandboxes, so without it a key limited to `images:run:task-*` would
 *   mount whatever the builder keeps there (hidden tests, answers), write
 *   into it for later runs, or carry files from one run to the next that
 *   no snapshot scope was needed to keep;
 *
 * Those are *restrictive* (`SCOPES`): they give back, on a scoped key, a
 * right every unscoped key has. Other scopes are *additive*: they add a right
 * the role alone does not give, so no key holds them unless it carries them:
 *
 * - `metrics:read` lets a member key of the root project read `/metrics`
 *   (admins of the root project may without it): a monitoring key.
 *
 * So `['sandboxes:snapshot', 'images:run:base*']` builds task images from
 * `base` without being able to run what it built, and `['images:run:task-*']`
 * runs them without being able to make new ones. (The apiserver refuses a
 * scoped key's snapshot under a name its own run patterns match, so the
 * builder cannot undo this by naming its snapshot `base-x`.)
 *
 * Granting (`ungrantableScopes`): a key grants only rights it holds. A
 * restrictive scope is grantable by an unscoped key, or by a scoped key whose
 * own scopes cover it (a held scope, or a wider run pattern); a scoped key
 * never mints an unscoped one. An additive scope is grantable only by a key
 * that carries it or by an admin key of the root project (issue 24: a
 * root-project member minted itself `metrics:read`).
 */
export const SNAPSHOT_SCOPE = 'sandboxes:snapshot';
export const FNCALL_SCOPE = 'fncall:run';
export const RUN_SCOPE_PREFIX = 'images:run:';
export const METRICS_SCOPE = 'metrics:read';
export const VOLUMES_SCOPE = 'volumes:use';
/** Scopes on one key at most. */
export const MAX_SCOPES = 32;
/**
 * `*` in one run pattern at most. Matching costs O(n·m) however many there
 * are; the cap keeps patterns legible and their cost small and fixed (issue 24).
 */
export const MAX_PATTERN_WILDCARDS = 8;

/**
 * Restrictive: a scoped key lacks the right unless it carries the scope; an
 * unscoped key has it. Additive: only a key that carries the scope has the
 * right (beyond what its role gives).
 */
export type ScopeKind = 'restrictive' | 'additive';

export interface ScopeSpec {
  /** The scope itself, or the prefix of a family (`images:run:`). */
  name: string;
  /** True for a family: the name is a prefix followed by a run pattern. */
  family: boolean;
  kind: ScopeKind;
}

/** Every scope a key may carry. A new scope must say here which kind it is. */
export const SCOPES: readonly ScopeSpec[] = Object.freeze([
  { name: SNAPSHOT_SCOPE, family: false, kind: 'restrictive' },
  { name: FNCALL_SCOPE, family: false, kind: 'restrictive' },
  { name: VOLUMES_SCOPE, family: false, kind: 'restrictive' },
  { name: RUN_SCOPE_PREFIX, family: true, kind: 'restrictive' },
  { name: METRICS_SCOPE, family: false, kind: 'additive' },
]);

/** The entry of `SCOPES` a scope belongs to; undefined for an unknown scope. */
export function scopeSpec(scope: string): ScopeSpec | undefined {
  return SCOPES.find((s) => (s.family ? scope.startsWith(s.name) : scope === s.name));
}

/** A run pattern: a layer reference that may hold `*` (bounded, no nested quantifiers). */
const RUN_PATTERN = /^[a-z0-9*][a-z0-9._*-]{0,127}(?::[A-Za-z0-9*][A-Za-z0-9._*-]{0,127})?$/;

/**
 * Checks and normalises a key's scopes: known forms only (`SCOPES`), at most
 * `MAX_PATTERN_WILDCARDS` stars in a run pattern, no duplicates, at most
 * `MAX_SCOPES`. Throws `invalid_argument` naming the entry (`scopes.2`).
 */
export function checkScopes(scopes: readonly unknown[]): string[] {
  if (scopes.length > MAX_SCOPES) {
    throw new DsecError('invalid_argument', `at most ${MAX_SCOPES} scopes`, { field: 'scopes' });
  }
  const out: string[] = [];
  scopes.forEach((scope, i) => {
    const field = `scopes.${i}`;
    const spec = typeof scope === 'string' ? scopeSpec(scope) : undefined;
    // The one family, images:run:, takes a run pattern.
    if (
      typeof scope !== 'string' ||
      !spec ||
      (spec.family && !RUN_PATTERN.test(scope.slice(spec.name.length)))
    ) {
      const forms = SCOPES.map((f) => (f.family ? `${f.name}<image pattern>` : f.name));
      throw new DsecError(
        'invalid_argument',
        `scope ${shown(scope)} is none of ${forms.join(', ')}`,
        {
          field,
        },
      );
    }
    const stars = wildcardCount(scope);
    if (stars > MAX_PATTERN_WILDCARDS) {
      throw new DsecError(
        'invalid_argument',
        `scope ${shown(scope)} has ${stars} wildcards; a run pattern may have at most ${MAX_PATTERN_WILDCARDS}`,
        { field, details: { wildcards: stars, max: MAX_PATTERN_WILDCARDS } },
      );
    }
    if (!out.includes(scope)) out.push(scope);
  });
  return out;
}

/** A caller's value in an error message, cut short (scopes may be 300 characters). */
function shown(value: unknown): string {
  const s = JSON.stringify(value) ?? String(value);
  return s.length > 80 ? `${s.slice(0, 77)}...` : s;
}

/** True for a key limited by scopes. */
export function isScoped(principal: Principal): boolean {
  return principal.scopes !== undefined;
}

/** Whether the principal may snapshot (unscoped keys may). */
export function maySnapshot(principal: Principal): boolean {
  return principal.scopes === undefined || principal.scopes.includes(SNAPSHOT_SCOPE);
}

/** Whether the principal may call FnCall runtimes (unscoped keys may). */
export function mayCallFnCall(principal: Principal): boolean {
  return principal.scopes === undefined || principal.scopes.includes(FNCALL_SCOPE);
}

/** Whether the principal may use the project's volumes (unscoped keys may). */
export function mayUseVolumes(principal: Principal): boolean {
  return principal.scopes === undefined || principal.scopes.includes(VOLUMES_SCOPE);
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
 * Whether a key carrying `held` has every right `wanted` names, by scopes
 * alone: each wanted scope is held, or (a run scope) falls inside a held run
 * pattern (`globCovers`). An unscoped key (`held` undefined) has every
 * restrictive right and no additive one; a scoped key never covers
 * "unscoped" (`wanted` undefined). Rights a role gives (a root admin's
 * metrics) are `ungrantableScopes`' business.
 */
export function scopesCover(
  held: readonly string[] | undefined,
  wanted: readonly string[] | undefined,
): boolean {
  if (wanted === undefined) return held === undefined;
  if (held === undefined) return wanted.every((w) => scopeSpec(w)?.kind === 'restrictive');
  const patterns = runPatterns(held);
  return wanted.every((w) => {
    if (held.includes(w)) return true;
    if (!w.startsWith(RUN_SCOPE_PREFIX)) return false;
    const wantedPattern = withVersion(w.slice(RUN_SCOPE_PREFIX.length));
    return patterns.some((p) => globCovers(p, wantedPattern));
  });
}

/** Who creates a key: its scopes, and whether it is an admin key of the root project. */
export interface Grantor {
  scopes?: readonly string[] | undefined;
  rootAdmin: boolean;
}

/**
 * The scopes of `wanted` that `grantor` may not put on a new key, in order;
 * empty when it may grant them all. A key grants only what it holds: a
 * restrictive scope it covers (`scopesCover`), an additive scope it carries
 * itself; an admin key of the root project holds every additive right (it
 * reads metrics by role). Whether it may mint an unscoped key
 * (`wanted` undefined) is `scopesCover(grantor.scopes, undefined)`.
 */
export function ungrantableScopes(grantor: Grantor, wanted: readonly string[]): string[] {
  return wanted.filter(
    (w) =>
      !(
        scopesCover(grantor.scopes, [w]) ||
        (grantor.rootAdmin && scopeSpec(w)?.kind === 'additive')
      ),
  );
}

/**
 * Whether `revoker` may revoke a key carrying `target` (its role aside):
 * an unscoped key may revoke any key; a scoped key only keys it could have
 * granted (`ungrantableScopes`): restrictive scopes its own cover and
 * additive ones it holds, so a narrow runtime key cannot take away the
 * wider keys of its project, the monitoring key (`metrics:read`) among them.
 */
export function mayRevokeScopes(revoker: Grantor, target: readonly string[] | undefined): boolean {
  if (revoker.scopes === undefined) return true;
  if (target === undefined) return false;
  return ungrantableScopes(revoker, target).length === 0;
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
