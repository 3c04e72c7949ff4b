import http from 'node:http';
import type { IncomingMessage, OutgoingHttpHeaders } from 'node:http';
import type { Duplex } from 'node:stream';
import { DsecError } from '@dsec/core';
import type { FastifyReply, FastifyRequest } from 'fastify';
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
const DROP_RESPONSE = new Set([
  'connection',
  'keep-alive',
  'transfer-encoding',
  'trailer',
  'upgrade',
  'proxy-authenticate',
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
  const res = await forward(socket, req, url, headers, signal);
  const out: Record<string, string | string[]> = {};
  for (const [k, v] of Object.entries(res.headers)) {
    if (!DROP_RESPONSE.has(k.toLowerCase()) && v !== undefined) out[k] = v;
  }
  await reply
    .code(res.statusCode ?? 502)
    .headers(out)
    .send(res);
}

function forward(
  socket: Duplex,
  req: FastifyRequest,
  path: string,
  headers: OutgoingHttpHeaders,
  signal: AbortSignal,
): Promise<IncomingMessage> {
  return new Promise((resolve, reject) => {
    const upstream = http.request({
      method: req.method,
      path,
      headers,
      createConnection: () => socket,
      signal,
    });
    let answered = false;
    upstream.on('response', (res) => {
      answered = true;
      resolve(res);
    });
    // A tunnel that fails before the client attaches reports on the socket only.
    let tunnelError: unknown;
    socket.once('error', (err) => (tunnelError = err));
    socket.once('close', () => {
      if (!answered) {
        upstream.destroy(
          tunnelError instanceof Error
            ? tunnelError
            : new DsecError('unavailable', 'the port tunnel closed'),
        );
      }
    });
    upstream.on('error', (err) => {
      socket.destroy();
      reject(
        err instanceof DsecError
          ? err
          : new DsecError('unavailable', `nothing answered on port: ${err.message}`),
      );
    });
    const method = req.method.toUpperCase();
    if (method === 'GET' || method === 'HEAD') upstream.end();
    else req.raw.pipe(upstream);
  });
}
