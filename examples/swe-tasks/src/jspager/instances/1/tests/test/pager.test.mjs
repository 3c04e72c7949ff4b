import assert from 'node:assert/strict';
import { test } from 'node:test';
import { pageCount, paginate } from '../src/pager.mjs';

const letters = [...'abcdefghij'];

test('pageCount of an exact multiple', () => {
  assert.equal(pageCount(30, 10), 3);
});

test('pageCount of zero items is zero', () => {
  assert.equal(pageCount(0, 10), 0);
});

test('pageCount rejects a page size that is not a positive integer', () => {
  assert.throws(() => pageCount(10, 0), RangeError);
  assert.throws(() => pageCount(10, 2.5), RangeError);
});

test('paginate returns the requested page', () => {
  assert.deepEqual(paginate(letters, 2, 5).items, ['f', 'g', 'h', 'i', 'j']);
});

test('paginate past the last page is empty', () => {
  assert.deepEqual(paginate(letters, 9, 5).items, []);
});

test('pageCount rounds a partial last page up', () => {
  assert.equal(pageCount(31, 10), 4);
  assert.equal(pageCount(1, 10), 1);
});

test('paginate counts the partial last page', () => {
  const last = paginate(letters, 3, 4);
  assert.deepEqual(last.items, ['i', 'j']);
  assert.equal(last.pages, 3);
});
