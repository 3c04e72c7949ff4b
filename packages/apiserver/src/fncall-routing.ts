import { gpuUnitsUsable } from '@dsec/core';
import type { FnCallGpuRequest, FnCallGpuUnitStatus, FnCallPoolStatus } from '@dsec/core';

/**
 * Where a function call goes (issue 14.4), as a pure function of the
 * watcher's view: the apiserver tries the edges in the order returned.
 *
 * Tiers, best first:
 *   0. edges whose pool for the call's runtime (language and network) has
 *      idle workers: the call starts at once;
 *   1. edges whose pool for the runtime may still grow (workers below `max`);
 *   2. edges that report FnCall pools, none of them for this runtime or none
 *      with room (the edge may start one, or queue the call);
 *   3. edges that implement `fncall` but report no pools (an older status, or
 *      one not probed yet);
 *   4. edges the watcher marks down, last: one missed probe (a busy event
 *      loop, a slow status) must not turn a single-edge cluster away, and an
 *      edge that is really down refuses at once with `unavailable`.
 * Edges without `fncall`, edges missing a label of `edgeSelector` and edges
 * in `exclude` are left out. A call with `gpu` uses only pools of exactly
 * that GPU request, and a healthy, probed edge takes it only with an idle
 * worker of that pool, enough matching free units (`EdgeStatus.gpus`), or
 * (tier 2, to queue) a busy worker of that pool; others are left out.
 *
 * Within a tier the order is a weighted shuffle (by idle workers in tier 0,
 * by room to grow in tier 1, evenly otherwise): the view is a probe old, so
 * sending every call to the edge that had the most idle workers then would
 * herd a burst onto one edge while the others sit idle.
 */

export interface FnCallEdgeCandidate {
  edgeId: string;
  healthy: boolean;
  labels: Record<string, string>;
  /** The pools the edge reported in its last status (`EdgeStatus.fncall`); undefined when none. */
  pools: readonly FnCallPoolStatus[] | undefined;
  /** Whether the apiserver's client of the edge has `fncall` at all. */
  implementsFnCall: boolean;
  /** The GPU units the edge reported (`EdgeStatus.gpus`); undefined when none. */
  gpus?: readonly FnCallGpuUnitStatus[] | undefined;
}

export interface FnCallRouteRequest {
  language: string;
  network?: boolean | undefined;
  edgeSelector?: Record<string, string> | undefined;
  gpu?: FnCallGpuRequest | undefined;
}

export interface FnCallRouteOptions {
  exclude?: ReadonlySet<string> | undefined;
  /** Uniform in [0, 1); injectable so tests are deterministic. Default `Math.random`. */
  random?: (() => number) | undefined;
}

/** One edge in the answer, with the tier that placed it (for tests and logs). */
export interface FnCallRoute {
  edgeId: string;
  tier: 0 | 1 | 2 | 3 | 4;
}

export function routeFnCall(
  edges: readonly FnCallEdgeCandidate[],
  req: FnCallRouteRequest,
  options: FnCallRouteOptions = {},
): FnCallRoute[] {
  const random = options.random ?? Math.random;
  const network = req.network ?? false;
  const selector = Object.entries(req.edgeSelector ?? {});
  const tiers: { edgeId: string; weight: number }[][] = [[], [], [], [], []];
  for (const e of edges) {
    if (!e.implementsFnCall || options.exclude?.has(e.edgeId)) continue;
    if (!selector.every(([k, v]) => e.labels[k] === v)) continue;
    if (!e.healthy) {
      tiers[4]!.push({ edgeId: e.edgeId, weight: 1 });
      continue;
    }
    if (e.pools === undefined || e.pools.length === 0) {
      tiers[3]!.push({ edgeId: e.edgeId, weight: 1 });
      continue;
    }
    const pool = e.pools.find(
      (p) => p.language === req.language && p.network === network && sameGpu(p.gpu, req.gpu),
    );
    if (pool && pool.idle > 0) {
      tiers[0]!.push({ edgeId: e.edgeId, weight: pool.idle });
      continue;
    }
    // A new GPU worker needs free units; without them only a busy worker's queue is left.
    if (req.gpu && gpuUnitsUsable(e.gpus ?? [], req.gpu) < (req.gpu.count ?? 1)) {
      if (pool && pool.busy > 0) tiers[2]!.push({ edgeId: e.edgeId, weight: 1 });
      continue;
    }
    const room = pool ? pool.max - pool.idle - pool.busy - pool.starting : 0;
    if (room > 0) tiers[1]!.push({ edgeId: e.edgeId, weight: room });
    else tiers[2]!.push({ edgeId: e.edgeId, weight: 1 });
  }
  return tiers.flatMap((tier, i) =>
    weightedShuffle(tier, random).map((edgeId) => ({ edgeId, tier: i as FnCallRoute['tier'] })),
  );
}

/** Whether a pool's GPU request is the call's (both none, or the same mode, count and model). */
function sameGpu(a: FnCallGpuRequest | undefined, b: FnCallGpuRequest | undefined): boolean {
  if (a === undefined || b === undefined) return a === b;
  const model = (r: FnCallGpuRequest) => r.model?.trim() || undefined;
  return a.mode === b.mode && (a.count ?? 1) === (b.count ?? 1) && model(a) === model(b);
}

/** Draws without replacement, each draw proportional to the weights left. */
function weightedShuffle(items: { edgeId: string; weight: number }[], random: () => number) {
  const left = [...items];
  const out: string[] = [];
  while (left.length > 0) {
    const total = left.reduce((sum, x) => sum + x.weight, 0);
    let r = random() * total;
    let i = 0;
    while (i < left.length - 1 && r >= left[i]!.weight) r -= left[i++]!.weight;
    out.push(left[i]!.edgeId);
    left.splice(i, 1);
  }
  return out;
}
