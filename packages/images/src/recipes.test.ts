import assert from 'node:assert/strict';
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { isDsecError } from '@dsec/core';
import { DirImageStore } from './store/dir-store.js';
import { ensureEnvironment, parseEnvironmentRecipes, recipeDigest } from './recipes.js';

const RECIPES = {
  base: { kind: 'base', debootstrap: { packages: ['patch'] } },
  tk: { kind: 'toolkit', debs: ['python3', 'python3-pytest=7.2.1-2'], base: 'base' },
};

void test('the shipped environments file parses', async () => {
  const file = join(import.meta.dirname, '../../../examples/swe-tasks/environments.json');
  const recipes = parseEnvironmentRecipes(JSON.parse(await readFile(file, 'utf8')));
  assert.equal(recipes['debian-base']?.kind, 'base');
  assert.deepEqual(Object.keys(recipes).sort(), ['debian-base', 'node-test', 'python-test']);
});

void test('recipes are checked strictly, naming the bad field', () => {
  const cases: [unknown, string][] = [
    [[], 'recipes'],
    [{ base: { ...RECIPES.base, extra: 1 } }, 'base.extra'],
    [{ base: { kind: 'vm' } }, 'base.kind'],
    [
      { base: { kind: 'base', debootstrap: { packages: ['Bad Name'] } } },
      'base.debootstrap.packages.0',
    ],
    [
      { base: { kind: 'base', debootstrap: {}, files: { '../etc/passwd': 'x' } } },
      'base.files.../etc/passwd',
    ],
    [{ base: { kind: 'base', debootstrap: {}, files: { '/etc/x': 'x' } } }, 'base.files./etc/x'],
    [{ tk: { ...RECIPES.tk, debs: [] } }, 'tk.debs'],
    [{ tk: RECIPES.tk }, 'tk.base'],
    [{ ...RECIPES, tk2: { ...RECIPES.tk, base: 'tk' } }, 'tk2.base'],
    [{ 'Bad Name': RECIPES.base }, 'Bad Name'],
  ];
  for (const [json, field] of cases) {
    assert.throws(
      () => parseEnvironmentRecipes(json),
      (e) => isDsecError(e, 'invalid_argument') && e.field === field,
      field,
    );
  }
  assert.doesNotThrow(() => parseEnvironmentRecipes(RECIPES));
});

void test('the recipe digest ignores key order and follows the recipe and the base under it', () => {
  const recipes = parseEnvironmentRecipes(RECIPES);
  const tk = recipes['tk']!;
  const reordered = parseEnvironmentRecipes({
    tk: { base: 'base', debs: [...RECIPES.tk.debs], kind: 'toolkit' },
    base: RECIPES.base,
  })['tk']!;
  const base1 = `sha256:${'1'.repeat(64)}`;
  const base2 = `sha256:${'2'.repeat(64)}`;
  assert.equal(recipeDigest(tk, base1), recipeDigest(reordered, base1));
  assert.notEqual(recipeDigest(tk, base1), recipeDigest(tk, base2));
  assert.notEqual(
    recipeDigest(tk, base1),
    recipeDigest({ ...tk, debs: ['python3'] } as typeof tk, base1),
  );
  assert.match(recipeDigest(recipes['base']!), /^sha256:[0-9a-f]{64}$/);
  // The suite the base is: bookworm (what every layer was resolved from before) keeps the
  // digest; another suite gives another, so a layer resolved from the wrong one is rebuilt.
  assert.equal(recipeDigest(tk, base1, 'bookworm'), recipeDigest(tk, base1));
  assert.notEqual(recipeDigest(tk, base1, 'bullseye'), recipeDigest(tk, base1));
});

void test('ensureEnvironment refuses a name the recipes lack, before touching the store', async () => {
  const store = new DirImageStore('/nonexistent/dsec-store');
  await assert.rejects(
    ensureEnvironment(store, 'missing', parseEnvironmentRecipes(RECIPES), {
      cacheDir: '/nonexistent/cache',
    }),
    (e) => isDsecError(e, 'invalid_argument') && e.field === 'environment',
  );
});

void test('install recipes: checked strictly, stacked on a base and its toolkits', () => {
  const ok = parseEnvironmentRecipes({
    ...RECIPES,
    env: {
      kind: 'install',
      base: 'base',
      toolkits: ['tk'],
      commands: ['apt-get update', 'apt-get install -y python3-yaml'],
      egress: 'debian',
      workdir: '/opt',
      env: { DEBIAN_FRONTEND: 'noninteractive' },
      timeoutSeconds: 900,
      scrub: ['/var/lib/apt/lists/**'],
    },
    env2: {
      kind: 'install',
      base: 'base',
      commands: ['true'],
      egress: { allow: ['*.example.org'] },
    },
  });
  assert.equal(ok['env']?.kind, 'install');
  const refused = (recipe: Record<string, unknown>, field: string): void => {
    assert.throws(
      () =>
        parseEnvironmentRecipes({ ...RECIPES, x: { kind: 'install', base: 'base', ...recipe } }),
      (e: unknown) => isDsecError(e, 'invalid_argument') && e.field === field,
      `${JSON.stringify(recipe)} → ${field}`,
    );
  };
  refused({}, 'x.commands');
  refused({ commands: [] }, 'x.commands');
  refused({ commands: [''] }, 'x.commands.0');
  refused({ commands: ['a\0b'] }, 'x.commands.0');
  refused({ commands: ['x'.repeat(16 * 1024 + 1)] }, 'x.commands.0');
  refused({ commands: Array(65).fill('true') }, 'x.commands');
  refused({ commands: ['true'], egress: 'internet' }, 'x.egress');
  refused(
    { commands: ['true'], egress: { allow: ['deb.debian.org; rm -rf /'] } },
    'x.egress.allow.0',
  );
  refused({ commands: ['true'], egress: { allow: ['10.0.0.1/8'] } }, 'x.egress.allow.0');
  refused({ commands: ['true'], egress: { allow: [], deny: [] } }, 'x.egress.deny');
  refused({ commands: ['true'], workdir: 'relative' }, 'x.workdir');
  refused({ commands: ['true'], env: { 'BAD-NAME': 'v' } }, 'x.env.BAD-NAME');
  refused({ commands: ['true'], timeoutSeconds: 0 }, 'x.timeoutSeconds');
  refused({ commands: ['true'], timeoutSeconds: 3601 }, 'x.timeoutSeconds');
  refused({ commands: ['true'], scrub: ['relative/**'] }, 'x.scrub.0');
  refused({ commands: ['true'], toolkits: ['missing'] }, 'x.toolkits.0');
  refused({ commands: ['true'], toolkits: ['base'] }, 'x.toolkits.0');
  refused({ commands: ['true'], network: 'debian' }, 'x.network');
  assert.throws(
    () =>
      parseEnvironmentRecipes({
        ...RECIPES,
        x: { kind: 'install', base: 'tk', commands: ['true'] },
      }),
    (e: unknown) => isDsecError(e, 'invalid_argument') && e.field === 'x.base',
  );
});

