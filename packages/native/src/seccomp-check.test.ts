import assert from 'node:assert/strict';
import { readFile } from 'node:fs/promises';
import { after, before, describe, test } from 'node:test';

import { ChronusConnection } from './chronus-client.js';
import { DOCKER_CAPS, integrationSkipReason, runCollect, startDaemon } from './test-support.js';
import type { Daemon } from './test-support.js';

const skip = integrationSkipReason() ?? false;

/** A deny-list profile; the daemon itself must keep working under it. */
const PROFILE = `# test profile
default allow
errno 1 io_uring_setup
errno 1 bpf
errno 1 keyctl
errno 1 mount
errno 1 no_such_syscall_anywhere   # unknown names are skipped
`;

/** CAP_SYS_ADMIN (in the sandbox's user namespace) lets `mount` succeed unless seccomp stops it. */
const CAPS = [...DOCKER_CAPS, 'CAP_SYS_ADMIN'];
const MOUNT = ['mount', '-t', 'tmpfs', 'x', '/tmp'];

describe('control: without a profile the same mount succeeds', { skip }, () => {
  test('mount tmpfs works with CAP_SYS_ADMIN and no seccomp', async () => {
    const d = await startDaemon({ capabilities: CAPS });
    const conn = await ChronusConnection.connect(d.socketPath);
    try {
      const r = await runCollect(conn, { argv: MOUNT });
      assert.equal(r.exit.exitCode, 0, r.stderr.toString());
    } finally {
      conn.close();
      await d.stop();
    }
  });
});

describe('seccomp profile', { skip }, () => {
  let d: Daemon;
  let conn: ChronusConnection;
  before(async () => {
    d = await startDaemon({ seccompProfile: PROFILE, capabilities: CAPS });
    conn = await ChronusConnection.connect(d.socketPath);
  });
  after(async () => {
    conn?.close();
    await d?.stop();
  });

  test('the daemon serves commands under the profile, which they inherit', async () => {
    const r = await runCollect(conn, { argv: ['grep', '^Seccomp:', '/proc/self/status'] });
    assert.equal(r.exit.exitCode, 0);
    assert.equal(r.stdout.toString(), 'Seccomp:\t2\n');
    const status = await readFile(`/proc/${d.pid}/status`, 'utf8');
    assert.match(status, /^Seccomp:\t2$/m, 'the daemon itself is filtered');
  });

  test('denied syscalls fail with EPERM inside', async () => {
    const r = await runCollect(conn, { argv: MOUNT });
    assert.notEqual(r.exit.exitCode, 0);
    assert.match(r.stderr.toString(), /permission denied|Operation not permitted/);
  });

  test('shell, pty, stdin and kill-tree still work under the profile', async () => {
    const r = await runCollect(
      conn,
      { argv: ['sh', '-c', 'read x; echo got $x'], shell: true },
      'hi\n',
    );
    assert.equal(r.stdout.toString(), 'got hi\n');
    const p = await runCollect(conn, { argv: ['tty'], pty: { rows: 10, cols: 10 } });
    assert.equal(p.exit.exitCode, 0);
    const h = conn.spawn({ argv: ['sh', '-c', 'sleep 1000 & wait'], shell: true });
    await h.started;
    h.killTree();
    assert.equal((await h.exited).signal, 'SIGKILL');
  });
});
