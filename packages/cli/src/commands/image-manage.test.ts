import assert from 'node:assert/strict';
import { mkdir, mkdtemp, readdir, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { DirImageStore } from '@dsec/images';
import { startS3Server, type S3TestServer } from '@dsec/images/testing/s3';
import { main } from '../main.js';

// The test server wants this key; setting it keeps the SDK from looking elsewhere.
process.env.AWS_ACCESS_KEY_ID = 'S3RVER';
process.env.AWS_SECRET_ACCESS_KEY = 'S3RVER';
process.env.AWS_EC2_METADATA_DISABLED = 'true';

let s3: S3TestServer;
let scratch: string;

before(async () => {
  s3 = await startS3Server();
  scratch = await mkdtemp(join(tmpdir(), 'dsec-cli-image-'));
});
after(async () => {
  await s3.close();
  await rm(scratch, { recursive: true, force: true });
});

async function dsec(
  stateDir: string,
  args: string[],
): Promise<{ code: number; out: string; err: string }> {
  let out = '';
  let err = '';
  const code = await main(args, {
    stdout: { write: (s: string) => (out += s) },
    stderr: { write: (s: string) => (err += s) },
    // No cluster is needed: push and pull work on the local store.
    env: { DSEC_URL: 'http://127.0.0.1:1', DSEC_API_KEY: 'unused', DSEC_STATE_DIR: stateDir },
  });
  return { code, out, err };
}

/** A state dir whose local store holds `demo:v1` (a made-up blob: nothing mounts it). */
async function stateWithLayer(content: string): Promise<{ stateDir: string; digest: string }> {
  const stateDir = await mkdtemp(join(scratch, 'state-'));
  const store = new DirImageStore(join(stateDir, 'images'));
  const src = join(stateDir, 'blob');
  await writeFile(src, content);
  const { digest, sizeBytes } = await store.putBlob(src);
  await store.putLayer({
    name: 'demo',
    version: 'v1',
    kind: 'base',
    digest,
    sizeBytes,
    contentBytes: sizeBytes,
    fileCount: 1,
    createdAt: new Date(0).toISOString(),
    source: 'dir',
  });
  return { stateDir, digest };
}

void describe('dsec image push/pull', () => {
  void test('push to s3:// and pull back into another node', async () => {
    const { stateDir, digest } = await stateWithLayer('layer bytes');
    const location = s3.location('cli/');
    const push = await dsec(stateDir, ['image', 'push', 'demo:v1', '--to', location, '--json']);
    assert.equal(push.code, 0, push.err);
    const pushed = JSON.parse(push.out) as { digest: string; bytesCopied: number }[];
    assert.equal(pushed[0]?.digest, digest);
    assert.equal(pushed[0]?.bytesCopied, 'layer bytes'.length);

    const other = await mkdtemp(join(scratch, 'state-'));
    const pull = await dsec(other, ['image', 'pull', 'demo:v1', '--from', location]);
    assert.equal(pull.code, 0, pull.err);
    assert.match(pull.out, /pulled demo:v1/);
    const local = new DirImageStore(join(other, 'images'));
    assert.equal((await local.getLayer('demo:v1')).digest, digest);
    assert.equal(await readFile(await local.blobPath(digest), 'utf8'), 'layer bytes');
    assert.deepEqual(await readdir(join(other, 'tmp')), [], 'the download cache is gone');
  });

  void test('--image-store makes an S3 bucket the node store: build into it, list it', async () => {
    const stateDir = await mkdtemp(join(scratch, 'state-'));
    const src = join(stateDir, 'src');
    await mkdir(src);
    await writeFile(join(src, 'hello'), 'hi\n');
    const store = ['--image-store', s3.location('node-store/')];
    const build = await dsec(stateDir, [
      ...store,
      'image',
      'build',
      'tk:v1',
      '--from-dir',
      src,
      '--kind',
      'toolkit',
      '--split',
      '--json',
    ]);
    assert.equal(build.code, 0, build.err);
    const ls = await dsec(stateDir, [...store, 'image', 'ls', '--json']);
    assert.equal(ls.code, 0, ls.err);
    const layers = JSON.parse(ls.out) as { name: string; kind: string; blobDigest?: string }[];
    assert.deepEqual(
      layers.map((l) => [l.name, l.kind, typeof l.blobDigest]),
      [['tk', 'toolkit', 'string']],
    );
    const plain = await dsec(stateDir, ['image', 'ls', '--json']);
    assert.deepEqual(JSON.parse(plain.out), [], 'without the option: the local store, still empty');
  });

  void test('push to a directory path still works', async () => {
    const { stateDir, digest } = await stateWithLayer('dir bytes');
    const target = join(scratch, 'shared-dir');
    const push = await dsec(stateDir, ['image', 'push', 'demo:v1', '--to', target]);
    assert.equal(push.code, 0, push.err);
    assert.equal((await new DirImageStore(target).getLayer('demo:v1')).digest, digest);
  });

  void test('a malformed s3 URL is invalid_argument naming the option', async () => {
    const { stateDir } = await stateWithLayer('x');
    const r = await dsec(stateDir, ['image', 'push', 'demo:v1', '--to', 's3://key:secret@bucket/']);
    assert.equal(r.code, 1);
    assert.match(r.err, /invalid_argument/);
    assert.match(r.err, /--to/);
    assert.doesNotMatch(r.err, /secret@/);
  });
});

void describe('dsec image and owners (issue 24 point 2)', () => {
  void test('ls shows each layer’s owner; inspect and rm take PROJECT/NAME or --project', async () => {
    const { stateDir } = await stateWithLayer('platform bytes');
    const store = new DirImageStore(join(stateDir, 'images'));
    const src = join(stateDir, 'blob2');
    await writeFile(src, 'project bytes');
    const { digest, sizeBytes } = await store.putBlob(src);
    await store.putLayer({
      name: 'demo',
      version: 'v1',
      kind: 'snapshot',
      digest,
      sizeBytes,
      contentBytes: sizeBytes,
      fileCount: 1,
      createdAt: new Date(0).toISOString(),
      source: 'snapshot',
      project: 'prj-a',
      parents: ['demo:v1'],
      parentDigests: [digest],
    });
    const ls = await dsec(stateDir, ['image', 'ls']);
    assert.equal(ls.code, 0, ls.err);
    assert.match(ls.out, /OWNER\n/);
    assert.match(ls.out, /^demo:v1\s+base\s.*\splatform$/m);
    assert.match(ls.out, /^demo:v1\s+snapshot\s.*\sprj-a$/m);
    const only = await dsec(stateDir, ['--json', 'image', 'ls', '--project', 'prj-b']);
    assert.deepEqual(
      (JSON.parse(only.out) as { project?: string }[]).map((l) => l.project),
      [undefined],
    );

    const inspect = await dsec(stateDir, ['image', 'inspect', 'prj-a/demo:v1']);
    assert.equal(inspect.code, 0, inspect.err);
    assert.match(inspect.out, /^kind\s+snapshot$/m);
    assert.match(inspect.out, /^owner\s+prj-a$/m);
    const same = await dsec(stateDir, [
      '--json',
      'image',
      'inspect',
      'demo:v1',
      '--project',
      'prj-a',
    ]);
    assert.equal((JSON.parse(same.out) as { digest: string }).digest, digest);
    const mismatch = await dsec(stateDir, ['image', 'rm', 'prj-a/demo:v1', '--project', 'prj-b']);
    assert.equal(mismatch.code, 1);
    assert.match(mismatch.err, /invalid_argument/);

    // No server answers here: the project's layer goes from the store, with a warning.
    const removed = await dsec(stateDir, ['image', 'rm', 'prj-a/demo:v1']);
    assert.equal(removed.code, 0, removed.err);
    assert.match(removed.err, /still count against the project's imageBytes quota/);
    assert.deepEqual(
      (await store.listLayers()).map((l) => [l.kind, l.project]),
      [['base', undefined]],
      'the platform’s demo:v1 stays',
    );
  });
});
