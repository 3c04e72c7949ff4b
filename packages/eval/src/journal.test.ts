import { test } from 'node:test';
import assert from 'node:assert/strict';
import { appendFileSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Journal } from './journal.js';
import { RequestIds } from './request-ids.js';
import { readResults } from './runner.js';

test('a journal reopened after a kill keeps sandboxes, steps and memos, and ignores a torn line', () => {
  const dir = mkdtempSync(join(tmpdir(), 'dsec-eval-journal-'));
  try {
    const path = join(dir, 'r.jsonl.journal');
    const j = Journal.create(path, {
      runId: 'abc',
      agent: 'http',
      labels: { job: 'x' },
      tasksFile: '/t.jsonl',
      startedAt: 'now',
    });
    j.sandbox('t1', 'sb-1');
    j.step('t1', 'ev.abc.t1.1:a1');
    j.memo('t1', 'turn.1', { message: { role: 'assistant', content: 'hi' } });
    j.newAttempt('t2', 'sandbox gone');
    j.sandbox('t2', 'sb-2');
    appendFileSync(path, '{"t":"step","id":"t1","rid":"ev.abc.t1.1:a2"'); // killed mid-write
    const back = Journal.open(path);
    assert.equal(back.header.runId, 'abc');
    assert.deepEqual(back.header.labels, { job: 'x' });
    const t1 = back.task('t1');
    assert.equal(t1.sandboxId, 'sb-1');
    assert.deepEqual([...t1.steps], ['ev.abc.t1.1:a1']);
    assert.deepEqual(t1.memos.get('turn.1'), { message: { role: 'assistant', content: 'hi' } });
    assert.equal(back.task('t2').attempt, 2);
    assert.equal(back.task('t2').sandboxId, 'sb-2');
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test('readResults keeps whole lines and drops a torn last one from the file', () => {
  const dir = mkdtempSync(join(tmpdir(), 'dsec-eval-results-'));
  try {
    const path = join(dir, 'r.jsonl');
    writeFileSync(path, '{"instance_id":"a","reward":1}\n{"instance_id":"b","rew');
    assert.deepEqual(
      readResults(path).map((r) => r.instance_id),
      ['a'],
    );
    assert.equal(readFileSync(path, 'utf8'), '{"instance_id":"a","reward":1}\n');
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test('request IDs fit the API (1–128 of [A-Za-z0-9._:-]) whatever the instance ID', () => {
  for (const id of ['django__django-11099', 'org/repo#1', 'x'.repeat(256)]) {
    const ids = new RequestIds('0123456789ab', id, 12);
    for (const rid of [ids.create, ids.step('a', 999, 'write'), ids.step('g', 1)]) {
      assert.match(rid, /^[A-Za-z0-9._:-]{1,128}$/, rid);
      assert.ok(ids.owns(rid));
    }
  }
  assert.notEqual(
    new RequestIds('r', 'org/repo#1', 1).prefix,
    new RequestIds('r', 'org/repo_1', 1).prefix,
  );
});
