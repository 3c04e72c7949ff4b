import type { OutgoingHttpHeaders } from 'node:http';
import type { FastifyReply, FastifyRequest } from 'fastify';
import { forwardToPort, responseHeaders } from '@dsec/apiserver';
import type { OpenedSandbox } from './sandbox-access.js';

/**
 * A request to `<port>-<sandboxId>.<domain>` (or with `E2b-Sandbox-Port`)
 * for a port other than envd's: one HTTP/1.1 exchange with the service on
 * `127.0.0.1:port` inside the sandbox, over the byte stream the edge opens in
 * the sandbox's network namespace, as the native `…/ports/:port/*` route
 * does. The caller's DSec credentials and the routing headers stay here.
 */

const DROP_REQUEST = new Set([
  'connection',
  'keep-alive',
  'proxy-authorization',
  'proxy-connection',
  'te',
  'trailer',
  'transfer-encoding',
  'upgrade',
  'expect',
  'x-api-key',
  'x-access-token',
  'e2b-traffic-access-token',
  'e2b-sandbox-id',
  'e2b-sandbox-port',
]);

export async function proxyToPort(
  sb: OpenedSandbox,
  port: number,
  url: string,
  req: FastifyRequest,
  reply: FastifyReply,
  signal: AbortSignal,
  /** The header that carried the DSec key (dropped too when it is `authorization`). */
  credentialHeader: string | undefined,
): Promise<void> {
  const socket = await sb.io.connectPort(sb.id, port, { signal });
  const headers: OutgoingHttpHeaders = {};
  for (const [k, v] of Object.entries(req.headers)) {
    const name = k.toLowerCase();
    if (DROP_REQUEST.has(name) || name === credentialHeader || v === undefined) continue;
    headers[k] = v;
  }
  headers.connection = 'close';
  const method = req.method.toUpperCase();
  const body = method === 'GET' || method === 'HEAD' ? undefined : req.raw;
  const res = await forwardToPort(socket, req.method, url, headers, body, signal);
  await reply
    .code(res.statusCode ?? 502)
    .headers(responseHeaders(res))
    .send(res);
}
