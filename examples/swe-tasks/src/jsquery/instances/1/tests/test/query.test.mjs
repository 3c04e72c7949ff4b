import assert from 'node:assert/strict';
import { test } from 'node:test';
import { parse, stringify } from '../src/query.mjs';

test('parse reads pairs and drops a leading question mark', () => {
  assert.deepEqual(parse('?a=1&b=two'), { a: '1', b: 'two' });
});

test('parse decodes percent escapes', () => {
  assert.deepEqual(parse('path=%2Ftmp%2Fx&e=%C3%A9'), { path: '/tmp/x', e: 'é' });
});

test('parse collects repeated keys into an array', () => {
  assert.deepEqual(parse('tag=a&tag=b&tag=c'), { tag: ['a', 'b', 'c'] });
});

test('parse gives a key without a value the empty string', () => {
  assert.deepEqual(parse('flag&x='), { flag: '', x: '' });
});

test('stringify encodes and repeats array keys', () => {
  assert.equal(stringify({ q: 'a b&c', tag: ['x', 'y'] }), 'q=a%20b%26c&tag=x&tag=y');
});

test('stringify then parse gives the values back', () => {
  const params = { q: 'dsec sandbox', path: '/a?b=c' };
  assert.deepEqual(parse(stringify(params)), params);
});

test('parse decodes a plus as a space', () => {
  assert.deepEqual(parse('q=dsec+sandbox'), { q: 'dsec sandbox' });
});

test('parse decodes a plus in a key, and keeps an escaped plus', () => {
  assert.deepEqual(parse('first+name=Ada&sum=1%2B1'), { 'first name': 'Ada', sum: '1+1' });
});
