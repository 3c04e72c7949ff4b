import { test } from 'node:test';
import assert from 'node:assert/strict';
import { create, fromJson, toJson } from '@bufbuild/protobuf';
import { Code, ConnectError } from '@connectrpc/connect';
import { DsecError, isDsecError } from '@dsec/core';
import type { CommandInfo, CommandResult, SandboxIoApi } from '@dsec/core';
import { credentialOf, envdUser } from '../auth.js';
import { envdHttpStatus, toConnectError } from '../errors.js';
import { EntryInfoSchema } from '../gen/filesystem/filesystem_pb.js';
import { ProcessEventSchema, StartRequestSchema } from '../gen/process/process_pb.js';
import { entryOf, permissionString } from './filesystem-service.js';
import { endOf, selectedPid, shellLine } from './process-service.js';
import { commandPid, ProcessTable } from './process-table.js';

const result = (over: Partial<CommandResult>): CommandResult => ({
  commandId: 'cmd-1',
  exitCode: 0,
  outcome: 'exited',
  stdout: '',
  stderr: '',
  truncated: false,
  stdoutBytes: 0,
  stderrBytes: 0,
  durationMs: 1,
  ...over,
});

test('the JSON wire form is what the SDKs send and read (field names, enum names, base64 bytes)', () => {
  const start = fromJson(StartRequestSchema, {
    process: { cmd: '/bin/bash', args: ['-l', '-c', 'ls'], envs: { A: '1' }, cwd: '/tmp' },
    stdin: false,
  });
  assert.equal(start.process?.cmd, '/bin/bash');
  assert.deepEqual(start.process?.envs, { A: '1' });
  assert.equal(start.stdin, false);
  assert.equal(start.pty, undefined);
  const event = create(ProcessEventSchema, {
    event: { case: 'data', value: { output: { case: 'stdout', value: Buffer.from('hi\n') } } },
  });
  assert.deepEqual(toJson(ProcessEventSchema, event), { data: { stdout: 'aGkK' } });
  const end = create(ProcessEventSchema, {
    event: { case: 'end', value: endOf(result({ exitCode: 3 })) },
  });
  assert.deepEqual(toJson(ProcessEventSchema, end), {
    end: { exitCode: 3, exited: true, status: 'exit status 3' },
  });
  const entry = create(
    EntryInfoSchema,
    entryOf({
      name: 'a',
      path: '/a',
      type: 'directory',
      size: 4096,
      mode: 0o755,
      mtime: '2026-01-02T03:04:05.678Z',
      uid: 0,
      gid: 1000,
    }),
  );
  assert.deepEqual(toJson(EntryInfoSchema, entry), {
    name: 'a',
    type: 'FILE_TYPE_DIRECTORY',
    path: '/a',
    size: '4096',
    mode: 493,
    permissions: 'drwxr-xr-x',
    owner: 'root',
    group: '1000',
    modifiedTime: '2026-01-02T03:04:05.678Z',
  });
});

test('end events read as envd’s: exit status, or -1 with the signal word and why', () => {
  assert.deepEqual(endOf(result({ exitCode: 0 })), {
    exitCode: 0,
    exited: true,
    status: 'exit status 0',
  });
  assert.deepEqual(endOf(result({ outcome: 'killed', exitCode: 137, signal: 'SIGKILL' })), {
    exitCode: -1,
    exited: false,
    status: 'signal: killed',
  });
  assert.deepEqual(endOf(result({ outcome: 'signaled', signal: 'SIGTERM' })), {
    exitCode: -1,
    exited: false,
    status: 'signal: terminated',
  });
  assert.match(endOf(result({ outcome: 'timeout' })).error ?? '', /timeout/);
  assert.match(endOf(result({ outcome: 'oom' })).error ?? '', /out of memory/);
});

test('the SDKs’ shell wrapping is recognised, anything else is a plain argv', () => {
  assert.equal(shellLine('/bin/bash', ['-l', '-c', 'echo hi']), 'echo hi');
  assert.equal(shellLine('bash', ['-c', 'x']), 'x');
  assert.equal(shellLine('/bin/sh', ['-i', '--login', '-c', 'y']), 'y');
  assert.equal(shellLine('/bin/bash', ['-c', 'x', 'argv0']), undefined);
  assert.equal(shellLine('/bin/bash', ['-i', '-l']), undefined);
  assert.equal(shellLine('/usr/bin/python3', ['-c', 'x']), undefined);
  assert.equal(shellLine('/bin/bash', ['-e', '-c', 'x']), undefined);
});

