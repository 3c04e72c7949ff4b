import { after, test } from 'node:test';
import assert from 'node:assert/strict';
import type { AddressInfo } from 'node:net';
import { DsecError, type FnCallRequest } from '@dsec/core';
import { createTestApi, FakeEdge } from '../testing/index.js';
import { addFnCall } from '../testing/fncall-double.js';
import type { TestApi } from '../testing/index.js';
import { FnCallService } from '../fncall-service.js';
import { buildSandboxFusionListener } from './routes.js';
import { fromFnCall, runStatus, toFnCall, RunCodeBody, type SandboxFusionTask } from './service.js';

/** SandboxFusion's routes over FnCall doubles: mapping, keys, the keyless listener's project. */

const apis: TestApi[] = [];
const closers: (() => Promise<unknown>)[] = [];
after(async () => {
  for (const c of closers) await c();
  for (const a of apis) await a.close();
});

const b64 = (s: string) => Buffer.from(s).toString('base64');
/** A driver answer, as the driver prints it. */
function driverAnswer(task: SandboxFusionTask) {
  const step = (out: string, code: number) => ({
    status: 'Finished',
    execution_time: 0.01,
    return_code: code,
    stdout: b64(out),
    stderr: b64(''),
    truncated: false,
  });
  return JSON.stringify({
    compile: task.compile ? step('', 0) : null,
    run: step(`ran ${task.source}\n`, task.code.includes('fail') ? 1 : 0),
    files: Object.fromEntries(task.fetch_files.map((f) => [f, b64('x')])),
    skipped: {},
  });
}

async function setup() {
  const edge = addFnCall(new FakeEdge({ edgeId: 'edge-a' }));
  edge.fncallDouble.onCall = (req: FnCallRequest) => {
    if (!req.language.startsWith('sf-')) return { result: { stdout: `ran ${req.language}\n` } };
    const task = JSON.parse(req.stdin ?? '{}') as SandboxFusionTask;
    // A direct step's result is the program's own; else the driver's answer.
    return { result: { stdout: task.direct ? `ran ${task.source}\n` : driverAnswer(task) } };
  };
  const api = await createTestApi({ edges: [edge] });
  apis.push(api);
  return { api, edge };
}

const body = { language: 'python', code: 'print(1)' };

test("POST /sandboxfusion/run_code needs a key and answers SandboxFusion's shape", async () => {
  const { api, edge } = await setup();
  const anon = await api.app.inject({
    method: 'POST',
    url: '/sandboxfusion/run_code',
    payload: body,
  });
  assert.equal(anon.statusCode, 401);
  assert.equal(edge.fncallDouble.calls.length, 0);
  const res = await api.app.inject({
    method: 'POST',
    url: '/sandboxfusion/run_code',
    headers: { authorization: `Bearer ${api.rootKey}` },
    payload: { ...body, language: 'cpp', fetch_files: ['out.txt'], unknown_field: 1 },
  });
  assert.equal(res.statusCode, 200, res.body);
  assert.deepEqual(res.json(), {
    status: 'Success',
    message: '',
    compile_result: {
      status: 'Finished',
      execution_time: 0.01,
      return_code: 0,
      stdout: '',
      stderr: '',
    },
    run_result: {
      status: 'Finished',
      execution_time: 0.01,
      return_code: 0,
      stdout: 'ran main.cpp\n',
      stderr: '',
    },
    executor_pod_name: null,
    files: { 'out.txt': b64('x') },
  });
  const [sent] = edge.fncallDouble.calls;
  assert.equal(sent?.req.language, 'sf-gcc');
  assert.equal(sent?.projectId, api.rootProjectId);
  const ping = await api.app.inject({ method: 'GET', url: '/sandboxfusion/v1/ping' });
  assert.equal(ping.json(), 'pong');
  const langs = (await api.app.inject({ method: 'GET', url: '/sandboxfusion/languages' })).json<
    { language: string }[]
  >();
  for (const l of ['python', 'cpp', 'c', 'go', 'java', 'rust', 'nodejs', 'typescript', 'bash'])
    assert.ok(
      langs.some((x) => x.language === l),
      l,
    );
});

