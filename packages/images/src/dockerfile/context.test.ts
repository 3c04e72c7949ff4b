import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import {
  mkdir,
  mkdtemp,
  readFile,
  readlink,
  rm,
  symlink,
  truncate,
  writeFile,
} from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, test } from 'node:test';
import { isDsecError } from '@dsec/core';
import { stageContext } from './context.js';

const dirs: string[] = [];
after(async () => {
  for (const d of dirs) await rm(d, { recursive: true, force: true });
});
async function fresh(): Promise<string> {
  const d = await mkdtemp(join(tmpdir(), 'dsec-ctx-'));
  dirs.push(d);
  await mkdir(join(d, 'src'));
  return d;
}

void test('copies files and directories, keeps links as links, and names the content by digest', async () => {
  const d = await fresh();
  await mkdir(join(d, 'src/a/b'), { recursive: true });
  await writeFile(join(d, 'src/a/b/f'), 'hello');
  await writeFile(join(d, 'outside'), 'host secret');
  await symlink('/etc/passwd', join(d, 'src/abs'));
  await symlink('../../outside', join(d, 'src/a/rel'));
  const first = await stageContext(join(d, 'src'), join(d, 'out1'));
  assert.equal(await readFile(join(d, 'out1/a/b/f'), 'utf8'), 'hello');
  assert.equal(await readlink(join(d, 'out1/abs')), '/etc/passwd');
  assert.equal(await readlink(join(d, 'out1/a/rel')), '../../outside');
  assert.equal(first.bytes, 5);
  const again = await stageContext(join(d, 'src'), join(d, 'out2'));
  assert.equal(again.digest, first.digest);
  await writeFile(join(d, 'src/a/b/f'), 'hellO');
  assert.notEqual((await stageContext(join(d, 'src'), join(d, 'out3'))).digest, first.digest);
});

void test('refuses special files and contexts past their bounds before copying', async () => {
  const d = await fresh();
  spawnSync('mkfifo', [join(d, 'src/pipe')]);
  await assert.rejects(
    stageContext(join(d, 'src'), join(d, 'o1')),
    (e: unknown) => isDsecError(e, 'invalid_argument') && e.details?.['reason'] === 'special_file',
  );
  const s = await fresh();
  await writeFile(join(s, 'src/huge'), '');
  await truncate(join(s, 'src/huge'), 2 ** 40);
  await assert.rejects(
    stageContext(join(s, 'src'), join(s, 'o'), { maxContextBytes: 2 ** 20 }),
    (e: unknown) =>
      isDsecError(e, 'invalid_argument') && e.details?.['reason'] === 'context_too_large',
  );
  const m = await fresh();
  for (let i = 0; i < 20; i++) await writeFile(join(m, `src/f${i}`), '');
  await assert.rejects(
    stageContext(join(m, 'src'), join(m, 'o'), { maxContextEntries: 10 }),
    (e: unknown) =>
      isDsecError(e, 'invalid_argument') && e.details?.['reason'] === 'context_too_large',
  );
  await assert.rejects(stageContext(join(m, 'src/f1'), join(m, 'o2')), (e: unknown) =>
    isDsecError(e, 'invalid_argument'),
  );
});
