import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import Database from 'better-sqlite3';
import { CommandStore } from '../../src/state/command-store.js';

/**
 * SECURITY E28: kill -9 during a burst of writes to the state databases (IAM,
 * the edge's sandbox records and command log). After each kill the databases
 * pass `PRAGMA integrity_check` and hold every write the child acknowledged.
 */
async function burstThenKill(dir: string, killAfterMs: number): Promise<string[]> {
  const child = spawn(
    process.execPath,
    [
      '--conditions=dsec-source',
      '--import',
      'tsx',
      new URL('./state-db-crash-child.ts', import.meta.url).pathname,
      dir,
    ],
    { stdio: ['ignore', 'pipe', 'inherit'] },
  );
  let out = '';
  child.stdout.setEncoding('utf8').on('data', (s: string) => (out += s));
  const exited = new Promise<NodeJS.Signals | null>((resolve) =>
    child.once('exit', (_code, signal) => resolve(signal)),
  );
  for (let i = 0; i < 200 && !out.includes('ready\n'); i++) await sleep(50);
  assert.ok(out.includes('ready\n'), 'the child started');
  await sleep(killAfterMs);
  child.kill('SIGKILL');
  assert.equal(await exited, 'SIGKILL');
  // Only complete lines were acknowledged.
  return out
    .split('\n')
    .slice(0, -1)
    .filter((l) => l !== 'ready');
}

function check(file: string, query: string, ids: string[]): void {
  const db = new Database(file, { readonly: true });
  try {
    assert.equal(db.pragma('integrity_check', { simple: true }), 'ok', `${file} integrity`);
    const stmt = db.prepare(query);
    const missing = ids.filter((id) => stmt.get(id) === undefined);
    assert.deepEqual(missing, [], `${file}: acknowledged rows missing`);
  } finally {
    db.close();
  }
}

test('kill -9 during a burst of state writes: integrity holds and every acknowledged write is there', async () => {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-state-crash-'));
  try {
    let total = 0;
    for (const killAfterMs of [150, 400, 900]) {
      const acks = await burstThenKill(dir, killAfterMs);
      const of = (kind: string) =>
        acks.filter((l) => l.startsWith(`${kind} `)).map((l) => l.slice(2));
      assert.ok(of('P').length > 0, 'the child wrote before it was killed');
      check(join(dir, 'iam.db'), 'SELECT 1 FROM projects WHERE id = ?', of('P'));
      check(join(dir, 'edge.db'), 'SELECT 1 FROM sandboxes WHERE id = ?', of('S'));
      // Foreground results acknowledged last are in the command log's journal until the
      // store opens again (as the restarted edge's does) and moves them into the table.
      new CommandStore(join(dir, 'edge.db')).close();
      check(join(dir, 'edge.db'), 'SELECT 1 FROM commands WHERE command_id = ?', of('C'));
      check(
        join(dir, 'edge.db'),
        "SELECT 1 FROM commands WHERE command_id = ? AND state = 'finished' AND result IS NOT NULL",
        of('R'),
      );
      total += acks.length;
    }
    assert.ok(total > 30, `${total} acknowledged writes checked`);
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});
