import type { IncomingMessage, Server, ServerResponse } from 'node:http';
import { toDsecSandboxId } from './ids.js';

/**
 * Which sandbox (and port in it) a request addresses. The E2B SDKs reach a
 * sandbox two ways: with `E2B_SANDBOX_URL` every in-sandbox call goes to that
 * one URL with `E2b-Sandbox-Id` (and `E2b-Sandbox-Port`) headers; without
 * it, to the host `<port>-<sandboxId>.<domain>`. Either way the apiserver
 * sees an ordinary request whose path means something inside the sandbox
 * (`/files`, `/process.Process/Start`, a user's web app's `/`), so the
 * address is read before routing and the request is routed under an
 * internal prefix that only this rewrite can produce.
 */

/** The port of envd, E2B's in-sandbox daemon, which DSec answers itself. */
export const ENVD_PORT = 49983;

/** Where addressed requests are routed; direct requests to it are refused. */
export const SANDBOX_ROUTE_PREFIX = '/_e2b/sandbox';

export interface SandboxAddress {
  port: number;
  /** The sandbox ID as the client spelt it (E2B form, or DSec's in the header form). */
  sandboxId: string;
  /** The request's own URL, before the rewrite. */
  url: string;
}

const ADDRESS = Symbol('e2b.sandbox-address');

type AddressedRequest = IncomingMessage & { [ADDRESS]?: SandboxAddress };

/** The address a rewritten request carries; undefined for every other request. */
export function sandboxAddressOf(req: IncomingMessage): SandboxAddress | undefined {
  return (req as AddressedRequest)[ADDRESS];
}

function validPort(n: number): boolean {
  return Number.isInteger(n) && n >= 1 && n <= 65535;
}

/**
 * `<port>-<sandboxId>.<domain>` → port and ID. With `domain` set, only hosts
 * under it match; without, any host whose first label is a port and a
 * well-formed E2B sandbox ID.
 */
export function parseSandboxHost(
  host: string | undefined,
  domain?: string,
): { port: number; sandboxId: string } | undefined {
  if (!host) return undefined;
  const name = host.replace(/:\d+$/, '').toLowerCase();
  const dot = name.indexOf('.');
  if (dot < 0) return undefined;
  if (domain !== undefined && name.slice(dot + 1) !== domain.toLowerCase()) return undefined;
  const m = /^(\d{1,5})-(sb[a-z2-7]+)$/.exec(name.slice(0, dot));
  if (!m) return undefined;
  const port = Number(m[1]);
  const sandboxId = m[2]!;
  if (!validPort(port)) return undefined;
  try {
    toDsecSandboxId(sandboxId);
  } catch {
    return undefined;
  }
  return { port, sandboxId };
}

/** The sandbox a request addresses: the `E2b-Sandbox-Id` header first, then the host. */
export function addressOf(
  req: Pick<IncomingMessage, 'headers' | 'url'>,
  domain?: string,
): SandboxAddress | undefined {
  const url = req.url ?? '/';
  const id = req.headers['e2b-sandbox-id'];
  if (typeof id === 'string' && id !== '') {
    const rawPort = req.headers['e2b-sandbox-port'];
    const port = typeof rawPort === 'string' && rawPort !== '' ? Number(rawPort) : ENVD_PORT;
    // A bad port still addresses the sandbox: the route answers 400 rather than the API 404.
    return { port: validPort(port) ? port : 0, sandboxId: id, url };
  }
  const hosted = parseSandboxHost(req.headers.host, domain);
  return hosted ? { ...hosted, url } : undefined;
}

/** The URL an addressed request is routed as. */
export function routedUrl(a: SandboxAddress): string {
  const path = a.url.startsWith('/') ? a.url : `/${a.url}`;
  return `${SANDBOX_ROUTE_PREFIX}/${a.port}/${encodeURIComponent(a.sandboxId)}${path}`;
}

/**
 * Serves an addressed request before the router, or returns false to leave
 * it to the routes. `route` hands a request it took back to the routes (it
 * may call it later, before reading anything of the request).
 */
export type SandboxFastPath = (
  req: IncomingMessage,
  res: ServerResponse,
  address: SandboxAddress,
  route: () => void,
) => boolean;

export interface SandboxRouting {
  /** Set once the routes are built (`sandboxRoutes`): the hot RPCs skip the router. */
  fastPath: SandboxFastPath | undefined;
}

/**
 * Puts the address rewrite in front of the server's request listeners (the
 * fastify handler). Fastify's `rewriteUrl` option does the same when the
 * server is built with it; this works on a server already built.
 */
export function installSandboxRouting(server: Server, domain?: string): SandboxRouting {
  type Listener = (req: IncomingMessage, res: ServerResponse) => void;
  const listeners = server.listeners('request') as Listener[];
  const routing: SandboxRouting = { fastPath: undefined };
  server.removeAllListeners('request');
  server.on('request', (req: AddressedRequest, res: ServerResponse) => {
    const address = addressOf(req, domain);
    const route = () => {
      if (address) {
        req[ADDRESS] = address;
        req.url = routedUrl(address);
      } else if (req.url?.startsWith(SANDBOX_ROUTE_PREFIX)) {
        req.url = '/_e2b/not-a-route';
      }
      for (const l of listeners) l.call(server, req, res);
    };
    if (address && routing.fastPath?.(req, res, address, route)) return;
    route();
  });
  return routing;
}
