import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdir, mkdtemp, rm, symlink, unlink, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { isDsecError } from '@dsec/core';
import type { Sandbox } from '@dsec/sdk';
import { loadHarborTask, MAX_TIMEOUT_SEC } from './task.js';
import { listUpload, parseRewardJson, parseRewardText, uploadDir } from './verifier.js';

// Issue 25's review of Harbor task directories: a hostile task author.

async function taskDir(): Promise<{ root: string; dir: string; secret: string }> {
  const root = await mkdtemp(join(tmpdir(), 'harbor-review-'));
  const dir = join(root, 'a-task');
  await mkdir(join(dir, 'environment'), { recursive: true });
  await mkdir(join(dir, 'tests'), { recursive: true });
  await writeFile(join(dir, 'task.toml'), '');
  await writeFile(join(dir, 'instruction.md'), 'do it\n');
  await writeFile(join(dir, 'environment', 'Dockerfile'), 'FROM debian:bookworm\n');
  await writeFile(join(dir, 'tests', 'test.sh'), 'true\n');
  // A host directory the task author wants in the sandbox.
  const secret = join(root, 'host-home');
  await mkdir(secret);
  await writeFile(join(secret, 'solve.sh'), 'cat id_rsa\n');
  await writeFile(join(secret, 'id_rsa'), 'HOST SECRET\n');
  await writeFile(join(secret, 'Dockerfile'), 'FROM scratch\nWORKDIR /host\n');
  return { root, dir, secret };
}

function refused(field: string) {
  return (err: unknown) => {
    assert.ok(isDsecError(err, 'invalid_argument'), String(err));
    assert.equal(err.field, field);
    return true;
  };
}

test('solution/, environment/ or tests/ as a symlink to a host directory is refused, not read', async () => {
  const { root, dir, secret } = await taskDir();
  try {
    await symlink(secret, join(dir, 'solution'));
    await assert.rejects(loadHarborTask(dir), refused('solution'));
    await unlink(join(dir, 'solution'));

    await rm(join(dir, 'environment'), { recursive: true });
    await symlink(secret, join(dir, 'environment'));
    await assert.rejects(loadHarborTask(dir), refused('environment'));
    await unlink(join(dir, 'environment'));
    await mkdir(join(dir, 'environment'));
    await writeFile(join(dir, 'environment', 'Dockerfile'), 'FROM debian:bookworm\n');

    await rm(join(dir, 'tests'), { recursive: true });
    await mkdir(join(secret, 'more'));
    await symlink(secret, join(dir, 'tests'));
    await writeFile(join(secret, 'test.sh'), 'true\n');
    await assert.rejects(loadHarborTask(dir), refused('tests'));
    await unlink(join(dir, 'tests'));
    await mkdir(join(dir, 'tests'));
    await writeFile(join(dir, 'tests', 'test.sh'), 'true\n');

    // solve.sh itself a symlink: no solution (oracle then says so), nothing read through it.
    await mkdir(join(dir, 'solution'));
    await symlink(join(secret, 'solve.sh'), join(dir, 'solution', 'solve.sh'));
    assert.equal((await loadHarborTask(dir)).solutionDir, undefined);
  } finally {
    await rm(root, { recursive: true, force: true });
  }
});

test('a timeout past a day is refused: Node would fire the agent limit at once', async () => {
  const { root, dir } = await taskDir();
  try {
    for (const [section, key] of [
      ['agent', 'timeout_sec'],
      ['verifier', 'timeout_sec'],
      ['environment', 'build_timeout_sec'],
    ] as const) {
      await writeFile(join(dir, 'task.toml'), `[${section}]\n${key} = 1e12\n`);
      await assert.rejects(loadHarborTask(dir), refused(`task.toml.${section}.${key}`));
      await writeFile(join(dir, 'task.toml'), `[${section}]\n${key} = ${MAX_TIMEOUT_SEC}\n`);
      await loadHarborTask(dir);
    }
  } finally {
    await rm(root, { recursive: true, force: true });
  }
});

function recordingSandbox(): { sandbox: Sandbox; written: Map<string, Buffer> } {
  const written = new Map<string, Buffer>();
  const files = {
    remove: async () => undefined,
    mkdir: async () => undefined,
    write: async (path: string, data: Buffer) => {
      written.set(path, Buffer.from(data));
    },
  };
  return { sandbox: { files } as unknown as Sandbox, written };
}

test('a file swapped for a symlink (or grown) after the listing uploads nothing of the host', async () => {
  const { root, dir, secret } = await taskDir();
  try {
    await writeFile(join(dir, 'tests', 'data.txt'), 'ok\n');
    const listed = await listUpload(join(dir, 'tests'), 'tests');
    const { sandbox, written } = recordingSandbox();
    await uploadDir(sandbox, listed, '/tests');
    assert.equal(written.get('/tests/data.txt')?.toString(), 'ok\n');

    // The listing said regular file; by the upload it names a host file.
    await unlink(join(dir, 'tests', 'data.txt'));
    await symlink(join(secret, 'id_rsa'), join(dir, 'tests', 'data.txt'));
    const after = recordingSandbox();
    await assert.rejects(uploadDir(after.sandbox, listed, '/tests'), (err: unknown) => {
      assert.ok(isDsecError(err, 'invalid_argument'));
      assert.equal(err.field, 'tests');
      assert.equal(err.details?.['reason'], 'changed_during_upload');
      return true;
    });
    for (const b of after.written.values()) assert.doesNotMatch(b.toString(), /HOST SECRET/);

    // Grown past what the bounds counted.
    await unlink(join(dir, 'tests', 'data.txt'));
    await writeFile(join(dir, 'tests', 'data.txt'), 'ok\n');
    const again = await listUpload(join(dir, 'tests'), 'tests');
    await writeFile(join(dir, 'tests', 'data.txt'), 'x'.repeat(1 << 20));
    await assert.rejects(uploadDir(recordingSandbox().sandbox, again, '/tests'), /changed/);
  } finally {
    await rm(root, { recursive: true, force: true });
  }
});

test('reward.json: prototype keys, NaN, nesting and huge exponents give no reward', () => {
  assert.equal(parseRewardJson('{"__proto__": {"reward": 1}}'), undefined);
  assert.equal(parseRewardJson('{"__proto__": 1}'), undefined);
  assert.equal(parseRewardJson('{"reward": NaN}'), undefined);
  assert.equal(parseRewardJson('{"reward": 1e999}'), undefined);
  assert.equal(parseRewardJson('{"reward": {"value": 1}}'), undefined);
  assert.equal(parseRewardJson('[1]'), undefined);
  assert.equal(parseRewardText('1e999'), undefined);
  assert.equal(parseRewardText('0x1'), undefined);
});
