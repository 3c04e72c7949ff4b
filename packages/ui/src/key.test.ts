import { test } from 'node:test';
import assert from 'node:assert/strict';
import { routeOf, takeKeyFromFragment } from './key.js';

test('a key in the fragment is taken out and the default route shown', () => {
  assert.deepEqual(takeKeyFromFragment('#key=dsk_abcdef123456'), {
    key: 'dsk_abcdef123456',
    hash: '#/sandboxes',
  });
});

test('the key is URL-decoded and `to=` picks the route shown after sign-in', () => {
  assert.deepEqual(takeKeyFromFragment('#key=dsk%2Bab%3Dcd123&to=/sandboxes/sb-1'), {
    key: 'dsk+ab=cd123',
    hash: '#/sandboxes/sb-1',
  });
});

test('a fragment without a key is left alone', () => {
  assert.deepEqual(takeKeyFromFragment('#/nodes'), { hash: '#/nodes' });
  assert.deepEqual(takeKeyFromFragment(''), { hash: '' });
  // `key=` must lead: a route that merely mentions it is a route.
  assert.deepEqual(takeKeyFromFragment('#/files?key=x'), { hash: '#/files?key=x' });
});

test('an implausible key is dropped but still stripped from the address', () => {
  for (const bad of [
    '#key=',
    '#key=short',
    '#key=has%20space%20inside',
    `#key=${'a'.repeat(600)}`,
  ]) {
    const r = takeKeyFromFragment(bad);
    assert.equal(r.key, undefined, bad);
    assert.equal(r.hash, '#/sandboxes', bad);
  }
});

test('a `to=` that is not a plain route falls back to the default', () => {
  for (const to of ['https://evil.example/', '//evil', 'javascript:alert(1)', '/a b']) {
    const r = takeKeyFromFragment(`#key=dsk_abcdef123456&to=${encodeURIComponent(to)}`);
    assert.equal(r.hash, '#/sandboxes', to);
  }
});

test('routes split on slashes and decode their parts', () => {
  assert.deepEqual(routeOf('#/sandboxes/sb%3A1'), ['sandboxes', 'sb:1']);
  assert.deepEqual(routeOf('#/'), []);
  assert.deepEqual(routeOf(''), []);
  assert.deepEqual(routeOf('#/nodes?x=1'), ['nodes']);
});
