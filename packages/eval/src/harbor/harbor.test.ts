import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdir, mkdtemp, rm, symlink, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { isDsecError } from '@dsec/core';
import { dockerfileWorkdir, loadHarborTasks, sizeToMb } from './task.js';
import { listUpload, parseRewardJson, parseRewardText } from './verifier.js';

const SHIPPED = resolve(
  fileURLToPath(new URL('../../../../examples/harbor-tasks', import.meta.url)),
);

test('the shipped tasks load with their task.toml limits', async () => {
  const tasks = await loadHarborTasks(SHIPPED);
  assert.deepEqual(
    tasks.map((t) => t.name),
    ['log-top-ips', 'make-c-tool', 'python-fix-median', 'serve-status-page'],
  );
  const log = tasks[0]!;
  assert.equal(log.agentTimeoutSec, 300);
  assert.equal(log.verifierTimeoutSec, 60);
  assert.equal(log.memoryMb, 512);
  assert.equal(log.workdir, '/app');
  assert.ok(log.solutionDir);
  assert.match(log.instruction, /top_ips\.txt/);
  // One task directory on its own is a batch of one.
  assert.equal((await loadHarborTasks(join(SHIPPED, 'make-c-tool')))[0]!.name, 'make-c-tool');
});

async function taskDir(toml: string): Promise<string> {
  const root = await mkdtemp(join(tmpdir(), 'harbor-unit-'));
  const dir = join(root, 'a-task');
  await mkdir(join(dir, 'environment'), { recursive: true });
  await mkdir(join(dir, 'tests'), { recursive: true });
  await writeFile(join(dir, 'task.toml'), toml);
  await writeFile(join(dir, 'instruction.md'), 'do it\n');
  await writeFile(join(dir, 'environment', 'Dockerfile'), 'FROM debian:bookworm\n');
  await writeFile(join(dir, 'tests', 'test.sh'), 'true\n');
  return dir;
}

test("Harbor's defaults, deprecated sizes, unknown keys kept, bad types refused naming the field", async () => {
  const dir = await taskDir(
    '[environment]\nmemory = "1G"\nstorage = "512M"\nfuture_key = 3\n[somewhere_new]\nx = 1\n',
  );
  try {
    const [t] = await loadHarborTasks(dir);
    assert.equal(t!.verifierTimeoutSec, 600);
    assert.equal(t!.agentTimeoutSec, 3600);
    assert.equal(t!.memoryMb, 1024);
    assert.equal(t!.storageMb, 512);
    assert.equal(t!.solutionDir, undefined);
    await writeFile(join(dir, 'task.toml'), '[verifier]\ntimeout_sec = "soon"\n');
    await assert.rejects(loadHarborTasks(dir), (err: unknown) => {
      assert.ok(isDsecError(err, 'invalid_argument'));
      assert.equal(err.field, 'task.toml.verifier.timeout_sec');
      return true;
    });
    await writeFile(join(dir, 'task.toml'), '[verifier\n');
    await assert.rejects(loadHarborTasks(dir), (err: unknown) =>
      isDsecError(err, 'invalid_argument'),
    );
    await writeFile(join(dir, 'task.toml'), '');
    await rm(join(dir, 'tests', 'test.sh'));
    await assert.rejects(loadHarborTasks(dir), /test\.sh is missing/);
  } finally {
    await rm(join(dir, '..'), { recursive: true, force: true });
  }
});

test('uploads take regular files only: a symlink in tests/ is refused', async () => {
  const dir = await taskDir('');
  try {
    await mkdir(join(dir, 'tests', 'sub'));
    await writeFile(join(dir, 'tests', 'sub', 'data'), 'x');
    const files = await listUpload(join(dir, 'tests'), 'tests');
    assert.deepEqual(
      files.map((f) => f.rel),
      ['sub/data', 'test.sh'],
    );
    await symlink('/etc/shadow', join(dir, 'tests', 'leak'));
    await assert.rejects(listUpload(join(dir, 'tests'), 'tests'), /only regular files/);
  } finally {
    await rm(join(dir, '..'), { recursive: true, force: true });
  }
});

test('rewards: one number in reward.txt, a flat object of numbers in reward.json', () => {
  assert.equal(parseRewardText('1\n'), 1);
  assert.equal(parseRewardText(' 0.25 '), 0.25);
  assert.equal(parseRewardText('1e0'), 1);
  for (const bad of ['', 'yes', '1 1', 'NaN', 'Infinity', '0x1', '1;', '\u0661']) {
    assert.equal(parseRewardText(bad), undefined, bad);
  }
  assert.deepEqual(parseRewardJson('{"reward": 1, "passed": true}'), {
    reward: 1,
    metrics: { reward: 1, passed: 1 },
  });
  assert.deepEqual(parseRewardJson('{"accuracy": 0.5}'), {
    reward: 0.5,
    metrics: { accuracy: 0.5 },
  });
  for (const bad of [
    '[1]',
    '1',
    '{"a": 1, "b": 2}',
    '{"reward": "1"}',
    '{"reward": [1]}',
    'nope',
  ]) {
    assert.equal(parseRewardJson(bad), undefined, bad);
  }
});

test('sizes and WORKDIR', () => {
  assert.equal(sizeToMb('2G', 'f'), 2048);
  assert.equal(sizeToMb('512m', 'f'), 512);
  assert.throws(() => sizeToMb('lots', 'f'), /must look like/);
  assert.equal(dockerfileWorkdir('FROM a\nWORKDIR /app\nWORKDIR src\n'), '/app/src');
  assert.equal(dockerfileWorkdir('FROM a AS b\nWORKDIR /x\nFROM c\n'), '/');
  assert.equal(dockerfileWorkdir('FROM a\nWORKDIR "/srv"\nWORKDIR $HOME\n'), '/srv');
});
