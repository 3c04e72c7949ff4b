import { test } from 'node:test';
import assert from 'node:assert/strict';
import { createProgress } from './progress.js';

function sink(isTTY: boolean) {
  const writes: string[] = [];
  return { writes, stream: { isTTY, columns: 80, write: (s: string) => writes.push(s) } };
}

void test('draws a bar on a TTY and ends the line', () => {
  const { writes, stream } = sink(true);
  const bar = createProgress({ label: 'pull', total: 4, enabled: true, stream, intervalMs: 0 });
  bar.update(1);
  bar.update(2);
  bar.done();
  assert.match(writes[0] ?? '', /pull \[#+-+\]  25% 1\/4/);
  assert.match(writes.at(-2) ?? '', /50% 2\/4/);
  assert.equal(writes.at(-1), '\n');
});

void test('shows a count without a total', () => {
  const { writes, stream } = sink(true);
  const bar = createProgress({
    label: 'files',
    enabled: true,
    stream,
    intervalMs: 0,
    format: (n) => `${n} files`,
  });
  bar.update(7);
  bar.done();
  assert.match(writes[0] ?? '', /files . 7 files$/);
});

void test('is silent when disabled or not a TTY', () => {
  for (const [isTTY, enabled] of [
    [false, true],
    [true, false],
  ] as const) {
    const { writes, stream } = sink(isTTY);
    const bar = createProgress({ label: 'x', total: 1, enabled, stream });
    bar.update(1);
    bar.done();
    assert.deepEqual(writes, []);
  }
});
