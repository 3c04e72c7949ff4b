import type { IncomingMessage, Server, ServerResponse } from 'node:http';
import { isIP } from 'node:net';
import { hostname } from 'node:os';
import type { Duplex } from 'node:stream';
import { STATUS_CODES } from 'node:http';
import { randomId } from '@dsec/core';

/**
 * Checks every request and upgrade before anything else of the server sees
 * it (routes, hooks, the E2B fast path): the `Host` header must name this
 * server, and the URL must not be absurdly long.
 *
 * Why the Host check: a web page the operator opens can make its own name
 * resolve to 127.0.0.1 (DNS rebinding) and then talk to a loopback apiserver
 * as a same-origin page of that name. Its requests carry its own name in
 * `Host`, so answering only the names this server is known by refuses them.
 * Always allowed: IP literals (a page served from an IP is that IP's own
 * origin, nothing to rebind), `localhost` and `*.localhost` (browsers resolve
 * them to loopback themselves), and this machine's host name. Others come
 * from `allowedHosts`: exact names (`api.example.com`), `*.suffix` for every
 * name under it, or `*` to turn the check off (a proxy in front that
 * rewrites `Host`). A request without `Host` (HTTP/1.0) passes: browsers
 * always send one.
 *
 * Refusals are DSec error bodies: `invalid_argument` with `field: "host"`
 * (400), and `invalid_argument` with `field: "url"` for a URL over
 * `MAX_URL_BYTES` (400 `invalid_argument`, field `url`: a code has one status everywhere); the connection is closed after them.
 */
export const MAX_URL_BYTES = 8192;

/** An `allowedHosts` entry: `*`, a host name, or `*.` and a host name (letters, digits, `-`, `.`; no port). */
export function isAllowedHostPattern(entry: string): boolean {
  if (entry === '*') return true;
  const name = entry.startsWith('*.') ? entry.slice(2) : entry;
  return (
    /^[A-Za-z0-9.-]{1,253}$/.test(name) &&
    !name.startsWith('.') &&
    !name.endsWith('.') &&
    !name.includes('..')
  );
}

export interface HostAllowList {
  any: boolean;
  exact: Set<string>;
  /** Suffixes with their leading dot (`.example.com`). */
  suffixes: string[];
}

/** Compiles `allowedHosts` (see the module) plus the built-in names. */
export function hostAllowList(allowedHosts: readonly string[] = []): HostAllowList {
  const list: HostAllowList = {
    any: false,
    exact: new Set(['localhost']),
    suffixes: ['.localhost'],
  };
  const own = hostname().toLowerCase();
  if (own) list.exact.add(own);
  for (const raw of allowedHosts) {
    const h = raw.trim().toLowerCase().replace(/\.$/, '');
    if (h === '*') list.any = true;
    else if (h.startsWith('*.')) list.suffixes.push(h.slice(1));
    else if (h) list.exact.add(h);
  }
  return list;
}

/**
 * The host name of a `Host` header value, lower case, without port or
 * brackets or a trailing dot; undefined when the value is no host at all.
 */
export function hostOf(header: string): string | undefined {
  let h = header.trim().toLowerCase();
  if (h.startsWith('[')) {
    const end = h.indexOf(']');
    if (end < 0) return undefined;
    const rest = h.slice(end + 1);
    if (rest !== '' && !/^:\d{1,5}$/.test(rest)) return undefined;
    return h.slice(1, end);
  }
  const colon = h.indexOf(':');
  if (colon >= 0) {
    if (!/^\d{1,5}$/.test(h.slice(colon + 1))) return undefined;
    h = h.slice(0, colon);
  }
  if (h.endsWith('.')) h = h.slice(0, -1);
  return h === '' ? undefined : h;
}

/** Whether a request with this `Host` header may be answered (see the module). */
export function hostAllowed(header: string | undefined, list: HostAllowList): boolean {
  if (header === undefined || list.any) return true;
  const h = hostOf(header);
  if (h === undefined) return false;
  if (isIP(h) !== 0) return true;
  if (list.exact.has(h)) return true;
  return list.suffixes.some((s) => h.length > s.length && h.endsWith(s));
}

export type GateRefusal = 'host' | 'url_too_long';

/**
 * Puts the checks in front of the server's `request` and `upgrade`
 * listeners; call once every listener of the server is installed.
 */
export function installRequestGate(
  server: Server,
  options: { allowedHosts?: readonly string[]; onRefused?: (reason: GateRefusal) => void },
): void {
  const list = hostAllowList(options.allowedHosts);
  const refusal = (req: IncomingMessage): [number, string, string] | undefined => {
    if (!hostAllowed(req.headers.host, list)) {
      return [
        400,
        'host',
        'this server does not answer to that Host name (apiserver.allowedHosts lists the names it answers)',
      ];
    }
    if ((req.url?.length ?? 0) > MAX_URL_BYTES) {
      return [400, 'url', `the URL is longer than ${MAX_URL_BYTES} bytes`];
    }
    return undefined;
  };
  type RequestListener = (req: IncomingMessage, res: ServerResponse) => void;
  const requestListeners = server.listeners('request') as RequestListener[];
  server.removeAllListeners('request');
  server.on('request', (req: IncomingMessage, res: ServerResponse) => {
    const refused = refusal(req);
    if (!refused) {
      for (const l of requestListeners) l.call(server, req, res);
      return;
    }
    options.onRefused?.(refused[1] === 'host' ? 'host' : 'url_too_long');
    const body = errorBody(refused);
    req.resume();
    res.writeHead(refused[0], {
      'content-type': 'application/json; charset=utf-8',
      'content-length': Buffer.byteLength(body),
      'x-request-id': randomId('req', 9),
      connection: 'close',
    });
    res.end(body);
  });
  type UpgradeListener = (req: IncomingMessage, socket: Duplex, head: Buffer) => void;
  const upgradeListeners = server.listeners('upgrade') as UpgradeListener[];
  server.removeAllListeners('upgrade');
  server.on('upgrade', (req: IncomingMessage, socket: Duplex, head: Buffer) => {
    const refused = refusal(req);
    if (!refused) {
      for (const l of upgradeListeners) l.call(server, req, socket, head);
      if (upgradeListeners.length === 0) socket.destroy();
      return;
    }
    options.onRefused?.(refused[1] === 'host' ? 'host' : 'url_too_long');
    const body = errorBody(refused);
    socket.on('error', () => undefined);
    socket.end(
      `HTTP/1.1 ${refused[0]} ${STATUS_CODES[refused[0]]}\r\nConnection: close\r\n` +
        `Content-Type: application/json; charset=utf-8\r\nContent-Length: ${Buffer.byteLength(body)}\r\n\r\n${body}`,
    );
  });
}

function errorBody([, field, message]: [number, string, string]): string {
  return JSON.stringify({ error: { code: 'invalid_argument', message, field } });
}
