import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { isDsecError, type CommandResult, type EdgeApi } from '@dsec/core';
import { FakeEdge } from '@dsec/apiserver/testing';
import { newEdgeSecret, serveEdge } from '@dsec/edge-http';
import { makeTestCertificate } from '@dsec/edge-http/testing';
import { openControlDb } from '@dsec/iam';
import { RegistryFleet } from './fleet.js';

/*
 * A certificate rotation as docs/cluster.md "TLS" tells it: join again with
 * the old and the new pin, and every apiserver takes the new pins within
 * `registryRefreshMs`. That must not cut the calls already running to the
 * edge (a command cut is a command killed); a pin withdrawn must.
 */

const EDGE = 'edge-rot';

/** A served TLS edge whose commands run until `release`, and a registry with its pin. */
async function setting(t: { after(fn: () => unknown): void }) {
  const dir = await mkdtemp(join(tmpdir(), 'dsec-fleet-rot-'));
  const certA = await makeTestCertificate(dir, 'edge-a');
  const certB = await makeTestCertificate(dir, 'edge-b');
  const fake = new FakeEdge({ edgeId: EDGE });
  const waiting: (() => void)[] = [];
  let started = 0;
  const edge: EdgeApi = {
    edgeId: EDGE,
    status: (s) => fake.status(s),
    createSandbox: (r, s) => fake.createSandbox(r, s),
    getSandbox: (id, s) => fake.getSandbox(id, s),
    listSandboxes: (f, s) => fake.listSandboxes(f, s),
    stopSandbox: (id, s) => fake.stopSandbox(id, s),
    runCommand: async (_id, _c, o = {}) => {
      started++;
      await new Promise<void>((resolve, reject) => {
        waiting.push(resolve);
        o.signal?.addEventListener('abort', () => reject(new Error('the client went away')));
      });
      const r: CommandResult = {
        commandId: 'cmd-long',
        exitCode: 0,
        outcome: 'exited',
        stdout: 'done\n',
        stderr: '',
        truncated: false,
        stdoutBytes: 5,
        stderrBytes: 0,
        durationMs: 1,
      };
      return r;
    },
  };
  const secret = newEdgeSecret();
  const server = await serveEdge({ edge, secret, tls: { cert: certA.cert, key: certA.key } });
  const db = await openControlDb(join(dir, 'control.db'));
  const register = (tlsPins: string[]) =>
    db.edges.register({
      edgeId: EDGE,
      url: server.url,
      secret,
      labels: {},
      backends: ['container'],
      tlsPins,
    });
  await register([certA.sha256]);
  const fleet = new RegistryFleet({ registry: db.edges, refreshMs: 3_600_000 });
  await fleet.refresh();
  t.after(async () => {
    fleet.close();
    for (const release of waiting.splice(0)) release();
    await server.close();
    await db.close();
    await rm(dir, { recursive: true, force: true });
  });
  const until = async (n: number) => {
    while (started < n) await new Promise((r) => setTimeout(r, 10));
  };
  const release = () => {
    for (const r of waiting.splice(0)) r();
  };
  return { fleet, register, certA, certB, until, release };
}

test('a pin added to the registry (a rotation) leaves the calls in flight running', async (t) => {
  const s = await setting(t);
  const before = s.fleet.edge(EDGE)!;
  const running = before.runCommand('sb-1', { argv: ['sleep', '600'] });
  await s.until(1);
  await s.register([s.certA.sha256, s.certB.sha256]);
  await s.fleet.refresh();
  assert.notEqual(s.fleet.edge(EDGE), before, 'a new client with the new pins');
  // New calls take the new client, over the same (still pinned) certificate.
  assert.equal((await s.fleet.edge(EDGE)!.status()).edgeId, EDGE);
  s.release();
  const r = await running;
  assert.equal(r.stdout, 'done\n', 'the command in flight finished');
  // The retired client starts nothing more.
  await assert.rejects(before.status(), (e) => isDsecError(e, 'unavailable'));
});

test('a pin withdrawn from the registry cuts the calls in flight on its certificate', async (t) => {
  const s = await setting(t);
  const running = s.fleet.edge(EDGE)!.runCommand('sb-1', { argv: ['sleep', '600'] });
  running.catch(() => undefined);
  await s.until(1);
  // As if the edge's key had leaked: only the new certificate is accepted from now on.
  await s.register([s.certB.sha256]);
  await s.fleet.refresh();
  await assert.rejects(running, (e) => isDsecError(e, 'unavailable'));
  await assert.rejects(
    s.fleet.edge(EDGE)!.status(),
    (e) => isDsecError(e, 'unavailable') && e.details?.reason === 'edge_certificate',
  );
});
