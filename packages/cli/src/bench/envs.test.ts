import assert from 'node:assert/strict';
import { test } from 'node:test';
import { Command } from 'commander';
import { isDsecError } from '@dsec/core';
import {
  ENVS_CACHE_DIR,
  envOfRun,
  envSizes,
  envsBenchOptions,
  envsRatios,
  envsReport,
  registerEnvsBench,
  summarizePhase,
  type EnvsSide,
} from './envs.js';

const side = (over: Partial<EnvsSide> = {}): EnvsSide => ({
  secondsToLastResult: 10,
  bytesDownloaded: 1000,
  bytesWritten: 5000,
  passed: 64,
  failed: 0,
  loadAverage: 1,
  ...over,
});

void test('the defaults are the issue’s: 16 environments, 64 runs, concurrency 16', () => {
  assert.deepEqual(envsBenchOptions({}), {
    envs: 16,
    runs: 64,
    concurrency: 16,
    cacheDir: ENVS_CACHE_DIR,
  });
  assert.deepEqual(envsBenchOptions({ envs: '2', runs: 4, concurrency: '2', cacheDir: '/x' }), {
    envs: 2,
    runs: 4,
    concurrency: 2,
    cacheDir: '/x',
  });
});

void test('bad flags are invalid_argument naming the flag', () => {
  const cases: [Parameters<typeof envsBenchOptions>[0], string][] = [
    [{ envs: 0 }, 'envs'],
    [{ envs: 65 }, 'envs'],
    [{ envs: '1.5' }, 'envs'],
    [{ runs: -1 }, 'runs'],
    [{ runs: 'many' }, 'runs'],
    [{ concurrency: 0 }, 'concurrency'],
    [{ concurrency: 1e9 }, 'concurrency'],
    [{ cacheDir: 'relative/dir' }, 'cache-dir'],
  ];
  for (const [flags, field] of cases) {
    assert.throws(
      () => envsBenchOptions(flags),
      (err: unknown) => isDsecError(err) && err.code === 'invalid_argument' && err.field === field,
      JSON.stringify(flags),
    );
  }
});

void test('the CLI parses the scale-down flags', async () => {
  const program = new Command().exitOverride();
  const bench = program.command('bench');
  registerEnvsBench(bench);
  const envs = bench.commands.find((c) => c.name() === 'envs')!;
  envs.action(() => undefined);
  await program.parseAsync(['bench', 'envs', '--envs', '3', '--runs', '6', '--concurrency', '2'], {
    from: 'user',
  });
  assert.deepEqual(envs.opts(), { envs: 3, runs: 6, concurrency: 2, cacheDir: ENVS_CACHE_DIR });
  assert.throws(() => program.parse(['bench', 'envs', '--runs', 'x'], { from: 'user' }));
});

void test('ratios: speedup is podman ÷ dsec, bytes are dsec ÷ podman, zero denominators give 0', () => {
  assert.deepEqual(
    envsRatios(
      side({ secondsToLastResult: 20, bytesWritten: 100, bytesDownloaded: 300 }),
      side({ secondsToLastResult: 70, bytesWritten: 1000, bytesDownloaded: 900 }),
    ),
    { speedupToLastResult: 3.5, bytesWritten: 0.1, bytesDownloaded: 0.3333 },
  );
  assert.deepEqual(
    envsRatios(side({ secondsToLastResult: 0 }), side({ bytesWritten: 0, bytesDownloaded: 0 })),
    { speedupToLastResult: 0, bytesWritten: 0, bytesDownloaded: 0 },
  );
});

void test('the report has the contract’s shape and judges the targets', () => {
  const opts = { envs: 16, runs: 64, concurrency: 16 };
  const podman = {
    ...side({ secondsToLastResult: 90, bytesWritten: 10_000 }),
    storageDriver: 'overlay',
  };
  const met = envsReport(
    opts,
    [],
    side({ secondsToLastResult: 30, bytesWritten: 2000 }),
    podman,
    {},
  );
  assert.equal(met.benchmark, 'envs');
  for (const s of [met.results.dsec, met.results.podman]) {
    for (const k of ['secondsToLastResult', 'bytesDownloaded', 'bytesWritten'] as const)
      assert.equal(typeof s[k], 'number', k);
  }
  assert.deepEqual(Object.keys(met.ratios).sort(), [
    'bytesDownloaded',
    'bytesWritten',
    'speedupToLastResult',
  ]);
  assert.equal(met.targets.met, true);
  // Just short of 3× faster; just short of 5× fewer writes; a failed run.
  assert.equal(
    envsReport(opts, [], side({ secondsToLastResult: 30.1, bytesWritten: 2000 }), podman, {})
      .targets.met,
    false,
  );
  assert.equal(
    envsReport(opts, [], side({ secondsToLastResult: 30, bytesWritten: 2001 }), podman, {}).targets
      .met,
    false,
  );
  assert.equal(
    envsReport(
      opts,
      [],
      side({ secondsToLastResult: 30, bytesWritten: 2000, failed: 1 }),
      podman,
      {},
    ).targets.met,
    false,
  );
  // Nothing written at all is no evidence of a reduction.
  assert.equal(
    envsReport(opts, [], side({ secondsToLastResult: 30, bytesWritten: 0 }), podman, {}).targets
      .met,
    false,
  );
  assert.doesNotThrow(() => JSON.stringify(met));
});

void test('every environment is 300–600 MiB, sized the same whatever --envs', () => {
  const seen = new Set<number>();
  for (let i = 0; i < 16; i++) {
    const s = envSizes(i);
    assert.ok(s.totalBytes >= 300 * 2 ** 20 && s.totalBytes <= 600 * 2 ** 20, String(i));
    assert.ok(s.toolkitBytes > 0 && s.workspaceBytes > 0);
    seen.add(s.totalBytes);
  }
  assert.equal(seen.size, 16, 'sizes differ between environments');
  assert.deepEqual(envSizes(5), envSizes(5));
});

void test('runs go round-robin: each wave of 16 holds 16 distinct environments', () => {
  const wave = Array.from({ length: 16 }, (_, k) => envOfRun(k, 16));
  assert.equal(new Set(wave).size, 16);
  const all = Array.from({ length: 64 }, (_, k) => envOfRun(k, 16));
  for (let i = 0; i < 16; i++) assert.equal(all.filter((e) => e === i).length, 4);
});

void test('phase summaries: median of odd and even counts, max, sum; nothing is zeros', () => {
  assert.deepEqual(summarizePhase([30, 10, 20]), { medianMs: 20, maxMs: 30, totalMs: 60 });
  assert.deepEqual(summarizePhase([4, 1, 3, 2]), { medianMs: 3, maxMs: 4, totalMs: 10 });
  assert.deepEqual(summarizePhase([]), { medianMs: 0, maxMs: 0, totalMs: 0 });
});
