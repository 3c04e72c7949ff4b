import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, test } from 'node:test';
import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';
import Database from 'better-sqlite3';
import type { SandboxEventKind } from '@dsec/core';
import { EventLog, type EventLogOptions } from './event-log.js';

const dir = mkdtempSync(join(tmpdir(), 'dsec-event-log-'));
after(() => rmSync(dir, { recursive: true, force: true }));
let files = 0;
const newFile = () => join(dir, `events-${++files}.db`);

function open(options: EventLogOptions = {}): { log: EventLog; file: string } {
  const file = newFile();
  return { log: new EventLog(file, options), file };
}

/** Rows in the file as another connection sees them (no flush on the way, unlike `list`). */
function storedRows(file: string): number {
  const db = new Database(file, { readonly: true });
  try {
    return (db.prepare('SELECT count(*) AS n FROM events').get() as { n: number }).n;
  } finally {
    db.close();
  }
}

const turn = () => new Promise<void>((resolve) => setImmediate(resolve));

/** A full collection, for heap measures (the flag is set before the first use). */
function collect(): void {
  setFlagsFromString('--expose-gc');
  (runInNewContext('gc') as () => void)();
}

test('events are kept per sandbox up to the cap, repeats folded into a count', () => {
  const { log } = open({ maxPerSandbox: 3 });
  for (let i = 0; i < 5; i++) log.record('a', 'network_denied', `denied ${i}`, { i });
  log.record('b', 'dns_blocked', 'blocked', {}, 'evil.test');
  log.record('b', 'dns_blocked', 'blocked', {}, 'evil.test');
  log.record('b', 'dns_blocked', 'blocked', {}, 'evil.test');
  const a = log.list('a');
  assert.deepEqual(
    a.map((e) => e.message),
    ['denied 2', 'denied 3', 'denied 4'],
  );
  assert.deepEqual(a[0]?.details, { i: 2 });
  const b = log.list('b');
  assert.equal(b.length, 1);
  assert.equal(b[0]?.count, 1);
  assert.deepEqual(
    log.list('a', a[0]?.id, 1).map((e) => e.message),
    ['denied 3'],
  );
  log.purge(new Set(['b']));
  assert.deepEqual(log.list('a'), []);
  assert.equal(log.list('b').length, 1);
  log.close();
});

test('a repeat after the window carries the count of those folded within it', async () => {
  const { log } = open({ dedupeWindowMs: 1000 });
  log.record('a', 'network_denied', 'x', {}, 'k');
  log.record('a', 'network_denied', 'x', {}, 'k');
  log.record('a', 'network_denied', 'x', {}, 'k');
  const start = Date.now();
  while (Date.now() - start < 1100) await new Promise((resolve) => setTimeout(resolve, 50));
  log.record('a', 'network_denied', 'x', {}, 'k');
  assert.deepEqual(
    log.list('a').map((e) => e.count),
    [1, 3],
  );
  log.close();
});

test('readers see every event recorded before they asked, without waiting for the interval', () => {
  // An hour's interval and a batch no test reaches: only the reader's own flush writes.
  const { log, file } = open({ flushIntervalMs: 3_600_000, flushBatch: 1_000_000 });
  for (let i = 0; i < 50; i++) log.record(i % 2 ? 'a' : 'b', 'network_denied', `e${i}`);
  assert.equal(storedRows(file), 0, 'record writes nothing itself');
  assert.deepEqual(log.queued.events, 50);
  assert.equal(log.list('a').length, 25);
  assert.equal(storedRows(file), 50, 'the reader wrote the queue, both sandboxes');
  log.record('b', 'oom_killed', 'late');
  log.purge(new Set(['b']));
  assert.equal(log.list('b').at(-1)?.message, 'late', 'purge writes the queue before it judges');
  log.close();
});

