import { after, before, beforeEach, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { DsecError } from '@dsec/core';
import { startTestServer } from '@dsec/apiserver/testing';
import type { TestServer } from '@dsec/apiserver/testing';
import { main } from '../main.js';

// `dsec fncall` against the real apiserver over an in-process FnCall double (stdin echoed).
let server: TestServer;
let dir: string;

before(async () => {
  server = await startTestServer();
  dir = await mkdtemp(join(tmpdir(), 'dsec-cli-fncall-'));
});
after(async () => {
  await server.close();
  await rm(dir, { recursive: true, force: true });
});
beforeEach(() => {
  server.edge.fncallDouble.onCall = undefined;
  server.edge.fncallDouble.calls.length = 0;
});

async function dsec(args: string[]) {
  const run = { code: -1, stdout: '', stderr: '' };
  run.code = await main(args, {
    stdout: { write: (s: string) => (run.stdout += s) },
    stderr: { write: (s: string) => (run.stderr += s) },
    env: { DSEC_URL: server.url, DSEC_API_KEY: server.key, DSEC_STATE_DIR: dir },
  });
  return run;
}

test('run sends the file, stdin, args and limits; prints output; exits with the exit code', async () => {
  const program = join(dir, 'sum.py');
  await writeFile(program, 'print(sum(map(int, input().split())))\n');
  server.edge.fncallDouble.onCall = () => ({
    result: { stdout: '3\n', stderr: 'warn\n', exitCode: 7 },
  });
  const r = await dsec([
    'fncall',
    'run',
    '--language',
    'python',
    '--stdin',
    '1 2',
    '--arg',
    'a',
    '--arg',
    'b',
    '--timeout-ms',
    '2000',
    '--memory-mb',
    '128',
    '--network',
    '--',
    program,
  ]);
  assert.equal(r.code, 7);
  assert.equal(r.stdout, '3\n');
  assert.equal(r.stderr, 'warn\n');
  assert.deepEqual(server.edge.fncallDouble.calls[0]?.req, {
    language: 'python',
    code: 'print(sum(map(int, input().split())))\n',
    stdin: '1 2',
    args: ['a', 'b'],
    timeoutMs: 2000,
    memoryMb: 128,
    network: true,
  });
});

test('run --json prints the FnCallResult and exits 0; a timeout exits 124', async () => {
  const program = join(dir, 'loop.py');
  await writeFile(program, 'while True: pass\n');
  const stdinFile = join(dir, 'in.txt');
  await writeFile(stdinFile, 'from a file\n');
  server.edge.fncallDouble.onCall = () => ({
    result: { exitCode: 137, outcome: 'timeout', reason: 'ran past 50 ms' },
  });
  const json = await dsec([
    'fncall',
    'run',
    '--json',
    '--language',
    'python',
    '--stdin-file',
    stdinFile,
    '--',
    program,
  ]);
  assert.equal(json.code, 0, json.stderr);
  const result = JSON.parse(json.stdout) as { outcome: string; stdout: string };
  assert.equal(result.outcome, 'timeout');
  assert.equal(result.stdout, 'from a file\n');
  const plain = await dsec(['fncall', 'run', '--language', 'python', '--', program]);
  assert.equal(plain.code, 124);
  assert.match(plain.stderr, /ended with timeout \(ran past 50 ms\)/);
});

test('run reports platform errors by code', async () => {
  server.edge.fncallDouble.onCall = () => ({
    error: new DsecError('invalid_argument', 'no runtime "cobol"', { field: 'language' }),
  });
  const program = join(dir, 'x.cob');
  await writeFile(program, '');
  const r = await dsec(['fncall', 'run', '--language', 'cobol', '--', program]);
  assert.notEqual(r.code, 0);
  assert.match(r.stderr, /cobol/);
});

test('map runs a JSONL file and writes one result line per call', async () => {
  const callsFile = join(dir, 'calls.jsonl');
  const lines = [0, 1, 2, 3].map((n) =>
    JSON.stringify({ language: 'python', code: 'print(input())', stdin: `${n}\n` }),
  );
  await writeFile(callsFile, `${lines.join('\n')}\n\n`);
  server.edge.fncallDouble.onCall = (req) =>
    req.stdin === '2\n' ? { error: new DsecError('capacity_exhausted', 'pool full') } : undefined;
  const out = join(dir, 'results.jsonl');
  const r = await dsec(['fncall', 'map', callsFile, '--concurrency', '2', '--out', out]);
  // A call the platform failed makes the run fail, after every other result was written.
  assert.equal(r.code, 1);
  assert.match(r.stderr, /4 calls: 3 exited 0, 0 exited otherwise, 1 failed/);
  const results = (await readFile(out, 'utf8'))
    .trim()
    .split('\n')
    .map((l) => JSON.parse(l) as { index: number; result?: { stdout: string }; error?: unknown });
  assert.deepEqual(results.map((x) => x.index).sort(), [0, 1, 2, 3]);
  for (const x of results) {
    if (x.index === 2)
      assert.deepEqual(x.error, { code: 'capacity_exhausted', message: 'pool full' });
    else assert.equal(x.result?.stdout, `${x.index}\n`);
  }
  // To stdout without --out.
  server.edge.fncallDouble.onCall = undefined;
  const toStdout = await dsec(['fncall', 'map', callsFile]);
  assert.equal(toStdout.code, 0, toStdout.stderr);
  assert.equal(toStdout.stdout.trim().split('\n').length, 4);
});

test('map names the line of a malformed call', async () => {
  const callsFile = join(dir, 'bad.jsonl');
  await writeFile(callsFile, '{"language":"python","code":""}\nnot json\n');
  const r = await dsec(['fncall', 'map', callsFile]);
  assert.notEqual(r.code, 0);
  assert.match(r.stderr, /bad\.jsonl:2/);
});
