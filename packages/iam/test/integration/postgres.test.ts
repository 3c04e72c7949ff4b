// The control-database conformance suite against a real PostgreSQL server
// (scripts/postgres.sh), started once for this file and stopped after it,
// whether its tests pass or fail. Each test gets a database of its own.
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { isDsecError } from '@dsec/core';
import { openControlDb } from '@dsec/iam';
import { controlDbConformance, startPostgres } from '@dsec/iam/testing';
import type { PostgresServer } from '@dsec/iam/testing';

let server: PostgresServer | undefined;
before(async () => {
  server = await startPostgres();
});
after(async () => {
  await server?.stop();
});

const running = (): PostgresServer => {
  if (!server) throw new Error('the PostgreSQL server did not start');
  return server;
};

controlDbConformance('PostgreSQL', { fresh: () => running().newDatabase() });

test('a PostgreSQL URL opens a PostgreSQL store', async (t) => {
  const db = await openControlDb(await running().newDatabase());
  t.after(() => db.close());
  assert.equal(db.kind, 'postgres');
});

test('an unreachable server is `unavailable`, and the message hides the password', async () => {
  // Port 1 on loopback: nothing listens there.
  const url = new URL(running().url);
  url.port = '1';
  url.password = 'hunter2';
  await assert.rejects(
    openControlDb(url.toString(), { connectTimeoutMs: 2000 }),
    (e) =>
      isDsecError(e, 'unavailable') && !e.message.includes('hunter2') && e.message.includes('***'),
  );
});
