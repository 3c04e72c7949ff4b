import { DsecError } from '@dsec/core';
import type {
  EdgeApi,
  EdgeStatus,
  FnCallOptions,
  FnCallPoolStatus,
  FnCallRequest,
  FnCallResult,
} from '@dsec/core';

/**
 * An in-process stand-in for an edge's FnCall pools (issue 14), for tests of
 * the layers above the edge (routing, the HTTP API, the SDKs, the CLI): it
 * records every call and answers it from a script, by default by echoing
 * stdin to stdout (exit 0). It runs no program.
 */
export interface FnCallScript {
  /** Answer these fields (the rest from the default echo). */
  result?: Partial<FnCallResult>;
  /** Throw this instead (`capacity_exhausted` to test re-routing). */
  error?: DsecError;
  /** Answer after this long (or on abort, with `aborted`). */
  delayMs?: number;
  /** Answer once this settles (before `delayMs`): orders calls without timing them. */
  after?: Promise<unknown>;
}

export class FnCallDouble {
  /** Every call received, with its project, in order. */
  readonly calls: { req: FnCallRequest; projectId: string }[] = [];
  /** Reported in `EdgeStatus.fncall` by edges that use this double. */
  pools: FnCallPoolStatus[] | undefined;
  /** Scripts a call; return undefined for the echo. */
  onCall: ((req: FnCallRequest) => FnCallScript | undefined) | undefined;

  constructor(readonly edgeId: string) {}

  async run(req: FnCallRequest, options: FnCallOptions): Promise<FnCallResult> {
    this.calls.push({ req, projectId: options.projectId });
    const script = this.onCall?.(req);
    if (script?.after) await script.after;
    if (script?.delayMs !== undefined) await sleep(script.delayMs, options.signal);
    if (options.signal?.aborted) throw new DsecError('aborted', 'the call was aborted');
    if (script?.error) throw script.error;
    return {
      exitCode: 0,
      stdout: req.stdin ?? '',
      stderr: '',
      truncated: false,
      outcome: 'ok',
      durationMs: 1,
      edgeId: this.edgeId,
      ...script?.result,
    };
  }

  /** `status` with this double's pools added. */
  withPools(status: EdgeStatus): EdgeStatus {
    return this.pools ? { ...status, fncall: this.pools.map((p) => ({ ...p })) } : status;
  }
}

/** Gives `edge` a `fncall` backed by a new double, and reports its pools in `status()`. */
export function addFnCall<E extends EdgeApi>(edge: E): E & { fncallDouble: FnCallDouble } {
  const double = new FnCallDouble(edge.edgeId);
  const status = edge.status.bind(edge);
  return Object.assign(edge, {
    fncallDouble: double,
    fncall: (req: FnCallRequest, options: FnCallOptions) => double.run(req, options),
    status: async (signal?: AbortSignal) => double.withPools(await status(signal)),
  });
}

function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener('abort', () => {
      clearTimeout(timer);
      reject(new DsecError('aborted', 'the call was aborted'));
    });
  });
}
