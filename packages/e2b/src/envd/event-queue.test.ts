import { test } from 'node:test';
import assert from 'node:assert/strict';
import { EventQueue, isQueueOverflow, keepaliveMs } from './event-queue.js';

async function drain<T>(q: AsyncIterable<T>): Promise<{ items: T[]; error?: unknown }> {
  const items: T[] = [];
  try {
    for await (const x of q) items.push(x);
  } catch (error) {
    return { items, error };
  }
  return { items };
}

test('items come out in order, then the end; an error comes after the queued items', async () => {
  const q = new EventQueue<number>(100, () => new Error('full'));
  const reading = drain(q);
  q.push(1, 10);
  await Promise.resolve();
  q.push(2, 10);
  q.end();
  q.push(3, 10); // after the end: dropped
  assert.deepEqual(await reading, { items: [1, 2] });

  const e = new EventQueue<number>(100, () => new Error('full'));
  e.push(1);
  e.end(new Error('boom'));
  const out = await drain(e);
  assert.deepEqual(out.items, [1]);
  assert.equal((out.error as Error).message, 'boom');
});

test('a reader that falls behind by more than maxBytes gets the overflow error, and nothing it missed stays', async () => {
  let overflowed = 0;
  const q = new EventQueue<string>(
    25,
    () => new Error('client is not reading'),
    () => overflowed++,
  );
  q.push('a', 10);
  q.push('b', 10);
  q.push('c', 10); // 30 > 25
  q.push('d', 1); // ignored after the end
  assert.equal(q.bytes, 0);
  const out = await drain(q);
  // What it had not read is dropped with the stream (its connection is reset).
  assert.deepEqual(out.items, []);
  assert.equal((out.error as Error).message, 'client is not reading');
  assert.ok(isQueueOverflow(out.error));
  assert.equal(overflowed, 1);
});

test("the apiserver's output budget can cut a queue below its own cap", async () => {
  let allowed = 2;
  const backlog = { check: () => allowed-- > 0, measure: undefined as (() => number) | undefined };
  const q = new EventQueue<string>(1000, () => new Error('cut'), undefined, backlog);
  q.push('a', 10);
  assert.equal(backlog.measure?.(), 10, 'the queue reports what it holds');
  q.push('b', 10);
  q.push('c', 10); // the budget says no
  const out = await drain(q);
  assert.deepEqual(out.items, []);
  assert.ok(isQueueOverflow(out.error));
});

test('bytes are released as the reader takes items', async () => {
  const q = new EventQueue<number>(20, () => new Error('full'));
  const it = q[Symbol.asyncIterator]();
  for (let i = 0; i < 10; i++) {
    q.push(i, 15);
    assert.deepEqual(await it.next(), { value: i, done: false });
  }
  q.end();
  assert.equal((await it.next()).done, true);
});

test('keepalive interval comes from the header in seconds, within bounds', () => {
  assert.equal(keepaliveMs('50'), 50_000);
  assert.equal(keepaliveMs('1'), 1000);
  assert.equal(keepaliveMs(null), 50_000);
  assert.equal(keepaliveMs('0'), 50_000);
  assert.equal(keepaliveMs('1.5'), 50_000);
  assert.equal(keepaliveMs('99999'), 50_000);
});
