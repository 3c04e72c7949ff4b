import type { NetworkPolicyPatch, SandboxEvent, SandboxInfo } from './wire.js';
import type { HttpTransport } from './transport.js';
import type { CallOptions } from './types.js';

/**
 * Live network policy and audit events of one sandbox (issue 5). Used by
 * `Sandbox.updateNetworkRules` and `Sandbox.events`; exported for callers
 * that hold only an ID.
 */
export function updateNetworkRules(
  http: HttpTransport,
  id: string,
  patch: NetworkPolicyPatch,
  options: CallOptions & { defaultTimeoutMs: number },
): Promise<SandboxInfo> {
  return http.json<SandboxInfo>({
    method: 'PATCH',
    path: `/v1/sandboxes/${encodeURIComponent(id)}/network`,
    body: patch,
    signal: options.signal,
    timeoutMs: options.timeoutMs ?? options.defaultTimeoutMs,
    // Applying the same patch twice gives the same policy.
    idempotent: true,
  });
}

export interface EventsOptions extends CallOptions {
  /** Only events after this ID (the last one seen), for polling. */
  afterId?: number | undefined;
  /** At most this many (server default 500, max 1000). */
  limit?: number | undefined;
}

export async function listEvents(
  http: HttpTransport,
  id: string,
  options: EventsOptions & { defaultTimeoutMs: number },
): Promise<SandboxEvent[]> {
  const q = new URLSearchParams();
  if (options.afterId !== undefined) q.set('afterId', String(options.afterId));
  if (options.limit !== undefined) q.set('limit', String(options.limit));
  const query = q.size > 0 ? `?${q.toString()}` : '';
  const body = await http.json<{ events: SandboxEvent[] }>({
    method: 'GET',
    path: `/v1/sandboxes/${encodeURIComponent(id)}/events${query}`,
    signal: options.signal,
    timeoutMs: options.timeoutMs ?? options.defaultTimeoutMs,
    idempotent: true,
  });
  return body.events;
}
