import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { chmod, mkdtemp, readdir, rm, rmdir } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { isDsecError } from '@dsec/core';
import { openContainerEdge, prepareFnCallImages } from '@dsec/edge';
import type { Edge } from '@dsec/edge';
import { DirImageStore } from '@dsec/images';
import { newEdgeSecret, RemoteEdge, serveEdge } from '@dsec/edge-http';
import type { EdgeServer } from '@dsec/edge-http';

/**
 * FnCall over the edge protocol (`POST /edge/v1/fncall`) against a real
 * edge's warm pools. The runtime images are built once into a store kept
 * between runs (shared with the edge's FnCall tests; DSEC_TEST_FNCALL_IMAGES
 * moves it).
 */
const IMAGES_DIR = process.env['DSEC_TEST_FNCALL_IMAGES'] ?? '/var/tmp/dsec-fncall-it';

let dir: string;
let cgroupParent: string;
let edge: Edge;
let server: EdgeServer;
let remote: RemoteEdge;

before(async () => {
  const store = new DirImageStore(join(IMAGES_DIR, 'images'));
  await prepareFnCallImages(store, { cacheDir: join(IMAGES_DIR, 'cache') });
  dir = await mkdtemp(join(tmpdir(), 'dsec-edge-http-fncall-'));
  await chmod(dir, 0o711);
  cgroupParent = `dsec-test-${basename(dir)}`;
  edge = await openContainerEdge({
    edgeId: 'fncall-remote',
    stateDir: join(dir, 'edge'),
    store,
    cgroupParent,
  });
  const secret = newEdgeSecret();
  server = await serveEdge({ edge, secret });
  remote = new RemoteEdge({ edgeId: edge.edgeId, url: server.url, secret });
});

after(async () => {
  remote?.close();
  await server?.close();
  await edge?.close();
  await rm(dir, { recursive: true, force: true });
  for (const ctrl of await readdir('/sys/fs/cgroup').catch(() => [])) {
    await rmdir(`/sys/fs/cgroup/${ctrl}/${cgroupParent}`).catch(() => undefined);
  }
});

test('a call crosses the wire to a warm pool and back; the status reports the pool', async () => {
  const r = await remote.fncall(
    {
      language: 'python',
      code: 'import sys; print(sys.stdin.read().strip()[::-1], *sys.argv[1:])',
      stdin: 'olleh\n',
      args: ['x'],
    },
    { projectId: 'prj-t' },
  );
  assert.equal(r.stdout, 'hello x\n', r.stderr);
  assert.equal(r.exitCode, 0);
  assert.equal(r.outcome, 'ok');
  const pools = (await remote.status()).fncall ?? [];
  assert.ok(
    pools.some((p) => p.language === 'python' && !p.network),
    JSON.stringify(pools),
  );
});

test('limits and platform errors come back as on the edge itself', async () => {
  const slow = await remote.fncall(
    { language: 'python', code: 'while True: pass', timeoutMs: 300 },
    { projectId: 'prj-t' },
  );
  assert.equal(slow.outcome, 'timeout');
  await assert.rejects(
    remote.fncall({ language: 'no-such-runtime', code: '' }, { projectId: 'prj-t' }),
    (e) => isDsecError(e) && e.code !== 'internal',
  );
});
