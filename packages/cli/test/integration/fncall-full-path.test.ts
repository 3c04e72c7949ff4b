import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { chmod, mkdtemp, readdir, rm, rmdir, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import { prepareFnCallImages } from '@dsec/edge';
import { DirImageStore } from '@dsec/images';
import { DSecClient } from '@dsec/sdk';
import type { FnCallMapItem, FnCallPoolStatus } from '@dsec/sdk';
import { main } from '../../src/main.js';

/**
 * FnCall end to end (issue 14): the TypeScript SDK and the CLI → a real
 * apiserver → a real edge's warm pools, on a single node in this process.
 * The runtime images are built once into a store kept between runs (the
 * edge's FnCall tests share it; DSEC_TEST_FNCALL_IMAGES moves it).
 */
const IMAGES_DIR = process.env['DSEC_TEST_FNCALL_IMAGES'] ?? '/var/tmp/dsec-fncall-it';
const SUM = 'print(sum(map(int, input().split())))';

let node: SingleNode;
let client: DSecClient;
let work: string;
let cgroupParent: string;

before(async () => {
  const storeDir = join(IMAGES_DIR, 'images');
  await prepareFnCallImages(new DirImageStore(storeDir), { cacheDir: join(IMAGES_DIR, 'cache') });
  work = await mkdtemp(join(tmpdir(), 'dsec-fncall-path-'));
  await chmod(work, 0o711);
  cgroupParent = `dsec-test-${basename(work)}`;
  node = await startSingleNode({
    stateDir: join(work, 'state'),
    port: 0,
    edgeId: 'fncall-node',
    cgroupParent,
    imageStore: storeDir,
  });
  client = new DSecClient({ url: node.url, apiKey: node.adminKey });
});

after(async () => {
  client?.close();
  await node?.close({ stopSandboxes: true });
  await rm(work, { recursive: true, force: true });
  for (const ctrl of await readdir('/sys/fs/cgroup').catch(() => [])) {
    await rmdir(`/sys/fs/cgroup/${ctrl}/${cgroupParent}`).catch(() => undefined);
  }
});

test('client.fncall.run runs Python through the full path; the edge then reports its pool', async () => {
  const r = await client.fncall.run({ language: 'python', code: SUM, stdin: '20 22\n' });
  assert.equal(r.stdout, '42\n', r.stderr);
  assert.equal(r.exitCode, 0);
  assert.equal(r.outcome, 'ok');
  assert.equal(r.edgeId, 'fncall-node');
  const failing = await client.fncall.run({ language: 'python', code: 'import sys; sys.exit(3)' });
  assert.equal(failing.exitCode, 3);
  // The pool shows in GET /v1/edges from the watcher's next probe (every second on a single node).
  let pools: FnCallPoolStatus[] | undefined;
  for (let i = 0; i < 100 && !pools?.some((p) => p.language === 'python'); i++) {
    if (i > 0) await new Promise((r) => setTimeout(r, 100));
    pools = (await client.listEdges())[0]?.fncall;
  }
  const pool = pools?.find((p) => p.language === 'python' && !p.network);
  assert.ok(pool, JSON.stringify(pools));
  assert.ok(pool.max > 0);
});

test('client.fncall.map answers every call once, right', async () => {
  const calls = Array.from({ length: 40 }, (_, i) => ({
    language: 'python',
    code: SUM,
    stdin: `${i} ${i}\n`,
  }));
  const items: FnCallMapItem[] = [];
  for await (const item of client.fncall.map(calls, { concurrency: 8 })) items.push(item);
  assert.deepEqual(
    items.map((i) => i.index).sort((a, b) => a - b),
    calls.map((_, i) => i),
  );
  for (const item of items) {
    assert.equal(item.error, undefined, item.error?.message);
    assert.equal(item.result?.stdout, `${2 * item.index}\n`);
  }
});

test('dsec fncall run prints the output and exits with the exit code; node and bash run too', async () => {
  const program = join(work, 'prog.py');
  await writeFile(program, 'import sys\nprint(input().upper())\nsys.exit(4)\n');
  const out = { code: -1, stdout: '', stderr: '' };
  out.code = await main(
    ['fncall', 'run', '--language', 'python', '--stdin', 'abc', '--', program],
    {
      stdout: { write: (s: string) => (out.stdout += s) },
      stderr: { write: (s: string) => (out.stderr += s) },
      env: { DSEC_URL: node.url, DSEC_API_KEY: node.adminKey },
    },
  );
  assert.equal(out.stdout, 'ABC\n', out.stderr);
  assert.equal(out.code, 4);
  const js = await client.fncall.run({
    language: 'node',
    code: 'console.log(process.argv.slice(2).join("+"))',
    args: ['a', 'b'],
  });
  assert.equal(js.stdout, 'a+b\n', js.stderr);
  const sh = await client.fncall.run({
    language: 'bash',
    code: 'read x; echo "$((x * 2))"',
    stdin: '21\n',
  });
  assert.equal(sh.stdout, '42\n', sh.stderr);
});
