import { createHash, randomBytes } from 'node:crypto';

/** A new run ID: 12 lower-case hex characters. */
export function newRunId(): string {
  return randomBytes(6).toString('hex');
}

/**
 * The request IDs of one task's attempt, derived from (run, instance,
 * attempt, phase, step): a driver that restarts derives the same IDs, so the
 * sandbox's command log answers steps already taken with their recorded
 * results instead of running them again (paper 6.2). IDs fit the API's
 * 1–128 characters of `[A-Za-z0-9._:-]`; an instance ID that does not is
 * shortened and suffixed with a hash of it.
 */
export class RequestIds {
  /** `ev.<run>.<instance>.<attempt>`; every command of this attempt starts with it. */
  readonly prefix: string;

  constructor(runId: string, instanceId: string, attempt: number) {
    this.prefix = `ev.${runId}.${safeInstance(instanceId)}.${attempt}`;
  }

  /** The sandbox create's idempotency key. */
  get create(): string {
    return `${this.prefix}:create`;
  }

  /** The grading sandbox's create (patch grading): a retry gets the same sandbox. */
  get graderCreate(): string {
    return `${this.prefix}:grader`;
  }

  /** Step `n` of `phase` (`a` agent, `x` taking the agent's patch, `g` grading); `part` tells apart the commands of one step. */
  step(phase: string, n: number, part = ''): string {
    return `${this.prefix}:${phase}${n}${part ? `.${part}` : ''}`;
  }

  owns(requestId: string | undefined): boolean {
    return requestId !== undefined && requestId.startsWith(`${this.prefix}:`);
  }
}

function safeInstance(id: string): string {
  const clean = id.replace(/[^A-Za-z0-9_-]/g, '_');
  if (clean === id && clean.length <= 64) return clean;
  const hash = createHash('sha256').update(id).digest('hex').slice(0, 10);
  return `${clean.slice(0, 52)}-${hash}`;
}
