import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import Database from 'better-sqlite3';
import type { SandboxSpec } from '@dsec/core';
import { EdgeStore } from './edge-store.js';

const SPEC: SandboxSpec = {
  backend: 'container',
  image: 'busybox',
  toolkits: [],
  memoryLimitMb: 64,
  cpuCoresLimit: 1,
  pidsLimit: 64,
  ttlSeconds: 60,
  networkRules: {},
  initUser: 'root',
  env: {},
  labels: {},
};

test('a database from before the pause columns is upgraded in place, its rows kept', () => {
  const dir = mkdtempSync(join(tmpdir(), 'dsec-edge-store-'));
  try {
    const file = join(dir, 'edge.db');
    // The first release's table, with one sandbox in it.
    const old = new Database(file);
    old.exec(`CREATE TABLE sandboxes (
      id TEXT PRIMARY KEY, project_id TEXT NOT NULL, request_id TEXT, state TEXT NOT NULL,
      spec TEXT NOT NULL, layers TEXT NOT NULL, slot INTEGER NOT NULL, created_at TEXT NOT NULL,
      expires_at TEXT NOT NULL, runtime_pid INTEGER, init_pid INTEGER, chronus_pid INTEGER,
      reason TEXT)`);
    old
      .prepare(
        `INSERT INTO sandboxes (id, project_id, state, spec, layers, slot, created_at, expires_at)
         VALUES ('sb-old', 'p1', 'running', ?, '[]', 0, '2026-01-01T00:00:00.000Z', '2026-01-01T01:00:00.000Z')`,
      )
      .run(JSON.stringify(SPEC));
    old.close();

    const store = new EdgeStore(file);
    const rec = store.get('sb-old');
    assert.equal(rec?.state, 'running');
    assert.equal(rec?.pausedAt, undefined);
    assert.equal(rec?.intent, undefined);
    store.setLifecycle('sb-old', { intent: 'pause' });
    assert.equal(store.get('sb-old')?.intent, 'pause');
    store.setLifecycle('sb-old', {
      state: 'paused',
      pausedAt: '2026-01-01T00:10:00.000Z',
      pausedExpiresAt: '2026-01-02T00:10:00.000Z',
      intent: null,
    });
    const paused = store.get('sb-old');
    assert.deepEqual(
      [paused?.state, paused?.pausedAt, paused?.pausedExpiresAt, paused?.intent],
      ['paused', '2026-01-01T00:10:00.000Z', '2026-01-02T00:10:00.000Z', undefined],
    );
    // null clears; a field not given is left alone.
    store.setLifecycle('sb-old', { state: 'running', pausedAt: null, pausedExpiresAt: null });
    const back = store.get('sb-old');
    assert.deepEqual(
      [back?.state, back?.pausedAt, back?.expiresAt],
      ['running', undefined, '2026-01-01T01:00:00.000Z'],
    );
    store.close();
    // Opening again finds the columns there and changes nothing.
    const again = new EdgeStore(file);
    assert.equal(again.get('sb-old')?.state, 'running');
    again.close();
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
