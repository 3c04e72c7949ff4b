import { test } from 'node:test';
import assert from 'node:assert/strict';
import { OutputBudget } from './output-budget.js';

/** A stream whose backlog the test sets; records why it was cut. */
function stream(budget: OutputBudget) {
  const s = { queued: 0, cut: undefined as string | undefined };
  const account = budget.open(
    () => s.queued,
    (reason) => (s.cut = reason),
  );
  return Object.assign(s, { account });
}

test('a stream over its own cap is cut; one within it is not', () => {
  const budget = new OutputBudget({ maxBytes: 1000, maxStreamBytes: 100 });
  const a = stream(budget);
  a.queued = 100;
  assert.equal(a.account.check(), true);
  a.queued = 101;
  assert.equal(a.account.check(), false);
  assert.equal(a.cut, 'stream_buffer');
  assert.equal(budget.streams, 0);
  // Once cut, always cut; the callback ran once.
  a.cut = undefined;
  assert.equal(a.account.check(), false);
  assert.equal(a.cut, undefined);
});

test('over the global budget the biggest backlog is cut, not the stream that wrote last', () => {
  const budget = new OutputBudget({ maxBytes: 250, maxStreamBytes: 200 });
  const stalled = stream(budget);
  const reader = stream(budget);
  stalled.queued = 180;
  assert.equal(stalled.account.check(), true);
  reader.queued = 90; // 270 > 250: the stalled one goes
  assert.equal(reader.account.check(), true);
  assert.equal(stalled.cut, 'output_budget');
  assert.equal(reader.cut, undefined);
  assert.equal(budget.queuedBytes(), 90);
});

test('backlogs are measured afresh before anything is cut: drained streams are not charged', () => {
  const budget = new OutputBudget({ maxBytes: 100, maxStreamBytes: 100 });
  const a = stream(budget);
  const b = stream(budget);
  a.queued = 90;
  a.account.check();
  a.queued = 0; // drained since, without writing
  b.queued = 60;
  assert.equal(b.account.check(), true);
  assert.equal(a.cut, undefined);
  assert.equal(b.cut, undefined);
  b.account.close();
  a.account.close();
  assert.equal(budget.streams, 0);
  assert.equal(budget.queuedBytes(), 0);
});

test('over the budget the owner holding the most pays: many small stalled streams of one tenant cannot cut another tenant', () => {
  // One tenant fills the budget with many streams, each with a backlog below what a reading
  // client has queued right after a write (one 64 KiB chunk, base64 in JSON, is ~87 KiB).
  const budget = new OutputBudget({ maxBytes: 1000, maxStreamBytes: 1000 });
  const open = (owner: string) => {
    const s = { queued: 0, cut: undefined as string | undefined };
    const account = budget.open(
      () => s.queued,
      (reason) => (s.cut = reason),
      owner,
    );
    return Object.assign(s, { account });
  };
  const stalled = Array.from({ length: 20 }, () => open('prj-attacker'));
  for (const s of stalled) {
    s.queued = 50;
    assert.equal(s.account.check(), true);
  }
  const reader = open('prj-victim');
  reader.queued = 100; // 1100 > 1000
  assert.equal(reader.account.check(), true, 'the other tenant keeps its stream');
  assert.equal(reader.cut, undefined);
  assert.equal(stalled.filter((s) => s.cut === 'output_budget').length, 2);
  assert.ok(budget.queuedBytes() <= 1000);
  // Within one owner the biggest backlog still goes first.
  const big = open('prj-victim');
  big.queued = 200; // 1200: the attacker still holds the most (900), four more of its go
  big.account.check();
  assert.equal(big.cut, undefined);
  assert.equal(stalled.filter((s) => s.cut === 'output_budget').length, 6);
  // An owner alone over the budget pays with its own biggest stream.
  for (const s of stalled) s.account.close();
  reader.queued = 900; // 1100, all of it the victim's now
  reader.account.check();
  assert.equal(reader.cut, 'output_budget');
  assert.equal(big.cut, undefined);
});
