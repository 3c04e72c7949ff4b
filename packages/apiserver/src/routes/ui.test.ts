import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import Fastify from 'fastify';
import type { FastifyInstance } from 'fastify';
import { toHttpError } from '../errors.js';
import { defaultUiDirs, uiRoutes } from './ui.js';

/* The dashboard's static files: types, caching, SPA fallback, no escape from the directory. */

let dir: string;
let app: FastifyInstance;
let missing: FastifyInstance;

function build(dirs: string[]): FastifyInstance {
  const a = Fastify();
  a.setErrorHandler((err, req, reply) => {
    const e = toHttpError(err, req.id);
    return reply.code(e.status).send(e.toJSON());
  });
  uiRoutes(a, { dirs });
  return a;
}

before(async () => {
  dir = await mkdtemp(join(tmpdir(), 'dsec-ui-test-'));
  await mkdir(join(dir, 'assets'));
  await writeFile(join(dir, 'index.html'), '<!doctype html><title>DSec</title>');
  await writeFile(join(dir, 'assets', 'index-abc123.js'), 'console.log(1)');
  await writeFile(join(dir, 'assets', 'index-abc123.css'), 'body{}');
  await writeFile(join(tmpdir(), 'dsec-ui-outside.txt'), 'secret');
  app = build([join(dir, 'nope'), dir]);
  missing = build([join(dir, 'nope')]);
});
after(async () => {
  await rm(dir, { recursive: true, force: true });
  await rm(join(tmpdir(), 'dsec-ui-outside.txt'), { force: true });
});

test('/ui redirects to /ui/, which serves index.html revalidated on each load', async () => {
  const r = await app.inject('/ui');
  assert.equal(r.statusCode, 301);
  assert.equal(r.headers.location, '/ui/');
  const page = await app.inject('/ui/');
  assert.equal(page.statusCode, 200);
  assert.equal(page.headers['content-type'], 'text/html; charset=utf-8');
  assert.equal(page.headers['cache-control'], 'no-cache');
  assert.match(String(page.headers['content-security-policy']), /script-src 'self'/);
  assert.equal(page.headers['referrer-policy'], 'no-referrer');
  assert.match(page.body, /<title>DSec/);
});

test('hashed assets carry their type and are cached as immutable', async () => {
  const js = await app.inject('/ui/assets/index-abc123.js');
  assert.equal(js.statusCode, 200);
  assert.equal(js.headers['content-type'], 'text/javascript; charset=utf-8');
  assert.equal(js.headers['cache-control'], 'public, max-age=31536000, immutable');
  assert.equal(js.body, 'console.log(1)');
  const css = await app.inject('/ui/assets/index-abc123.css');
  assert.equal(css.headers['content-type'], 'text/css; charset=utf-8');
});

test('extensionless paths fall back to the page; missing files and escapes are 404', async () => {
  const route = await app.inject('/ui/sandboxes/sb-1');
  assert.equal(route.statusCode, 200);
  assert.match(route.body, /<title>DSec/);
  assert.equal((await app.inject('/ui/assets/gone.js')).statusCode, 404);
  for (const url of [
    '/ui/../dsec-ui-outside.txt',
    '/ui/%2e%2e/dsec-ui-outside.txt',
    '/ui/..%2fdsec-ui-outside.txt',
  ]) {
    const r = await app.inject(url);
    assert.equal(r.statusCode, 404, url);
    assert.notEqual(r.body, 'secret', url);
  }
});

test('an unbuilt dashboard answers 503 unavailable', async () => {
  const r = await missing.inject('/ui/');
  assert.equal(r.statusCode, 503);
  assert.equal(r.json<{ error: { code: string } }>().error.code, 'unavailable');
});

test('the default places are packages/ui/dist seen from the sources and from the CLI bundle', () => {
  const [fromSource] = defaultUiDirs();
  assert.match(fromSource ?? '', /\/packages\/ui\/dist\/$/);
});
