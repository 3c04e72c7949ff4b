import http from 'node:http';
import type { AddressInfo } from 'node:net';
import { DsecError } from '@dsec/core';
import { Registry } from 'prom-client';

export interface MetricsListenerOptions {
  /** The registries served together (an edge's and an apiserver's in `dsec up`). */
  registries: Registry[];
  /** Address to listen on. Default `127.0.0.1`: metrics name tenants' load, keep them off public interfaces. */
  host?: string | undefined;
  /** Port; 0 picks a free one. */
  port: number;
}

export interface MetricsListener {
  /** `http://host:port/metrics`. */
  url: string;
  close(): Promise<void>;
}

/**
 * The admin listener (`--metrics-listen HOST:PORT`): `GET /metrics` in the
 * Prometheus text format and nothing else, without authentication. It is for
 * an address only operators reach (loopback by default, or a management
 * network); the public listener serves `/metrics` only to admin keys.
 */
export async function serveMetrics(options: MetricsListenerOptions): Promise<MetricsListener> {
  const { registries } = options;
  const server = http.createServer((req, res) => {
    const path = (req.url ?? '/').split('?')[0];
    if (req.method !== 'GET' || path !== '/metrics') {
      res.writeHead(404, { 'content-type': 'text/plain' }).end('only GET /metrics here\n');
      return;
    }
    metricsText(registries).then(
      (text) =>
        res
          .writeHead(200, {
            'content-type': Registry.PROMETHEUS_CONTENT_TYPE,
            'content-length': Buffer.byteLength(text),
          })
          .end(text),
      (err: unknown) =>
        res.writeHead(500, { 'content-type': 'text/plain' }).end(`${String(err)}\n`),
    );
  });
  server.keepAliveTimeout = 65_000;
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(options.port, options.host ?? '127.0.0.1', () => {
      server.off('error', reject);
      resolve();
    });
  });
  const address = server.address() as AddressInfo;
  const host = address.family === 'IPv6' ? `[${address.address}]` : address.address;
  return {
    url: `http://${host}:${address.port}/metrics`,
    close: () =>
      new Promise<void>((resolve) => {
        server.close(() => resolve());
        server.closeAllConnections();
      }),
  };
}

/**
 * The registries' series in one Prometheus text document. Concatenated, not
 * merged (`Registry.merge` would drop each registry's default labels); their
 * metric names must not overlap.
 */
export async function metricsText(registries: readonly Registry[]): Promise<string> {
  return (await Promise.all(registries.map((r) => r.metrics()))).join('\n');
}

/**
 * Parses `--metrics-listen HOST:PORT` (`127.0.0.1:9464`, `[::1]:9464`, or
 * `:9464` for loopback). Throws `invalid_argument` naming `field`.
 */
export function parseListenAddress(
  value: string,
  field = 'metricsListen',
): { host: string; port: number } {
  const m = /^(?:\[([0-9a-fA-F:.]+)\]|([^:[\]]*)):(\d{1,5})$/.exec(value.trim());
  const port = m ? Number(m[3]) : NaN;
  if (!m || port > 65_535) {
    throw new DsecError(
      'invalid_argument',
      `${field} must be HOST:PORT, not ${JSON.stringify(value)}`,
      {
        field,
      },
    );
  }
  return { host: m[1] ?? (m[2] || '127.0.0.1'), port };
}
