import { test } from 'node:test';
import assert from 'node:assert/strict';
import { OutputCapture } from './output-capture.js';

test('keeps everything under the cap', () => {
  const c = new OutputCapture(10);
  c.push(Buffer.from('abc'));
  c.push(Buffer.from('def'));
  assert.equal(c.bytes().toString(), 'abcdef');
  assert.equal(c.truncated, false);
  assert.equal(c.totalBytes, 6);
});

test('keeps head and tail and counts what it dropped', () => {
  const c = new OutputCapture(6);
  for (const ch of 'abcdefghijklmnop') c.push(Buffer.from(ch));
  assert.equal(c.bytes().toString(), 'abcnop');
  assert.equal(c.truncated, true);
  assert.equal(c.totalBytes, 16);
});

test('a huge single chunk keeps only cap bytes', () => {
  const c = new OutputCapture(8);
  c.push(Buffer.alloc(1 << 20, 'y'));
  c.push(Buffer.from('END'));
  const out = c.bytes().toString();
  assert.equal(out.length, 8);
  assert.ok(out.endsWith('END'));
  assert.equal(c.totalBytes, (1 << 20) + 3);
});

test('a zero cap keeps nothing but still counts', () => {
  const c = new OutputCapture(0);
  c.push(Buffer.from('hello'));
  assert.equal(c.bytes().length, 0);
  assert.equal(c.truncated, true);
  assert.equal(c.totalBytes, 5);
});