test('the queue is written after the interval, and at once past a batch', async () => {
  const { log, file } = open({ flushIntervalMs: 1, flushBatch: 1_000_000 });
  log.record('a', 'network_denied', 'one');
  while (storedRows(file) === 0) await turn();
  assert.equal(log.queued.events, 0);
  log.close();

  const batched = open({ flushIntervalMs: 3_600_000, flushBatch: 10 });
  for (let i = 0; i < 25; i++) batched.log.record('a', 'network_denied', `e${i}`);
  assert.equal(storedRows(batched.file), 0, "not on the recording caller's stack");
  await turn();
  await turn();
  assert.equal(storedRows(batched.file), 25, 'one write for the whole queue, on the next turn');
  batched.log.close();
});

test('record never waits for the database: another writer holding it costs the caller nothing', () => {
  const { log, file } = open({ flushIntervalMs: 3_600_000 });
  const other = new Database(file);
  other.pragma('busy_timeout = 0');
  other.exec('BEGIN IMMEDIATE');
  // Before the batching, each record inserted at once: it waited the 5 s busy timeout, then threw SQLITE_BUSY.
  for (let i = 0; i < 100; i++) log.record('a', 'network_denied', `e${i}`);
  assert.equal(log.queued.events, 100);
  other.exec('COMMIT');
  other.close();
  assert.equal(log.list('a').length, 100);
  assert.equal(log.dropped, 0);
  log.close();
});

test('a write that fails drops its batch, counted, and never throws from the timer', async () => {
  const dropped: SandboxEventKind[] = [];
  const { log, file } = open({ flushIntervalMs: 1, onDrop: (kind) => dropped.push(kind) });
  const other = new Database(file);
  other.exec('BEGIN IMMEDIATE');
  log.record('a', 'network_denied', 'one');
  log.record('a', 'dns_blocked', 'two');
  // The timer's write waits out the busy timeout (5 s), fails, and drops the two.
  while (log.dropped < 2) await new Promise((resolve) => setTimeout(resolve, 50));
  other.exec('ROLLBACK');
  other.close();
  assert.deepEqual(dropped, ['network_denied', 'dns_blocked']);
  assert.equal((log.lastWriteError as { code?: string }).code, 'SQLITE_BUSY');
  log.record('a', 'oom_killed', 'three');
  assert.deepEqual(
    log.list('a').map((e) => e.message),
    ['three'],
  );
  log.close();
});

test('a flood of events costs bounded memory: the queue is capped in events and bytes, the rest counted', () => {
  const dropped = new Map<string, number>();
  let recorded = 0;
  const { log } = open({
    flushIntervalMs: 3_600_000,
    flushBatch: 1_000_000,
    maxPerSandbox: 100_000,
    onRecord: () => recorded++,
    onDrop: (kind) => dropped.set(kind, (dropped.get(kind) ?? 0) + 1),
  });
  collect();
  const heapBefore = process.memoryUsage().heapUsed;
  // One synchronous burst: no write can run between these records, the worst case for the queue.
  const n = 50_000;
  const big = 'x'.repeat(20_000);
  for (let i = 0; i < n; i++) log.record('a', 'network_denied', `denied ${i}`, { i, big });
  collect();
  const grownBytes = process.memoryUsage().heapUsed - heapBefore;
  const { events, bytes } = log.queued;
  assert.ok(bytes <= 4 * 2 ** 20, `queued ${bytes} B`);
  assert.ok(events > 0 && events <= 4096, `queued ${events}`);
  assert.equal(log.dropped, n - events);
  assert.equal(dropped.get('network_denied'), n - events);
  assert.equal(recorded, n, 'metrics count every occurrence, dropped ones too');
  // Unbounded, the queue would hold 50,000 × ~8 KB: 400 MB.
  assert.ok(grownBytes < 64 * 2 ** 20, `heap grew ${grownBytes} B`);
  const stored = log.list('a', 0, 1000);
  assert.equal(stored[0]?.message, 'denied 0', 'the oldest are kept, the newest dropped');
  // Details past 8 KiB keep their head, as JSON a reader can parse.
  assert.deepEqual(Object.keys(stored[0]?.details ?? {}), ['truncated', 'chars', 'head']);
  assert.equal(stored[0]?.details.truncated, true);
  log.close();

  // The count cap, for small events.
  const small = open({ flushIntervalMs: 3_600_000, flushBatch: 1_000_000, maxQueued: 100 });
  for (let i = 0; i < 1000; i++) small.log.record('a', 'network_denied', `e${i}`);
  assert.equal(small.log.queued.events, 100);
  assert.equal(small.log.dropped, 900);
  small.log.close();
});

