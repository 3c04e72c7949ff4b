import { createContextKey } from '@connectrpc/connect';
import type { HandlerContext } from '@connectrpc/connect';
import { DsecError } from '@dsec/core';
import type { E2bCaller } from '../auth.js';
import type { OpenedSandbox, SandboxAccess } from '../sandbox-access.js';

/** What the HTTP layer learnt before an RPC: who calls, and which sandbox (DSec ID) it addresses. */
export interface EnvdTarget {
  caller: E2bCaller;
  sandboxId: string;
}

export const envdTargetKey = createContextKey<EnvdTarget | undefined>(undefined, {
  description: 'E2B envd call target',
});

/** A client that stops reading a stream is cut off past this many queued bytes. */
export const MAX_STREAM_BUFFER_BYTES = 8 * 1024 * 1024;

/** Opens (authorises) the sandbox an RPC addresses. */
export async function openTarget(
  access: SandboxAccess,
  ctx: HandlerContext,
): Promise<OpenedSandbox> {
  const target = ctx.values.get(envdTargetKey);
  if (!target) throw new DsecError('unauthenticated', 'missing API key (X-Access-Token)');
  return access.open(target.caller.principal, target.sandboxId, ctx.signal);
}
