import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
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

test('grouped results are committed when their promises resolve, with starts that were still queued', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'dsec-command-store-'));
  const file = join(dir, 'edge.db');
  const store = new CommandStore(file);
  try {
    const infos = [1, 2, 3].map(started);
    for (const info of infos) store.insert(info, { durable: false });
    assert.deepEqual(committed(file), [], 'foreground starts wait for their results');
    const done = infos.map((info) => store.finishGrouped(finished(info)));
    assert.deepEqual(committed(file), [], 'nothing is committed before the turn ends');
    await Promise.all(done);
    const rows = committed(file);
    assert.deepEqual(
      rows.map((r) => [r.command_id, r.state]),
      infos.map((i) => [i.commandId, 'finished']),
    );
    assert.equal((JSON.parse(rows[0]!.result!) as CommandResult).stdout, 'out cmd-1');
    // The queued starts, written now, leave the results as they are.
    store.flush();
    assert.deepEqual(
      committed(file).map((r) => r.state),
      ['finished', 'finished', 'finished'],
    );
    assert.equal(store.get('sb-1', 'cmd-2')?.result?.stdout, 'out cmd-2');
  } finally {
    store.close();
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
