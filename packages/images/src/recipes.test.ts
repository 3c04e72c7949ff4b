import assert from 'node:assert/strict';
import { readFile } from 'node:fs/promises';
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
