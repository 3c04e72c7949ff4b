import { DsecError } from '@dsec/core';

/**
 * `resource_exhausted` errors: the sandbox hit one of its own limits. Where
 * the platform needed a process or a block for a call and could not get one,
 * the error names the limit (`details.limit`) and its size, so clients can
 * tell a full sandbox from a broken platform.
 */

/** Whether a chronus spawn failure is the fork refusing at the pids limit (after reclaiming). */
export function isPidsRefusal(err: unknown): boolean {
  return (err as { code?: unknown } | undefined)?.code === 'EAGAIN';
}

export function pidsExhausted(pidsLimit: number | undefined, cause?: unknown): DsecError {
  return new DsecError(
    'resource_exhausted',
    `the sandbox is at its pids limit (${pidsLimit ?? 'unknown'} processes) and ending the ` +
      'processes left by earlier commands freed none',
    {
      details: { limit: 'pids', ...(pidsLimit !== undefined ? { max: pidsLimit } : {}) },
      cause,
    },
  );
}

/** A call's own script started but could not fork a tool it needed: the sandbox is at pids.max. */
export function pidsExhaustedDuring(what: string, pidsLimit: number | undefined): DsecError {
  return new DsecError(
    'resource_exhausted',
    `${what}: the sandbox is at its pids limit (${pidsLimit ?? 'unknown'} processes): a process the call needed could not start`,
    {
      details: {
        limit: 'pids',
        during: 'call',
        ...(pidsLimit !== undefined ? { max: pidsLimit } : {}),
      },
    },
  );
}

export function diskExhausted(what: string, diskLimitMb: number | undefined): DsecError {
  return new DsecError(
    'resource_exhausted',
    diskLimitMb !== undefined
      ? `${what}: the sandbox's disk is full (its quota is ${diskLimitMb} MiB)`
      : `${what}: the sandbox's disk is full (it has no quota of its own: the node's disk is)`,
    {
      field: 'path',
      details: { limit: 'disk', ...(diskLimitMb !== undefined ? { maxMb: diskLimitMb } : {}) },
    },
  );
}

/** Whether a busybox error line (`cat: write error: No space left on device`) is ENOSPC or EDQUOT. */
export function isDiskFullLine(line: string): boolean {
  return /: (No space left on device|Disk quota exceeded)$/.test(line.trim());
}
