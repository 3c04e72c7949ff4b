import { setMaxListeners } from 'node:events';
import { DsecError, toDsecError } from '@dsec/core';
import type {
  EdgeApi,
  FnCallGpuUnitStatus,
  FnCallPoolStatus,
  FnCallRequest,
  FnCallResult,
} from '@dsec/core';
import { FNCALL_SCOPE, mayCallFnCall, type Principal } from '@dsec/iam';
import { routeFnCall } from './fncall-routing.js';
import type { FnCallEdgeCandidate } from './fncall-routing.js';
import type { EdgeDirectory } from './sandbox-service.js';

/** The part of the watcher's view FnCall routing reads (structurally a `FleetView`). */
export interface FnCallFleetSource {
  view(): {
    edges: readonly {
      edgeId: string;
      healthy: boolean;
      /** Cordoned by an operator: sent no calls, whatever its pools. */
      cordoned?: boolean | undefined;
      labels: Record<string, string>;
      status?:
        | { fncall?: FnCallPoolStatus[] | undefined; gpus?: FnCallGpuUnitStatus[] | undefined }
        | undefined;
    }[];
  };
}

export interface FnCallServiceDeps {
  edges: EdgeDirectory;
  watcher: FnCallFleetSource;
  /**
   * Admission of `calls` calls for the project before any runs (IAM's
   * calls-per-second quota, issue 14.4): throws `quota_exceeded` to refuse.
   * Absent: no per-call quota beyond the edges' own admission.
   */
  admitCalls?:
    ((principal: Principal, projectId: string, calls: number) => Promise<void>) | undefined;
  /** Records a refusal (IAM's audit log): a scoped key without `fncall:run`. */
  audit?:
    | ((
        keyId: string,
        action: string,
        outcome: 'denied',
        details: Record<string, unknown>,
      ) => Promise<void>)
    | undefined;
  /** Random source of the routing shuffle (tests). */
  random?: (() => number) | undefined;
}

/** Edges tried for one call: the first choice plus retries after refusals. */
const MAX_ROUTE_ATTEMPTS = 3;

/** One finished call of a batch, in the order calls finish. */
export type FnCallBatchItem =
  | { index: number; result: FnCallResult }
  | { index: number; error: { code: string; message: string } };

/**
 * FnCall in the apiserver (issue 14): picks an edge with warm capacity for
 * the call's runtime (`routeFnCall`), sends the call there, and tries the
 * next edge when one refuses with `capacity_exhausted` or `unavailable`.
 * Calls are stateless, so a refused call is simply sent again elsewhere.
 * The caller's project is the call's project (quotas, audit on the edge).
 */
export class FnCallService {
  readonly #d: FnCallServiceDeps;

  constructor(deps: FnCallServiceDeps) {
    this.#d = deps;
  }

  async run(principal: Principal, req: FnCallRequest, signal?: AbortSignal): Promise<FnCallResult> {
    await this.admit(principal, 1);
    return this.#route(principal.projectId, req, signal);
  }

  /**
   * Admits `calls` calls of the caller's project: a scoped key needs `fncall:run`
   * (`permission_denied`, audited), then the quota. `batch` does not admit by itself.
   */
  async admit(principal: Principal, calls: number): Promise<void> {
    if (!mayCallFnCall(principal)) {
      await this.#d.audit?.(principal.keyId, 'fncall', 'denied', { reason: 'no fncall scope' });
      throw new DsecError('permission_denied', `this key has no ${FNCALL_SCOPE} scope`);
    }
    await this.#d.admitCalls?.(principal, principal.projectId, calls);
  }

  /**
   * Runs `calls` (admitted first with `admit`) with at most `concurrency` in flight and hands each outcome
   * to `onItem` as it finishes (completion order). A failed call is an item
   * with its error, never a failure of the batch; an abort stops starting
   * calls and aborts those in flight (their items are not delivered).
   */
  async batch(
    principal: Principal,
    calls: readonly FnCallRequest[],
    concurrency: number,
    onItem: (item: FnCallBatchItem) => void,
    signal?: AbortSignal,
  ): Promise<void> {
    // Every call in flight listens on the one signal: more than Node's default of 10 is expected.
    if (signal) setMaxListeners(Math.max(10, concurrency + 10), signal);
    let next = 0;
    const worker = async () => {
      while (next < calls.length && !signal?.aborted) {
        const index = next++;
        let item: FnCallBatchItem;
        try {
          item = { index, result: await this.#route(principal.projectId, calls[index]!, signal) };
        } catch (err) {
          if (signal?.aborted) return;
          const e = toDsecError(err);
          item = {
            index,
            error: { code: e.code, message: e.code === 'internal' ? 'internal error' : e.message },
          };
        }
        onItem(item);
      }
    };
    await Promise.all(Array.from({ length: Math.min(concurrency, calls.length) }, worker));
  }

  async #route(projectId: string, req: FnCallRequest, signal?: AbortSignal): Promise<FnCallResult> {
    const exclude = new Set<string>();
    let refusal: DsecError | undefined;
    for (let attempt = 0; attempt < MAX_ROUTE_ATTEMPTS; attempt++) {
      const [choice] = routeFnCall(this.#candidates(), req, {
        exclude,
        random: this.#d.random,
      });
      if (!choice) break;
      const edge = this.#edge(choice.edgeId);
      if (!edge?.fncall) {
        exclude.add(choice.edgeId);
        continue;
      }
      try {
        const result = await edge.fncall(req, { projectId, signal });
        return result.edgeId === undefined ? { ...result, edgeId: edge.edgeId } : result;
      } catch (err) {
        const e = toDsecError(err);
        if (e.code !== 'capacity_exhausted' && e.code !== 'unavailable') throw e;
        if (signal?.aborted) throw e;
        exclude.add(choice.edgeId);
        refusal = e;
      }
    }
    throw refusal ?? new DsecError('unavailable', noEdgeMessage(req));
  }

  /** Every edge the view knows, plus configured edges not probed yet (a fresh apiserver). */
  #candidates(): FnCallEdgeCandidate[] {
    const out: FnCallEdgeCandidate[] = [];
    const seen = new Set<string>();
    for (const v of this.#d.watcher.view().edges) {
      seen.add(v.edgeId);
      if (v.cordoned) continue;
      out.push({
        edgeId: v.edgeId,
        healthy: v.healthy,
        labels: v.labels,
        pools: v.status?.fncall,
        gpus: v.status?.gpus,
        implementsFnCall: typeof this.#edge(v.edgeId)?.fncall === 'function',
      });
    }
    const { edges } = this.#d;
    if (edges instanceof Map) {
      for (const [edgeId, edge] of edges) {
        if (seen.has(edgeId)) continue;
        out.push({
          edgeId,
          healthy: true,
          labels: {},
          pools: undefined,
          implementsFnCall: typeof edge.fncall === 'function',
        });
      }
    }
    return out;
  }

  #edge(edgeId: string): EdgeApi | undefined {
    const { edges } = this.#d;
    return typeof edges === 'function' ? edges(edgeId) : edges.get(edgeId);
  }
}

/** Why no edge was tried: what the call asked for that no edge offers. */
function noEdgeMessage(req: FnCallRequest): string {
  const selector = req.edgeSelector && Object.keys(req.edgeSelector).length > 0;
  const where = selector ? 'no edge matching edgeSelector' : 'no edge';
  if (!req.gpu) return `${where} runs function calls`;
  const model = req.gpu.model ? ` ${req.gpu.model}` : '';
  return `${where} has free ${req.gpu.mode} GPU units${model} for this call (docs/gpu.md)`;
}
