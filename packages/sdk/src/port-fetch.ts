import { Readable } from 'node:stream';
import type { HttpTransport } from './transport.js';

export interface SandboxFetchInit {
  method?: string | undefined;
  headers?: Record<string, string> | undefined;
  body?: string | Uint8Array | Readable | undefined;
  signal?: AbortSignal | undefined;
  /** Deadline for the response's status line (default 30 s). */
  timeoutMs?: number | undefined;
}

/**
 * An HTTP request to a service listening on `port` inside the sandbox, as a
 * standard `Response` (its body streams). Goes through the apiserver; the
 * sandbox never sees the caller's API key.
 */
export async function fetchPort(
  http: HttpTransport,
  sandboxId: string,
  port: number,
  path: string,
  init: SandboxFetchInit = {},
): Promise<Response> {
  const rel = path.startsWith('/') ? path.slice(1) : path;
  const body =
    init.body === undefined
      ? undefined
      : typeof init.body === 'string'
        ? Buffer.from(init.body)
        : init.body instanceof Readable
          ? init.body
          : Buffer.from(init.body);
  const headers: Record<string, string> = { ...init.headers };
  if (body !== undefined && !Object.keys(headers).some((h) => h.toLowerCase() === 'content-type')) {
    headers['content-type'] = 'application/octet-stream';
  }
  const res = await http.raw({
    method: init.method ?? 'GET',
    path: `/v1/sandboxes/${encodeURIComponent(sandboxId)}/ports/${port}/${rel}`,
    headers,
    body,
    signal: init.signal,
    timeoutMs: init.timeoutMs ?? 30_000,
    // Any status the service answers is the caller's to read.
    acceptAnyStatus: true,
  });
  const status = res.statusCode ?? 502;
  const outHeaders = new Headers();
  for (const [k, v] of Object.entries(res.headers)) {
    if (Array.isArray(v)) for (const x of v) outHeaders.append(k, x);
    else if (v !== undefined) outHeaders.set(k, v);
  }
  const noBody =
    status === 204 || status === 304 || (init.method ?? 'GET').toUpperCase() === 'HEAD';
  if (noBody) res.resume();
  return new Response(noBody ? null : (Readable.toWeb(res) as ReadableStream), {
    status,
    headers: outHeaders,
  });
}
