import { test } from 'node:test';
import assert from 'node:assert/strict';
import type { LayerInfo } from '@dsec/core';
import { imageDefaults, MAX_IMAGE_ENV_ENTRIES } from './image-defaults.js';

const layer = (kind: LayerInfo['kind'], config?: LayerInfo['config']): LayerInfo =>
  ({ name: 'x', version: 'v', kind, ...(config ? { config } : {}) }) as LayerInfo;

test('the base image config gives Env and WorkingDir; other layers do not', () => {
  const d = imageDefaults([
    layer('base', {
      env: ['PATH=/opt/miniconda3/envs/testbed/bin:/usr/bin', 'LANG=C.UTF-8', 'EMPTY='],
      workingDir: '/testbed',
    }),
    layer('toolkit', { env: ['PATH=/evil'], workingDir: '/tmp' }),
  ]);
  assert.deepEqual(d, {
    env: { PATH: '/opt/miniconda3/envs/testbed/bin:/usr/bin', LANG: 'C.UTF-8', EMPTY: '' },
    cwd: '/testbed',
  });
  assert.deepEqual(imageDefaults([layer('base')]), { env: {} });
});

test('attack: a hostile image config is bounded and cannot smuggle odd names or paths', () => {
  const env = Array.from({ length: 5000 }, (_, i) => `V${i}=${'x'.repeat(10)}`);
  const d = imageDefaults([
    layer('base', {
      env: [...env, 'NO_EQUALS', '=x', 'BAD NAME=1', '__proto__=1'],
      workingDir: 'relative/dir',
    }),
  ]);
  assert.equal(Object.keys(d.env).length, MAX_IMAGE_ENV_ENTRIES);
  assert.equal(d.cwd, undefined);
  assert.equal(Object.getPrototypeOf(d.env), Object.prototype);
  const big = imageDefaults([layer('base', { env: [`A=${'y'.repeat(300 * 1024)}`, 'B=1'] })]);
  assert.deepEqual(big.env, {});
});
