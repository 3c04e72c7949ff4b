import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Command } from 'commander';
import { isDsecError } from '@dsec/core';
import { taskImagesOf } from './commands/eval-images.js';
import { CliContext } from './context.js';
import { cliRegistrySettings } from './registries.js';

const ctxWith = (env: Record<string, string | undefined>): CliContext =>
  new CliContext(
    { stdout: { write: () => true }, stderr: { write: () => true }, env },
    new Command(),
  );

test('cliRegistrySettings: --config, else DSEC_CONFIG, plus the environment', async () => {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-cli-registries-'));
  try {
    const file = join(dir, 'dsec.json');
    await writeFile(
      file,
      JSON.stringify({
        registries: {
          insecure: ['reg.lab:5000'],
          mirrors: { 'docker.io': ['m.lab'] },
          authFile: 'auth.json',
        },
      }),
    );
    const env = { DSEC_INSECURE_REGISTRIES: '127.0.0.1:5000' };
    const a = await cliRegistrySettings(ctxWith(env), file);
    assert.deepEqual(a.insecure, ['reg.lab:5000', '127.0.0.1:5000']);
    assert.deepEqual(a.mirrors, { 'docker.io': ['m.lab'] });
    assert.equal(a.authFile, join(dir, 'auth.json'));
    const b = await cliRegistrySettings(ctxWith({ ...env, DSEC_CONFIG: file }));
    assert.deepEqual(b, a);
    assert.deepEqual(await cliRegistrySettings(ctxWith({})), { insecure: [], mirrors: {} });

    await writeFile(file, JSON.stringify({ registries: { insecure: ['bad host'] } }));
    await assert.rejects(cliRegistrySettings(ctxWith({}), file), (err: unknown) => {
      assert.ok(isDsecError(err, 'invalid_argument'));
      assert.match(err.message, /registries\.insecure/);
      return true;
    });
    await writeFile(file, JSON.stringify({ registries: { insecure: [], proxies: [] } }));
    await assert.rejects(cliRegistrySettings(ctxWith({}), file), (err: unknown) =>
      isDsecError(err, 'invalid_argument'),
    );
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});

test('taskImagesOf: one bad instance ID fails that instance only', () => {
  const images = taskImagesOf(
    ['astropy__astropy-12907', '../../etc'],
    'docker://127.0.0.1:5000/swebench/sweb.eval.x86_64.{id}:latest',
  );
  assert.deepEqual(images.get('astropy__astropy-12907'), {
    layer: 'sweb.eval.x86_64.astropy_1776_astropy-12907:latest',
    source: 'docker://127.0.0.1:5000/swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest',
  });
  assert.ok(isDsecError(images.get('../../etc'), 'invalid_argument'));
});
