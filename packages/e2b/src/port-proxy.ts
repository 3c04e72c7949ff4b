import type { FastifyReply, FastifyRequest } from 'fastify';
import {
  forwardToPort,
  responseHeaders,
  sandboxBoundHeaders,
  sandboxBoundUrl,
} from '@dsec/apiserver';
import type { OpenedSandbox } from './sandbox-access.js';

/**
 * A request to `<port>-<sandboxId>.<domain>` (or with `E2b-Sandbox-Port`)
 * for a port other than envd's: one HTTP/1.1 exchange with the service on
 * `127.0.0.1:port` inside the sandbox, over the byte stream the edge opens in
 * the sandbox's network namespace, as the native `…/ports/:port/*` route
 * does. The caller's DSec credentials (in any header, cookie or query
 * parameter: the apiserver's port-credentials.ts) and the routing headers
 * stay here; `Authorization` goes on unless it carries one (a web app's own
 * `Basic` or `Bearer` scheme).
 */
export async function proxyToPort(
  sb: OpenedSandbox,
  port: number,
  url: string,
  req: FastifyRequest,
  reply: FastifyReply,
  signal: AbortSignal,
  /** The caller's DSec key, wherever it came (none: a public sandbox's keyless traffic). */
  key: string | undefined,
): Promise<void> {
  const secrets = key === undefined ? [] : [key];
  const target = sandboxBoundUrl(url, secrets);
  const socket = await sb.io.connectPort(sb.id, port, { signal });
  const headers = sandboxBoundHeaders(req.headers, { secrets, dropAuthorization: false });
  headers.connection = 'close';
  const method = req.method.toUpperCase();
  const body = method === 'GET' || method === 'HEAD' ? undefined : req.raw;
  const res = await forwardToPort(socket, req.method, target, headers, body, signal);
  await reply
    .code(res.statusCode ?? 502)
    .headers(responseHeaders(res))
    .send(res);
}
