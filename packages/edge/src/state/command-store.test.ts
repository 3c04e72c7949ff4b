import { test } from 'node:test';
import assert from 'node:assert/strict';
import { appendFileSync, mkdtempSync, readFileSync, rmSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import Database from 'better-sqlite3';
import type { CommandInfo, CommandResult } from '@dsec/core';
import { CommandStore } from './command-store.js';

function started(n: number): CommandInfo {
  return {
    commandId: `cmd-${n}`,
    sandboxId: 'sb-1',
    argv: ['true'],
    background: false,
    state: 'running',
    startedAt: new Date(1_700_000_000_000 + n).toISOString(),
  };
}

function finished(info: CommandInfo): CommandInfo & { result: CommandResult; finishedAt: string } {
  return {
    ...info,
    state: 'finished',
    finishedAt: new Date().toISOString(),
    result: {
      commandId: info.commandId,
      exitCode: 0,
      outcome: 'exited',
      stdout: `out ${info.commandId}`,
      stderr: '',
      truncated: false,
      stdoutBytes: 0,
      stderrBytes: 0,
      durationMs: 1,
    },
  };
}

/** The results journal beside the database. */
function journal(file: string): string {
  return readFileSync(`${file}-results`, 'utf8');
}

/** Rows as another connection sees them: only what was committed. */
function committed(file: string): { command_id: string; state: string; result: string | null }[] {
  const db = new Database(file, { readonly: true });
  try {
    return db
      .prepare('SELECT command_id, state, result FROM commands ORDER BY command_id')
      .all() as { command_id: string; state: string; result: string | null }[];
  } finally {
    db.close();
  }
}

test('grouped results are journalled when their promises resolve and reach the table in a batch', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'dsec-command-store-'));
  const file = join(dir, 'edge.db');
  const store = new CommandStore(file);
  try {
    const infos = [1, 2, 3].map(started);
    for (const info of infos) store.insert(info, { durable: false });
    assert.deepEqual(committed(file), [], 'foreground starts wait for their results');
    const done = infos.map((info) => store.finishGrouped(finished(info)));
    assert.equal(journal(file), '', 'nothing is journalled before the turn ends');
    await Promise.all(done);
    assert.deepEqual(
      journal(file)
        .trim()
        .split('\n')
        .map((l) => (JSON.parse(l) as string[])[0]),
      infos.map((i) => i.commandId),
      'one line per result, written when the promises resolve',
    );
    assert.deepEqual(committed(file), [], 'the table gets them in a batch');
    // A read commits the batch first, and the journal is emptied.
    assert.equal(store.get('sb-1', 'cmd-2')?.result?.stdout, 'out cmd-2');
    const rows = committed(file);
    assert.deepEqual(
      rows.map((r) => [r.command_id, r.state]),
      infos.map((i) => [i.commandId, 'finished']),
    );
    assert.equal((JSON.parse(rows[0]!.result!) as CommandResult).stdout, 'out cmd-1');
    assert.equal(journal(file), '');
  } finally {
    store.close();
    rmSync(dir, { recursive: true, force: true });
  }
});

test('results journalled before a crash are in the table when the store opens again', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'dsec-command-store-'));
  const file = join(dir, 'edge.db');
  const crashed = new CommandStore(file); // never closed: as after kill -9
  const infos = [1, 2].map(started);
  await Promise.all(infos.map((info) => crashed.finishGrouped(finished(info))));
  assert.deepEqual(committed(file), []);
  // The crash cut a third line short: it was never acknowledged, and is skipped.
  appendFileSync(`${file}-results`, '["cmd-3","sb-1",null,"{');
  assert.equal(statSync(`${file}-results`).mode & 0o777, 0o600);
  const reopened = new CommandStore(file);
  try {
    assert.deepEqual(
      committed(file).map((r) => [r.command_id, r.state]),
      [
        ['cmd-1', 'finished'],
        ['cmd-2', 'finished'],
      ],
    );
    assert.equal(reopened.get('sb-1', 'cmd-1')?.result?.stdout, 'out cmd-1');
    assert.equal(journal(file), '');
  } finally {
    reopened.close();
    crashed.close();
    rmSync(dir, { recursive: true, force: true });
  }
});

test('a queued start that is deleted (its spawn failed) is never written; a committed one is removed', () => {
  const dir = mkdtempSync(join(tmpdir(), 'dsec-command-store-'));
  const file = join(dir, 'edge.db');
  const store = new CommandStore(file);
  try {
    store.insert(started(1), { durable: false });
    store.delete('cmd-1');
    store.insert(started(2), { durable: true });
    assert.deepEqual(
      committed(file).map((r) => r.command_id),
      ['cmd-2'],
    );
    store.delete('cmd-2');
    store.flush();
    assert.deepEqual(committed(file), []);
  } finally {
    store.close();
    rmSync(dir, { recursive: true, force: true });
  }
});

test('trim keeps the newest results of one sandbox, ties broken by insertion, and no other sandbox', () => {
  const dir = mkdtempSync(join(tmpdir(), 'dsec-command-store-'));
  const file = join(dir, 'edge.db');
  const store = new CommandStore(file);
  try {
    const at = (n: number) => new Date(1_700_000_000_000 + Math.floor(n / 2)).toISOString();
    for (let n = 0; n < 10; n++) {
      // Two results per millisecond: the tie on finishedAt is broken by insertion order.
      store.finish({ ...finished(started(n)), finishedAt: at(n) });
      store.finish({ ...finished({ ...started(n), sandboxId: 'sb-2', commandId: `other-${n}` }) });
    }
    store.insert(started(99));
    store.trim('sb-1', 3);
    store.flush();
    const ids = (sb: string) =>
      store
        .list(sb, 100)
        .map((c) => c.commandId)
        .sort();
    assert.deepEqual(ids('sb-1'), ['cmd-7', 'cmd-8', 'cmd-9', 'cmd-99'], 'a running command stays');
    assert.equal(ids('sb-2').length, 10);
    store.trim('sb-1', 0);
    store.flush();
    assert.deepEqual(ids('sb-1'), ['cmd-99']);
  } finally {
    store.close();
    rmSync(dir, { recursive: true, force: true });
  }
});
