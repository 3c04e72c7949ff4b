import { test } from 'node:test';
import assert from 'node:assert/strict';
import { createCipheriv, createHash } from 'node:crypto';
import { chmod, mkdir, mkdtemp, readdir, readFile, rm, rmdir, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import { mountPoints } from '@dsec/edge';
import { makeBusyboxRootfs } from '@dsec/images';
import { startS3Server } from '@dsec/images/testing/s3';
import { DSecClient } from '@dsec/sdk';

// s3rver wants this access key; never let the SDK look for credentials off the machine.
process.env.AWS_ACCESS_KEY_ID = 'S3RVER';
process.env.AWS_SECRET_ACCESS_KEY = 'S3RVER';
process.env.AWS_EC2_METADATA_DISABLED = 'true';

const MiB = 2 ** 20;

/** Incompressible, deterministic bytes. */
function randomBytesSeeded(bytes: number, seed: number): Buffer {
  const key = Buffer.alloc(32);
  key.writeUInt32LE(seed, 0);
  return createCipheriv('aes-256-ctr', key, Buffer.alloc(16)).update(Buffer.alloc(bytes));
}

interface BlobdStats {
  bytesFetched: number;
  verifiedChunks: number;
  corruptChunks: number;
  fetches: number;
  evictions: number;
}

async function blobdStats(stateDir: string): Promise<BlobdStats> {
  const text = await readFile(join(stateDir, 'edge', 'blobs', '.stats'), 'utf8');
  return (JSON.parse(text) as { cache: BlobdStats }).cache;
}

async function mountsUnder(dir: string): Promise<string[]> {
  return [...(await mountPoints())].filter((p) => p.startsWith(dir));
}

function blobdProcesses(stateDir: string): Promise<number[]> {
  return readdir('/proc').then(async (entries) => {
    const pids: number[] = [];
    for (const e of entries) {
      if (!/^\d+$/.test(e)) continue;
      const cmd = await readFile(`/proc/${e}/cmdline`, 'utf8').catch(() => '');
      if (cmd.includes('blobd') && cmd.includes(stateDir)) pids.push(Number(e));
    }
    return pids;
  });
}

test('a node whose image store is S3: layers load on demand through the blob daemon, across an edge restart, and nothing is left after', async () => {
  const s3 = await startS3Server();
  const dir = await mkdtemp(join(tmpdir(), 'dsec-s3-node-'));
  await chmod(dir, 0o711);
  const stateDir = join(dir, 'state');
  const options = {
    stateDir,
    port: 0,
    network: { mode: 'none' as const },
    cgroupParent: `dsec-test-${basename(dir)}`,
    imageStore: s3.location('node/'),
    blobCacheBytes: 8 * MiB,
  };
  let node: SingleNode = await startSingleNode(options);
  try {
    await makeBusyboxRootfs(join(dir, 'rootfs'));
    await node.buildLayer({ name: 'busybox', kind: 'base', from: { dir: join(dir, 'rootfs') } });
    // A split toolkit of 12 incompressible 2 MiB files: 24 MiB of data blob.
    const tk = join(dir, 'toolkit');
    await mkdir(join(tk, 'data'), { recursive: true });
    const files = Array.from({ length: 12 }, (_, i) => randomBytesSeeded(2 * MiB, i + 1));
    for (const [i, content] of files.entries())
      await writeFile(join(tk, 'data', `f${i}.bin`), content);
    await writeFile(join(tk, 'data', 'hello.txt'), 'hello from s3\n');
    const layer = await node.buildLayer({
      name: 'models',
      kind: 'toolkit',
      from: { dir: tk },
      split: true,
    });
    assert.ok(layer.blobDigest, 'the toolkit is split');
    assert.equal((await node.store.listLayers()).length, 2);

    const client = new DSecClient({ url: node.url, apiKey: node.adminKey });
    await client.open();
    const sb = await client.runContainer({ image: 'busybox', toolkits: ['models'] });
    const hello = await sb.runShell('cat /data/hello.txt');
    assert.equal(hello.stdout, 'hello from s3\n');
    const sum = await sb.runShell('md5sum /data/f3.bin');
    assert.equal(sum.stdout.split(' ')[0], createHash('md5').update(files[3]!).digest('hex'));
    const afterOne = await blobdStats(stateDir);
    assert.ok(afterOne.bytesFetched > 0, 'data came from the store');
    assert.equal(
      afterOne.verifiedChunks,
      afterOne.fetches,
      'every chunk checked against the table',
    );
    assert.equal(afterOne.corruptChunks, 0);
    assert.ok(
      afterOne.bytesFetched < 12 * MiB,
      `reading 1 of 12 files fetched ${afterOne.bytesFetched} bytes, not the whole blob`,
    );
    client.close();

    // The edge restarts; the sandbox and the daemon keep running, and the
    // sandbox reads files it never touched before.
    await node.close();
    node = await startSingleNode(options);
    const client2 = new DSecClient({ url: node.url, apiKey: node.adminKey });
    await client2.open();
    const again = client2.sandbox(sb.id);
    for (const i of [7, 11]) {
      const r = await again.runShell(`md5sum /data/f${i}.bin`);
      assert.equal(r.exitCode, 0, r.stderr);
      assert.equal(r.stdout.split(' ')[0], createHash('md5').update(files[i]!).digest('hex'));
    }
    // Reading the whole toolkit through an 8 MiB chunk cache evicts and stays correct.
    const all = await again.runShell('cat /data/*.bin | md5sum');
    const inGlobOrder = files
      .map((content, i) => ({ name: `f${i}.bin`, content }))
      .sort((a, b) => (a.name < b.name ? -1 : 1));
    const whole = createHash('md5');
    for (const f of inGlobOrder) whole.update(f.content);
    assert.equal(all.stdout.split(' ')[0], whole.digest('hex'));
    assert.ok((await blobdStats(stateDir)).evictions > 0, 'the chunk cache stayed in its budget');
    client2.close();
  } finally {
    await node.close({ stopSandboxes: true });
    assert.deepEqual(await mountsUnder(stateDir), [], 'no layer or blob mount is left');
    assert.deepEqual(await blobdProcesses(stateDir), [], 'the blob daemon is gone');
    await s3.close();
    await rm(dir, { recursive: true, force: true });
    for (const ctrl of await readdir('/sys/fs/cgroup'))
      await rmdir(`/sys/fs/cgroup/${ctrl}/${options.cgroupParent}`).catch(() => undefined);
  }
});