test('processes are selected by pid; a tag is unimplemented, nothing is invalid', () => {
  assert.equal(selectedPid({ selector: { case: 'pid', value: 7 } } as never), 7);
  assert.throws(
    () => selectedPid({ selector: { case: 'tag', value: 't' } } as never),
    (e) => e instanceof ConnectError && e.code === Code.Unimplemented,
  );
  assert.throws(
    () => selectedPid(undefined),
    (e) => isDsecError(e, 'invalid_argument'),
  );
});

test('a command’s pid is stable and found again from the command log by any apiserver', async () => {
  const pid = commandPid('cmd-abc');
  assert.equal(pid, commandPid('cmd-abc'));
  assert.ok(pid > 0 && pid <= 0x7fffffff);
  assert.notEqual(pid, commandPid('cmd-abd'));
  let listed = 0;
  const io = {
    listCommands: async (): Promise<CommandInfo[]> => {
      listed++;
      return [
        {
          commandId: 'cmd-other',
          sandboxId: 's',
          background: true,
          state: 'running',
          startedAt: '',
        },
        { commandId: 'cmd-abc', sandboxId: 's', background: true, state: 'running', startedAt: '' },
      ];
    },
  } as unknown as SandboxIoApi;
  const fresh = new ProcessTable();
  assert.deepEqual(await fresh.resolve(io, 's', pid), { kind: 'command', commandId: 'cmd-abc' });
  assert.deepEqual(await fresh.resolve(io, 's', pid), { kind: 'command', commandId: 'cmd-abc' });
  assert.equal(listed, 1, 'the second lookup is cached');
  await assert.rejects(fresh.resolve(io, 's', 1), (e) => isDsecError(e, 'not_found'));
  // A pid of one sandbox means nothing in another.
  const other = { listCommands: async () => [] } as unknown as SandboxIoApi;
  await assert.rejects(fresh.resolve(other, 't', pid), (e) => isDsecError(e, 'not_found'));
});

test('errors map onto Connect codes and envd statuses; a gone sandbox reads as envd’s 502', () => {
  const code = (e: DsecError) => toConnectError(e).code;
  assert.equal(code(new DsecError('not_found', 'x')), Code.NotFound);
  assert.equal(code(new DsecError('sandbox_not_found', 'x')), Code.Unavailable);
  assert.equal(code(new DsecError('invalid_argument', 'x')), Code.InvalidArgument);
  assert.equal(code(new DsecError('conflict', 'x')), Code.AlreadyExists);
  assert.equal(code(new DsecError('deadline_exceeded', 'x')), Code.DeadlineExceeded);
  assert.equal(
    toConnectError(new Error('secret host detail')).message,
    '[internal] internal error',
  );
  assert.equal(envdHttpStatus(new DsecError('sandbox_not_found', 'x')), 502);
  assert.equal(envdHttpStatus(new DsecError('not_found', 'x')), 404);
  assert.equal(
    envdHttpStatus(new DsecError('resource_exhausted', 'x', { details: { resource: 'disk' } })),
    507,
  );
});

test('credentials and the envd user come from the headers the SDKs send', () => {
  assert.deepEqual(credentialOf({ 'x-api-key': 'k1', 'x-access-token': 'k2' }), {
    key: 'k1',
    header: 'x-api-key',
  });
  assert.deepEqual(credentialOf({ 'x-access-token': 'k2' }), {
    key: 'k2',
    header: 'x-access-token',
  });
  assert.deepEqual(credentialOf({ authorization: 'Bearer k3' }), {
    key: 'k3',
    header: 'authorization',
  });
  assert.equal(credentialOf({ authorization: 'Basic dXNlcjo=' }), undefined);
  assert.equal(envdUser(new Headers({ authorization: `Basic ${btoa('app:')}` })), 'app');
  assert.equal(envdUser(new Headers({ authorization: `Basic ${btoa('0:')}` })), '0');
  assert.equal(envdUser(new Headers()), undefined);
  assert.throws(
    () => envdUser(new Headers({ authorization: `Basic ${btoa('../x:')}` })),
    (e) => isDsecError(e, 'invalid_argument'),
  );
  // A uid no process of the sandbox can take (its ids are 0–65535).
  for (const uid of ['9999999999', '65536'])
    assert.throws(
      () => envdUser(new Headers({ authorization: `Basic ${btoa(`${uid}:`)}` })),
      (e) => isDsecError(e, 'invalid_argument') && e.field === 'user',
    );
});

test('permissions read like Go’s FileMode strings', () => {
  assert.equal(permissionString('file', 0o644), '-rw-r--r--');
  assert.equal(permissionString('symlink', 0o777), 'Lrwxrwxrwx');
  assert.equal(permissionString('directory', 0o1777), 'drwxrwxrwx');
  assert.equal(permissionString('fifo', 0o600), 'prw-------');
});