test('a key without fncall:run is refused on /sandboxfusion/run_code', async () => {
  const { api, edge } = await setup();
  const root = await api.iam.authenticate(api.rootKey);
  const scoped = await api.iam.createKey(root, {
    projectId: api.rootProjectId,
    scopes: ['images:run:task-*'],
  });
  const res = await api.app.inject({
    method: 'POST',
    url: '/sandboxfusion/run_code',
    headers: { authorization: `Bearer ${scoped.key}` },
    payload: body,
  });
  assert.equal(res.statusCode, 403);
  assert.equal(edge.fncallDouble.calls.length, 0);
});

test('the keyless listener runs every call in its project, whatever the request says', async () => {
  const { api, edge } = await setup();
  const root = await api.iam.authenticate(api.rootKey);
  const mine = await api.iam.createProject(root, { name: 'rl-team' });
  const other = await api.iam.createProject(root, { name: 'other-team' });
  const otherKey = await api.iam.createKey(root, { projectId: other.id });
  const fncall = new FnCallService({ edges: api.edges, watcher: api.watcher });
  const app = buildSandboxFusionListener({ fncall, projectId: mine.id });
  await app.listen({ host: '127.0.0.1', port: 0 });
  closers.push(() => app.close());
  const url = `http://127.0.0.1:${(app.server.address() as AddressInfo).port}`;
  for (const path of ['/run_code', '/sandboxfusion/run_code']) {
    const res = await fetch(url + path, {
      method: 'POST',
      headers: { 'content-type': 'application/json', authorization: `Bearer ${otherKey.key}` },
      body: JSON.stringify({ ...body, project: other.id, projectId: other.id }),
    });
    assert.equal(res.status, 200);
    assert.equal(((await res.json()) as { status: string }).status, 'Success');
  }
  assert.deepEqual(
    edge.fncallDouble.calls.map((c) => c.projectId),
    [mine.id, mine.id],
  );
  // Nothing but SandboxFusion's routes: no DSec API without a key.
  for (const [method, path] of [
    ['POST', '/v1/fncall'],
    ['GET', '/v1/sandboxes'],
    ['GET', '/v1/projects'],
    ['GET', '/metrics'],
  ] as const) {
    const res = await fetch(url + path, {
      method,
      headers: { 'content-type': 'application/json', authorization: `Bearer ${otherKey.key}` },
      ...(method === 'POST' ? { body: JSON.stringify({ language: 'python', code: '1' }) } : {}),
    });
    assert.equal(res.status, 404, path);
  }
  assert.equal(edge.fncallDouble.calls.length, 2);
  // A body over the limit (huge base64) is refused before anything runs.
  const huge = await fetch(`${url}/run_code`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ ...body, files: { 'a.bin': 'A'.repeat(2 * 1024 * 1024) } }),
  });
  assert.equal(huge.status, 413);
  assert.equal(
    ((await huge.json()) as { error: { code: string } }).error.code,
    'payload_too_large',
  );
  const bad = await fetch(`${url}/run_code`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ ...body, language: 'cobol' }),
  });
  assert.equal(bad.status, 400);
  assert.equal(((await bad.json()) as { error: { field: string } }).error.field, 'language');
  assert.equal(edge.fncallDouble.calls.length, 2);
});

test('a runtime whose image the edge lacks answers SandboxError, not an HTTP error', async () => {
  const { api, edge } = await setup();
  edge.fncallDouble.onCall = () => ({
    error: new DsecError('image_not_found', 'no layer fncall-sf-gcc'),
  });
  const res = await api.app.inject({
    method: 'POST',
    url: '/sandboxfusion/run_code',
    headers: { authorization: `Bearer ${api.rootKey}` },
    payload: { language: 'cpp', code: 'int main(){}' },
  });
  assert.equal(res.statusCode, 200);
  const r = res.json<{ status: string; message: string }>();
  assert.equal(r.status, 'SandboxError');
  assert.match(r.message, /sf-gcc/);
});

