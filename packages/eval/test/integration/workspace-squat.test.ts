import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { chmod, mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { startSingleNode, type SingleNode } from '@dsec/cluster';
import { makeBusyboxRootfs } from '@dsec/images';
import { main } from '@dsec/cli/main';
import { loadTasks, workspaceLayerName, type EvalResult } from '../../src/index.js';
import { makeShellTaskSet, type ShellTaskSet } from '../../src/testing/index.js';

/*
 * SECURITY (issue 24, point 2; SECURITY.md I37): a task's workspace layer is
 * named from public facts (`ws-<repo>-<commit12>`), so any tenant can know
 * it. Tenant B snapshots a sandbox under every workspace name of a task set
 * before the operator prepares it. `dsec eval prepare` must still build the
 * platform's workspaces (B's layers are B's, not the platform's), and an
 * evaluation run by another tenant must run on them: gold solves every task.
 */

let node: SingleNode;
let work: string;
let set: ShellTaskSet;
let evaluatorKey: string;

async function dsec(args: string[], apiKey: string) {
  const run = { code: -1, stdout: '', stderr: '' };
  run.code = await main(['--state-dir', join(work, 'state'), ...args], {
    stdout: { write: (s: string) => (run.stdout += s) },
    stderr: { write: (s: string) => (run.stderr += s) },
    env: { DSEC_URL: node.url, DSEC_API_KEY: apiKey },
  });
  return run;
}

async function call(key: string, method: string, path: string, body?: unknown) {
  const res = await fetch(node.url + path, {
    method,
    headers: {
      authorization: `Bearer ${key}`,
      ...(body !== undefined ? { 'content-type': 'application/json' } : {}),
    },
    ...(body !== undefined ? { body: JSON.stringify(body) } : {}),
  });
  const text = await res.text();
  return { status: res.status, body: (text ? JSON.parse(text) : {}) as Record<string, unknown> };
}

async function tenantKey(name: string): Promise<string> {
  const p = await call(node.adminKey, 'POST', '/v1/projects', { name });
  assert.equal(p.status, 201, JSON.stringify(p.body));
  const k = await call(node.adminKey, 'POST', '/v1/keys', { projectId: p.body.id, role: 'admin' });
  assert.equal(k.status, 201, JSON.stringify(k.body));
  return k.body.key as string;
}

before(async () => {
  work = await mkdtemp(join(tmpdir(), 'dsec-eval-squat-'));
  await chmod(work, 0o711);
  node = await startSingleNode({ stateDir: join(work, 'state'), port: 0, edgeId: 'squat-node' });
  const rootfs = join(work, 'rootfs');
  await makeBusyboxRootfs(rootfs);
  await node.buildLayer({ name: 'busybox', kind: 'base', from: { dir: rootfs } });
  set = await makeShellTaskSet(join(work, 'tasks'), { image: 'busybox' });
  evaluatorKey = await tenantKey('evaluator');
});

after(async () => {
  await node?.close({ stopSandboxes: true });
  await rm(work, { recursive: true, force: true });
});

test('a tenant squatting every workspace name of a task set breaks neither prepare nor the run', async () => {
  const squatter = await tenantKey('squatter');
  const { tasks } = await loadTasks(set.tasksFile);
  const wsNames = [...new Set(tasks.map(workspaceLayerName))];
  assert.equal(wsNames.length, 3);
  const sb = await call(squatter, 'POST', '/v1/sandboxes', { image: 'busybox', memoryLimitMb: 64 });
  assert.equal(sb.status, 201, JSON.stringify(sb.body));
  const id = sb.body.id as string;
  // The squatter's tree answers every test: a workspace that "passes" without a fix.
  const r = await call(squatter, 'POST', `/v1/sandboxes/${id}/commands`, {
    shell: 'mkdir -p /testbed/tests && echo "echo 1..0" > /testbed/tests/run.sh',
  });
  assert.equal(r.status, 200, JSON.stringify(r.body));
  for (const name of wsNames) {
    const snap = await call(squatter, 'POST', `/v1/sandboxes/${id}/snapshot`, { name });
    assert.equal(snap.status, 201, JSON.stringify(snap.body));
  }

  const prepared = await dsec(['--json', 'eval', 'prepare', set.tasksFile], node.adminKey);
  assert.equal(prepared.code, 0, prepared.stderr);
  const report = JSON.parse(prepared.stdout) as { built: string[]; present: string[] };
  assert.deepEqual(report.built.sort(), [...wsNames].sort(), 'the platform’s workspaces are built');
  for (const name of wsNames) {
    const layer = await node.store.getLayer(name);
    assert.equal(layer.kind, 'workspace');
    assert.equal(layer.project, undefined);
  }

  // Another tenant's evaluation runs on the platform's workspaces: gold 1, none 0.
  const goldOut = join(work, 'gold.jsonl');
  const gold = await dsec(
    ['--json', 'eval', 'run', set.tasksFile, '--agent', 'gold', '--out', goldOut, '--no-prepare'],
    evaluatorKey,
  );
  assert.equal(gold.code, 0, gold.stderr);
  const rs = readFileSync(goldOut, 'utf8')
    .trim()
    .split('\n')
    .map((l) => JSON.parse(l) as EvalResult);
  assert.deepEqual(
    rs.map((x) => [x.instance_id, x.reward, x.error]),
    rs.map((x) => [x.instance_id, 1, undefined]),
  );
  const noneOut = join(work, 'none.jsonl');
  const none = await dsec(
    ['--json', 'eval', 'run', set.tasksFile, '--agent', 'none', '--out', noneOut, '--no-prepare'],
    evaluatorKey,
  );
  assert.equal(none.code, 0, none.stderr);
  assert.equal((JSON.parse(none.stdout) as { solved: number }).solved, 0);

  // The squatter's own create of the name still gets its own snapshot (nobody else's changed).
  const own = await call(squatter, 'POST', '/v1/sandboxes', {
    image: wsNames[0],
    memoryLimitMb: 64,
  });
  assert.equal(own.status, 201, JSON.stringify(own.body));
});
