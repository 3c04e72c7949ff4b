import { createReadStream } from 'node:fs';
import { stat } from 'node:fs/promises';
import { extname, join, resolve, sep } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { FastifyInstance, FastifyReply } from 'fastify';
import { DsecError } from '@dsec/core';

const CONTENT_TYPES: Record<string, string> = {
  '.html': 'text/html; charset=utf-8',
  '.js': 'text/javascript; charset=utf-8',
  '.css': 'text/css; charset=utf-8',
  '.svg': 'image/svg+xml',
  '.png': 'image/png',
  '.ico': 'image/x-icon',
  '.json': 'application/json; charset=utf-8',
  '.map': 'application/json; charset=utf-8',
  '.woff2': 'font/woff2',
  '.txt': 'text/plain; charset=utf-8',
};

/**
 * The page talks only to this origin (the API, and its terminal WebSocket);
 * xterm.js writes its theme into a <style> element, hence inline styles.
 * No framing (clickjacking a page that holds a key), no referrer (the
 * address may carry `#key=` for an instant before the page strips it).
 */
const SECURITY_HEADERS = {
  'content-security-policy':
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; " +
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
  'x-content-type-options': 'nosniff',
  'referrer-policy': 'no-referrer',
  'x-frame-options': 'DENY',
} as const;

/**
 * Where the built dashboard is: `packages/ui/dist`, seen from this file in
 * the sources (`packages/apiserver/src/routes/`) or from the CLI bundle that
 * inlines it (`packages/cli/dist/main.js`).
 */
export function defaultUiDirs(): string[] {
  return [
    fileURLToPath(new URL('../../../ui/dist/', import.meta.url)),
    fileURLToPath(new URL('../../ui/dist/', import.meta.url)),
  ];
}

async function isFile(path: string): Promise<boolean> {
  return (await stat(path).catch(() => undefined))?.isFile() ?? false;
}

/**
 * `GET /ui/*`: the dashboard's static files (packages/ui, built by `npm run
 * build`), without a key: they hold no data; the page asks the API for
 * everything with the user's key. Vite names assets by content hash, so
 * `/ui/assets/*` is cached for a year and everything else (index.html) is
 * revalidated on every load.
 */
export function uiRoutes(app: FastifyInstance, options: { dirs?: string[] } = {}): void {
  const dirs = options.dirs ?? defaultUiDirs();
  let found: string | undefined;
  const root = async (): Promise<string> => {
    if (found) return found;
    for (const d of dirs) {
      if (await isFile(join(d, 'index.html'))) return (found = resolve(d));
    }
    throw new DsecError(
      'unavailable',
      'the dashboard is not built: run `npm run build` in the DSec repository',
    );
  };

  app.get('/ui', async (_req, reply) => reply.redirect('/ui/', 301));
  app.get('/ui/*', async (req, reply) => {
    const dir = await root();
    const rel = (req.params as { '*'?: string })['*'] ?? '';
    const file = resolve(dir, rel === '' ? 'index.html' : rel);
    if (file !== dir && !file.startsWith(dir + sep)) throw notFound(rel);
    // Unknown paths under /ui/ are client-side routes only if they have no extension.
    const target = (await isFile(file))
      ? file
      : extname(rel) === ''
        ? join(dir, 'index.html')
        : undefined;
    if (!target) throw notFound(rel);
    return send(reply, target, target.startsWith(join(dir, 'assets') + sep));
  });
}

function notFound(rel: string): DsecError {
  return new DsecError('not_found', `no dashboard file ${rel.slice(0, 200)}`);
}

async function send(reply: FastifyReply, file: string, immutable: boolean): Promise<FastifyReply> {
  const { size } = await stat(file);
  return reply
    .headers(SECURITY_HEADERS)
    .header('content-type', CONTENT_TYPES[extname(file)] ?? 'application/octet-stream')
    .header('content-length', size)
    .header('cache-control', immutable ? 'public, max-age=31536000, immutable' : 'no-cache')
    .send(createReadStream(file));
}
