import type { IncomingHttpHeaders } from 'node:http';
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

/**
 * A stream's share of the apiserver's output budget and of its key's stream
 * cap, set by the lean stream path (`connect-stream.ts`) for the call: the
 * stream's queue reports what it holds (`measure`) and asks, after each
 * event it queues, whether the stream may go on (`check`; false: it has
 * been cut, its connection reset).
 */
export interface StreamBacklog {
  measure?: (() => number) | undefined;
  check(): boolean;
}

export const streamBacklogKey = createContextKey<StreamBacklog | undefined>(undefined, {
  description: 'E2B stream backlog',
});

/** Opens (authorises) the sandbox an RPC addresses. */
export async function openTarget(
  access: SandboxAccess,
  ctx: HandlerContext,
): Promise<OpenedSandbox> {
  const target = ctx.values.get(envdTargetKey);
  if (!target) throw new DsecError('unauthenticated', 'missing API key (X-Access-Token)');
  return access.open(target.caller.principal, target.sandboxId, ctx.signal);
}

/**
 * The request headers of a call: node:http's own on the lean stream path
 * (`connect-stream.ts`, which builds web `Headers` only when asked), the
 * handler context's otherwise.
 */
export function requestHeadersOf(ctx: HandlerContext): Headers | IncomingHttpHeaders {
  return (
    (ctx as { nodeRequestHeader?: IncomingHttpHeaders }).nodeRequestHeader ?? ctx.requestHeader
  );
}

/** One request header (`Headers.get`'s reading: repeated values joined by `, `), null when absent. */
export function requestHeaderOf(ctx: HandlerContext, name: string): string | null {
  const raw = (ctx as { nodeRequestHeader?: IncomingHttpHeaders }).nodeRequestHeader;
  if (raw === undefined) return ctx.requestHeader.get(name);
  const value = raw[name];
  return typeof value === 'string' ? value : Array.isArray(value) ? value.join(', ') : null;
}
