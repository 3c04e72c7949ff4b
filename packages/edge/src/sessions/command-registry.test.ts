import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { CommandResult } from '@dsec/core';
import { isDsecError } from '@dsec/core';
import { CommandStore } from '../state/command-store.js';
import { CommandRegistry, type LiveCommand } from './command-registry.js';

async function withStore(fn: (file: string) => Promise<void>): Promise<void> {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-cmdlog-'));
  try {
    await fn(join(dir, 'edge.db'));
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
}

/** A runner that finishes when told to, counting how often it ran. */
function controllable() {
  let runs = 0;
  let finish!: (exitCode: number) => void;
  const runner = (live: LiveCommand) => {
    runs++;
    live.setStarted({ kill: () => finish(137), signal: () => undefined });
    live.stdout(Buffer.from('out'));
    return new Promise<CommandResult>((resolve) => {
      finish = (exitCode) =>
        resolve({
          commandId: live.info.commandId,
          exitCode,
          outcome: 'exited',
          stdout: 'out',
          stderr: '',
          truncated: false,
          stdoutBytes: 3,
          stderrBytes: 0,
          durationMs: 1,
        });
    });
  };
  return { runner, finish: (c: number) => finish(c), runs: () => runs };
}

test('a request ID runs at most once: concurrent retries attach, later ones get the record', async () => {
  await withStore(async (file) => {
    const store = new CommandStore(file);
    const reg = new CommandRegistry(store);
    const c = controllable();
    const a = reg.begin('sb1', { requestId: 'r1', argv: ['x'], background: false }, 100, c.runner);
    const b = reg.begin('sb1', { requestId: 'r1', argv: ['x'], background: false }, 100, c.runner);
    assert.ok('live' in a && 'live' in b);
    assert.equal(a.live, b.live);
    assert.equal(b.fresh, false);
    c.finish(0);
    const r = await a.live.result;
    const later = reg.begin(
      'sb1',
      { requestId: 'r1', argv: ['x'], background: false },
      100,
      c.runner,
    );
    assert.ok('recorded' in later);
    assert.equal(later.recorded.result?.commandId, r.commandId);
    // Another sandbox's identical request ID is a different command.
    const other = reg.begin(
      'sb2',
      { requestId: 'r1', argv: ['x'], background: false },
      100,
      c.runner,
    );
    assert.ok('live' in other && other.fresh);
    c.finish(1);
    await other.live.result;
    assert.equal(c.runs(), 2);
    store.close();
  });
});

test('results survive a restart; commands that were running are reported lost, not rerun', async () => {
  await withStore(async (file) => {
    let store = new CommandStore(file);
    let reg = new CommandRegistry(store);
    const done = controllable();
    const first = reg.begin(
      'sb1',
      { requestId: 'done', shell: 'a', background: true },
      100,
      done.runner,
    );
    assert.ok('live' in first);
    done.finish(7);
    await first.live.result;
    const hung = controllable();
    const second = reg.begin(
      'sb1',
      { requestId: 'hung', shell: 'b', background: true },
      100,
      hung.runner,
    );
    assert.ok('live' in second);
    store.close(); // the edge goes away with the command running

    store = new CommandStore(file);
    reg = new CommandRegistry(store);
    assert.equal(reg.get('sb1', first.live.info.commandId).result?.exitCode, 7);
    const lost = reg.get('sb1', second.live.info.commandId);
    assert.equal(lost.state, 'finished');
    assert.equal(lost.result?.outcome, 'killed');
    assert.match(lost.result?.reason ?? '', /restarted/);
    const retry = reg.begin(
      'sb1',
      { requestId: 'hung', shell: 'b', background: true },
      100,
      hung.runner,
    );
    assert.ok('recorded' in retry);
    assert.equal(hung.runs(), 1);
    assert.throws(
      () => reg.get('sb1', 'cmd-nope'),
      (e) => isDsecError(e, 'command_not_found'),
    );
    assert.throws(
      () => reg.get('sb2', first.live.info.commandId),
      (e) => isDsecError(e, 'command_not_found'),
    );
    store.close();
  });
});

test('finished results are purged after the retention and beyond the per-sandbox bound', async () => {
  await withStore(async (file) => {
    const store = new CommandStore(file);
    const reg = new CommandRegistry(store, { retentionMs: 60_000, maxPerSandbox: 3 });
    const ids: string[] = [];
    for (let i = 0; i < 5; i++) {
      const c = controllable();
      const b = reg.begin('sb1', { argv: ['x'], background: false }, 100, c.runner);
      assert.ok('live' in b);
      c.finish(i);
      ids.push((await b.live.result).commandId);
    }
    reg.sweep();
    assert.deepEqual(
      reg
        .list('sb1')
        .map((c) => c.commandId)
        .sort(),
      ids.slice(2).sort(),
    );
    reg.sweep(Date.now() + 120_000);
    assert.equal(reg.list('sb1').length, 0);
    store.close();
  });
});

test('a watcher gets what was captured so far, then live output', async () => {
  await withStore(async (file) => {
    const store = new CommandStore(file);
    const reg = new CommandRegistry(store);
    const c = controllable();
    const b = reg.begin('sb1', { argv: ['x'], background: true }, 4, c.runner);
    assert.ok('live' in b);
    b.live.stdout(Buffer.from('abcdefgh')); // past the cap: head and tail kept
    const seen: string[] = [];
    b.live.watch({ onStdout: (chunk) => seen.push(chunk.toString()) }, true);
    b.live.stdout(Buffer.from('live'));
    assert.deepEqual(seen, ['ough', 'live']);
    c.finish(0);
    await b.live.result;
    store.close();
  });
});

test('a request ID reused for another command is a conflict, while it runs and after', async () => {
  await withStore(async (file) => {
    const store = new CommandStore(file);
    const reg = new CommandRegistry(store);
    const c = controllable();
    const first = { requestId: 'r1', fingerprint: 'f1', argv: ['x'], background: false };
    const other = { ...first, fingerprint: 'f2', argv: ['y'] };
    const a = reg.begin('sb1', first, 100, c.runner);
    assert.ok('live' in a);
    const conflict = (err: unknown) =>
      isDsecError(err) && err.code === 'conflict' && err.field === 'requestId';
    assert.throws(() => reg.begin('sb1', other, 100, c.runner), conflict);
    c.finish(0);
    await a.live.result;
    assert.throws(() => reg.begin('sb1', other, 100, c.runner), conflict);
    // The same request again still gets the record; a legacy record without a fingerprint matches anything.
    assert.ok('recorded' in reg.begin('sb1', first, 100, c.runner));
    const legacy = reg.begin(
      'sb1',
      { requestId: 'r2', argv: ['x'], background: false },
      100,
      c.runner,
    );
    assert.ok('live' in legacy);
    c.finish(0);
    await legacy.live.result;
    assert.ok('recorded' in reg.begin('sb1', { ...other, requestId: 'r2' }, 100, c.runner));
    assert.equal(c.runs(), 2);
    store.close();
  });
});

test('onFinish hears every finished command once, background ones included; a throwing listener changes nothing', async () => {
  await withStore(async (file) => {
    const store = new CommandStore(file);
    const reg = new CommandRegistry(store);
    const heard: [boolean, string, number | null][] = [];
    reg.onFinish(() => {
      throw new Error('a broken metrics hook');
    });
    reg.onFinish((info, result) => heard.push([info.background, result.outcome, result.exitCode]));
    const fg = controllable();
    const bg = controllable();
    const a = reg.begin('sb1', { argv: ['fg'], background: false }, 100, fg.runner);
    const b = reg.begin('sb1', { argv: ['bg'], background: true }, 100, bg.runner);
    assert.ok('live' in a && 'live' in b);
    assert.deepEqual(heard, [], 'nothing has finished yet');
    bg.finish(3);
    const rb = await b.live.result;
    assert.equal(rb.exitCode, 3);
    assert.equal(reg.get('sb1', rb.commandId).state, 'finished');
    fg.finish(0);
    await a.live.result;
    assert.deepEqual(heard, [
      [true, 'exited', 3],
      [false, 'exited', 0],
    ]);
    // A command that never started is forgotten, not finished: no call.
    const never = reg.begin('sb1', { argv: ['x'], background: true }, 100, () =>
      Promise.reject(new Error('spawn failed')),
    );
    assert.ok('live' in never);
    await assert.rejects(never.live.result, /spawn failed/);
    assert.equal(heard.length, 2);
    store.close();
  });
});