test('run status follows SandboxFusion: Error, then a time limit, then a non-zero code', () => {
  const fin = (code: number | null) =>
    ({ status: 'Finished', execution_time: 0, return_code: code, stdout: '', stderr: '' }) as const;
  assert.equal(runStatus(null, fin(0)).status, 'Success');
  assert.equal(runStatus(fin(0), fin(2)).status, 'Failed');
  assert.equal(runStatus(fin(1), null).status, 'Failed');
  assert.equal(runStatus(fin(0), { ...fin(null), status: 'TimeLimitExceeded' }).status, 'Failed');
  assert.deepEqual(runStatus({ ...fin(null), status: 'Error', stderr: 'boom' }, null), {
    status: 'SandboxError',
    message: 'boom',
  });
  // A call the platform failed (the driver died) is a SandboxError, never a Success.
  const died = fromFnCall({
    exitCode: -1,
    stdout: '',
    stderr: '',
    truncated: false,
    outcome: 'oom',
    durationMs: 0,
    reason: 'worker died',
  });
  assert.equal(died.status, 'SandboxError');
  assert.match(died.message, /oom/);
  const garbage = fromFnCall({
    exitCode: 0,
    stdout: 'not json',
    stderr: '',
    truncated: false,
    outcome: 'ok',
    durationMs: 0,
  });
  assert.equal(garbage.status, 'SandboxError');
  // A direct step: the call's own result; a signal is a negative return_code, a time limit none.
  const r = (outcome: 'ok' | 'timeout' | 'signaled' | 'output_limit', exitCode: number) =>
    fromFnCall(
      { exitCode, stdout: 'o', stderr: 'e', truncated: false, outcome, durationMs: 1500 },
      true,
    );
  assert.deepEqual(r('ok', 0).run_result, {
    status: 'Finished',
    return_code: 0,
    execution_time: 1.5,
    stdout: 'o',
    stderr: 'e',
  });
  assert.equal(r('ok', 2).status, 'Failed');
  assert.equal(r('signaled', 137).run_result?.return_code, -9);
  assert.equal(r('timeout', -1).run_result?.status, 'TimeLimitExceeded');
  assert.equal(r('timeout', -1).status, 'Failed');
  assert.equal(r('output_limit', -1).status, 'SandboxError');
});

test('toFnCall bounds: timeouts, memory, files, paths', () => {
  const parse = (b: Record<string, unknown>) => RunCodeBody.parse({ ...body, ...b });
  const { call, direct } = toFnCall(parse({ language: 'go', compile_timeout: 20, run_timeout: 5 }));
  assert.equal(call.language, 'sf-go');
  assert.equal(call.timeoutMs, 30_000);
  assert.equal(direct, false);
  // No compile step: compile_timeout does not count; one step and nothing to fetch is direct.
  const py = toFnCall(
    parse({ run_timeout: 2, compile_timeout: 200, files: { 'a.txt': b64('é') } }),
  );
  assert.equal(py.direct, true);
  // Text files only: FnCall's own python runtime, the files as text.
  assert.equal(py.call.language, 'python');
  assert.equal(py.call.code, 'print(1)');
  assert.deepEqual(py.call.files, { 'a.txt': 'é' });
  assert.equal(py.call.timeoutMs, 2_000);
  // A file that is not UTF-8 goes through the driver, which writes its bytes.
  const bin = toFnCall(
    parse({ run_timeout: 2, files: { 'a.bin': Buffer.from([0xff, 0]).toString('base64') } }),
  );
  assert.equal(bin.call.language, 'sf-base');
  assert.equal(bin.call.timeoutMs, 2_250);
  assert.equal(toFnCall(parse({ language: 'typescript' })).call.language, 'sf-node');
  assert.equal(toFnCall(parse({ run_timeout: 2, fetch_files: ['a'] })).call.timeoutMs, 7_000);
  assert.throws(
    () => toFnCall(parse({ language: 'c', compile_timeout: 200, run_timeout: 200 })),
    /290/,
  );
  assert.throws(() => parse({ run_timeout: -1 }));
  assert.throws(() => parse({ run_timeout: 1e9 }));
  assert.throws(() => parse({ fetch_files: ['a/../../b'] }));
  assert.throws(() => parse({ files: { '': b64('x') } }));
  assert.throws(() => toFnCall(parse({ files: { a: 'A'.repeat(1024 * 1024 + 4) } })), /bytes/);
  const driven = (b: Record<string, unknown>) =>
    JSON.parse(toFnCall(parse({ fetch_files: ['out'], ...b })).call.stdin!) as SandboxFusionTask;
  const task = driven({ files: { a: null, b: b64('y') } });
  assert.deepEqual(task.files, { b: b64('y') });
  assert.equal(task.memory_mb, -1);
  assert.equal(driven({ memory_limit_MB: 256 }).memory_mb, 256);
  assert.equal(toFnCall(parse({ memory_limit_MB: 256 })).call.memoryMb, 256);
  const php = JSON.parse(
    toFnCall(parse({ language: 'php', code: 'echo 1;' })).call.stdin!,
  ) as SandboxFusionTask;
  assert.equal(php.code, '<?php\necho 1;');
});