test('a queued event holds only what it stores, not the long string it was cut from', () => {
  const { log } = open({ flushIntervalMs: 3_600_000, flushBatch: 1_000_000 });
  collect();
  const heapBefore = process.memoryUsage().heapUsed;
  // 1,500 messages of 256 KiB each, all within the byte cap once cut to 1,024: a plain
  // slice would keep each whole message alive (375 MiB).
  for (let i = 0; i < 1500; i++) log.record('a', 'network_denied', `${i} `.padEnd(256 * 1024, 'm'));
  collect();
  const grownBytes = process.memoryUsage().heapUsed - heapBefore;
  assert.equal(log.queued.events, 1500);
  assert.ok(grownBytes < 64 * 2 ** 20, `heap grew ${grownBytes} B`);
  const [first] = log.list('a', 0, 1);
  assert.equal(first?.message.length, 1024);
  log.close();
});

test('a flood spread over turns of the loop is written in batches and loses nothing', async () => {
  const { log, file } = open({ flushIntervalMs: 3_600_000, flushBatch: 64, maxQueued: 256 });
  let peak = 0;
  for (let i = 0; i < 5000; i++) {
    log.record(`s${i % 7}`, 'network_denied', `e${i}`);
    peak = Math.max(peak, log.queued.events);
    if (i % 32 === 31) await turn();
  }
  assert.equal(log.dropped, 0);
  assert.ok(peak <= 64, `peak queue ${peak}`);
  await turn();
  // All written but the tail the interval has not reached yet.
  assert.ok(log.queued.events < 64);
  assert.equal(storedRows(file), 5000 - log.queued.events);
  log.close();
});

test('distinct repeat keys in one window keep the folding map bounded and every event stored', () => {
  const { log } = open({
    flushIntervalMs: 3_600_000,
    maxPerSandbox: 100_000,
    maxQueued: 100_000,
    maxQueuedBytes: 2 ** 30,
  });
  // 30,000 distinct keys (a sandbox probing distinct addresses): the map forgets the oldest.
  for (let i = 0; i < 30_000; i++) log.record('a', 'network_denied', `e${i}`, {}, `10.0.${i}`);
  log.record('a', 'network_denied', 'again', {}, '10.0.0');
  log.record('a', 'network_denied', 'again', {}, '10.0.29999');
  const messages = log.list('a', 29_990, 1000).map((e) => e.message);
  // The oldest key was forgotten (stored again); the newest is still folded.
  assert.deepEqual(messages.slice(-1), ['again']);
  assert.equal(messages.filter((m) => m === 'again').length, 1);
  assert.equal(log.dropped, 0);
  log.close();
});

test('close writes the queue; events after it are dropped, not thrown', () => {
  const { log, file } = open({ flushIntervalMs: 3_600_000, flushBatch: 1_000_000 });
  for (let i = 0; i < 10; i++) log.record('a', 'command_timeout', `t${i}`);
  log.close();
  log.close();
  log.record('a', 'command_timeout', 'after close');
  assert.equal(log.dropped, 1);
  const reopened = new EventLog(file);
  assert.deepEqual(
    reopened.list('a').map((e) => e.message),
    Array.from({ length: 10 }, (_, i) => `t${i}`),
  );
  reopened.close();
});
