import { test } from 'node:test';
import assert from 'node:assert/strict';
import { isDsecError } from '@dsec/core';
import { parseTemplateString, resolveTemplate } from './templates.js';

test('a template string names an image, a workspace and toolkits', () => {
  assert.deepEqual(parseTemplateString('busybox'), { image: 'busybox', toolkits: [] });
  assert.deepEqual(parseTemplateString('python:3.12/swe-17:v2+git+uv:1'), {
    image: 'python:3.12',
    workspace: 'swe-17:v2',
    toolkits: ['git', 'uv:1'],
  });
  assert.deepEqual(parseTemplateString('python+git'), {
    image: 'python',
    toolkits: ['git'],
  });
  for (const bad of ['', 'Python', 'a/b/c', 'a+', 'a/', 'a:', '/b', 'a+B']) {
    assert.throws(
      () => parseTemplateString(bad),
      (e) => isDsecError(e, 'invalid_argument') && e.field === 'templateID',
      bad,
    );
  }
});

test('operator-defined names win over the template string, and are copied', () => {
  const defined = {
    base: 'busybox',
    big: { image: 'python', memoryLimitMb: 4096 },
    toString: 'busybox', // a name, not an Object.prototype member
  };
  assert.deepEqual(resolveTemplate('base', defined), { image: 'busybox', toolkits: [] });
  const big = resolveTemplate('big', defined);
  assert.deepEqual(big, { image: 'python', memoryLimitMb: 4096 });
  big.memoryLimitMb = 1;
  assert.equal(defined.big.memoryLimitMb, 4096);
  assert.deepEqual(resolveTemplate('constructor', {}), { image: 'constructor', toolkits: [] });
  assert.deepEqual(resolveTemplate('toString', defined), { image: 'busybox', toolkits: [] });
});
