import assert from 'node:assert/strict';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { Command } from 'commander';
import { DsecError } from '@dsec/core';
import { attachContext, CliContext } from '../context.js';
import { register as registerUp } from './up.js';
import { upSettings, type UpSettings } from './up-config.js';

/** Parses `dsec up ARGS` and returns the merged settings (nothing is started). */
async function settingsFor(args: string[]): Promise<UpSettings> {
  const program = new Command('dsec')
    .option('--state-dir <dir>')
    .option('--image-store <location>')
    .option('--json')
    .exitOverride();
  const ctx = new CliContext({ stdout: process.stdout, stderr: process.stderr, env: {} }, program);
  attachContext(program, ctx);
  registerUp(program);
  let settings: UpSettings | undefined;
  program.commands
    .find((c) => c.name() === 'up')!
    .action(async (opts: Parameters<typeof upSettings>[0], command: Command) => {
      settings = await upSettings(opts, command, ctx);
    });
  await program.parseAsync(args, { from: 'user' });
  return settings!;
}

void describe('dsec up --config: apiserver.metricsListen', () => {
  let dir: string;
  const config = async (apiserver: Record<string, unknown>): Promise<string> => {
    const file = join(dir, `${Object.keys(apiserver).join('-') || 'empty'}.json`);
    await writeFile(file, JSON.stringify({ apiserver }));
    return file;
  };
  before(async () => {
    dir = await mkdtemp(join(tmpdir(), 'dsec-up-config-'));
  });
  after(async () => {
    await rm(dir, { recursive: true, force: true });
  });

  void test('the file opens the admin listener; IPv6 hosts keep their brackets off', async () => {
    const s = await settingsFor([
      'up',
      '--config',
      await config({ metricsListen: '127.0.0.1:9464' }),
    ]);
    assert.deepEqual(s.metricsListen, { host: '127.0.0.1', port: 9464 });
    const v6 = join(dir, 'v6.json');
    await writeFile(v6, JSON.stringify({ apiserver: { metricsListen: '[::1]:9500' } }));
    assert.deepEqual((await settingsFor(['up', '--config', v6])).metricsListen, {
      host: '::1',
      port: 9500,
    });
  });

  void test('--metrics-listen wins over the file; neither leaves it off', async () => {
    const file = await config({ metricsListen: '127.0.0.1:9464' });
    const s = await settingsFor(['up', '--config', file, '--metrics-listen', '127.0.0.2:9999']);
    assert.deepEqual(s.metricsListen, { host: '127.0.0.2', port: 9999 });
    assert.equal(
      (await settingsFor(['up', '--config', await config({})])).metricsListen,
      undefined,
    );
    assert.equal((await settingsFor(['up'])).metricsListen, undefined);
  });

  void test('a bad address in the file names the field', async () => {
    await assert.rejects(
      settingsFor(['up', '--config', await config({ metricsListen: 'nowhere' })]),
      (err: unknown) =>
        err instanceof DsecError &&
        err.code === 'invalid_argument' &&
        err.field === 'apiserver.metricsListen',
    );
    await assert.rejects(
      settingsFor(['up', '--config', await config({ metricsListen: '127.0.0.1:70000' })]),
      (err: unknown) => err instanceof DsecError && err.code === 'invalid_argument',
    );
  });

  void test('the Host allow-list, limits and audit retention of the file reach the node', async () => {
    const file = await config({
      allowedHosts: ['dsec.internal'],
      limits: { maxConnectionsPerAddress: 64 },
      auditRetentionDays: 30,
    });
    assert.deepEqual((await settingsFor(['up', '--config', file])).apiBounds, {
      allowedHosts: ['dsec.internal'],
      limits: { maxConnectionsPerAddress: 64 },
      auditRetentionDays: 30,
    });
    assert.deepEqual((await settingsFor(['up'])).apiBounds, {});
  });
});

void describe('dsec up --sandboxfusion-listen', () => {
  test('off by default; the address and the project go together', async () => {
    assert.equal((await settingsFor(['up'])).sandboxFusion, undefined);
    assert.deepEqual(
      (
        await settingsFor([
          'up',
          '--sandboxfusion-listen',
          '127.0.0.1:8080',
          '--sandboxfusion-project',
          'rl-team',
        ])
      ).sandboxFusion,
      { host: '127.0.0.1', port: 8080, projectId: 'rl-team' },
    );
    for (const args of [
      ['up', '--sandboxfusion-listen', '127.0.0.1:8080'],
      ['up', '--sandboxfusion-project', 'rl-team'],
      [
        'up',
        '--edges',
        '2',
        '--sandboxfusion-listen',
        '127.0.0.1:8080',
        '--sandboxfusion-project',
        'p',
      ],
    ])
      await assert.rejects(
        settingsFor(args),
        (e) => e instanceof DsecError && e.code === 'invalid_argument',
        args.join(' '),
      );
  });
});