void test('an install recipe needing a build without a cluster says so, naming the recipe', async () => {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-install-unit-'));
  try {
    const { buildInstall } = await import('./install-recipe.js');
    await assert.rejects(
      buildInstall(new DirImageStore(join(dir, 'store')), {
        name: 'env',
        recipe: { kind: 'install', base: 'base', commands: ['true'] },
        layers: [],
        recipeDigest: `sha256:${'0'.repeat(64)}`,
      }),
      (e: unknown) =>
        isDsecError(e, 'invalid_argument') &&
        e.field === 'env.kind' &&
        (e.details as { reason?: string }).reason === 'install_needs_cluster',
    );
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});

void test('installCommandFailed keeps the tail of the output and names the command', async () => {
  const { installCommandFailed, INSTALL_OUTPUT_TAIL_BYTES } = await import('./install-recipe.js');
  const e = installCommandFailed('env', 2, 'make install', {
    exitCode: 2,
    outcome: 'exited',
    stdout: `${'x'.repeat(10_000)}END-OUT`,
    stderr: 'make: *** [install] Error 1',
  });
  assert.equal(e.field, 'env.commands.2');
  assert.match(e.message, /install recipe env: command 3 "make install" exited 2/);
  assert.match(e.message, /Error 1$/);
  const d = e.details as { stdoutTail: string; stderrTail: string };
  assert.equal(d.stdoutTail.length, INSTALL_OUTPUT_TAIL_BYTES);
  assert.ok(d.stdoutTail.endsWith('END-OUT'));
});

void test('installLayerName: one name per recipe and workspace, never shared by two', async () => {
  const { installLayerName } = await import('./install-recipe.js');
  const { LAYER_NAME_PATTERN } = await import('@dsec/core');
  // Two recipes of one file whose names agree on their first 100 characters, on one workspace:
  // one name would make the second build replace the first's layer under the first's tasks.
  const long = 'a'.repeat(100);
  const names = [
    installLayerName(`${long}-x`, 'ws-repo-0123456789ab:latest'),
    installLayerName(`${long}-y`, 'ws-repo-0123456789ab:latest'),
    installLayerName('a'.repeat(128), 'ws-repo-0123456789ab:latest'),
    installLayerName('tk', 'ws-repo-0123456789ab:latest'),
    installLayerName('tk', 'ws-repo-0123456789ac:latest'),
  ];
  assert.equal(new Set(names).size, names.length, names.join('\n'));
  for (const n of names) assert.match(n, LAYER_NAME_PATTERN);
  // A hostile dataset's workspace must not be able to take another task's layer name: 48 bits
  // (12 hex digits) is a second preimage a GPU finds in hours; 128 bits is out of reach.
  const hex = /\.ws-([0-9a-f]+)$/.exec(names[3]!)?.[1] ?? '';
  assert.ok(hex.length >= 32, `only ${hex.length * 4} bits of the workspace's hash`);
  assert.ok(names[3]!.startsWith('tk.ws-'), 'the recipe is still named first');
});

void test("installCommandFailed's message carries no terminal control sequence from the sandbox", async () => {
  // The output is what the build's commands printed, a hostile repository's setup.py included;
  // the message is printed to the operator's terminal (`error: …`): an ESC or C1 sequence
  // there sets the clipboard (OSC 52), retitles, or hides lines with CR and cursor moves.
  const { installCommandFailed } = await import('./install-recipe.js');
  const hostile = 'ok\x1b]52;c;ZWNobyBwd25lZA==\x07\r\x1b[2Kall good\x9b31m\x00\ttab';
  const e = installCommandFailed('env', 0, 'pip install -e .\x1b[8m', {
    exitCode: 1,
    outcome: 'exited',
    stdout: hostile,
    stderr: 'boom\x1b[1A',
  });
  assert.doesNotMatch(e.message, /[\x00-\x08\x0b-\x1f\x7f-\x9f]/, JSON.stringify(e.message));
  assert.match(e.message, /ok\\x1b\]52;c;/); // still readable, escaped
  assert.match(e.message, /\ttab\nboom/); // tabs and newlines are kept
  // The details keep the bytes as they were, for a program to read.
  assert.equal((e.details as { stdoutTail: string }).stdoutTail, hostile);
});
