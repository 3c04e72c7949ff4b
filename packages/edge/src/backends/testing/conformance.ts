/**
 * The Backend conformance suite: what every backend must do for the edge,
 * checked through the edge itself (its command log, sessions, files and
 * terminals all go through the backend's channel). An integration test
 * calls `backendConformance` with a target that opens edges of one backend
 * over one state directory; the suite registers its tests with node:test.
 *
 * Sandboxes are few on purpose (microVMs boot slowly without KVM): one
 * sandbox carries the lifecycle, exec, session, file, pty and adoption
 * checks in order; a second one the limits. Each is stopped in a `finally`.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { isDsecError, randomId } from '@dsec/core';
import type { BackendKind, SandboxSpec } from '@dsec/core';
import type { Edge } from '../../edge.js';

export interface ConformanceTarget {
  kind: BackendKind;
  /**
   * Opens an edge running this backend over the target's state directory;
   * called again after `edge.close()` it is the edge after a restart.
   */
  openEdge(): Promise<Edge>;
  /** A spec of this backend over an image whose base layer is busybox (with `sh`, `cat`, `dd`). */
  spec(overrides?: Partial<SandboxSpec>): SandboxSpec;
  /** What the backend's sandboxes left on the host (processes, cgroups, directories, mounts). */
  leftovers(): Promise<string[]>;
  /** Per-test timeout (VM boots under TCG take seconds). */
  timeoutMs: number;
}

export function backendConformance(target: ConformanceTarget): void {
  const name = (what: string) => `${target.kind} backend: ${what}`;

  test(
    name('lifecycle, exec, sessions, files, pty, adoption, cleanup'),
    { timeout: target.timeoutMs },
    async (t) => {
      let edge = await target.openEdge();
      const id = randomId('sb');
      try {
        const before = await target.leftovers();
        assert.deepEqual(before, [], 'nothing of this backend on the host before');
        assert.ok(
          (await edge.status()).backends.includes(target.kind),
          'the edge reports the backend',
        );

        await t.test('create', async () => {
          const sb = await edge.createSandbox({ id, projectId: 'p1', spec: target.spec() });
          assert.equal(sb.state, 'running');
          assert.equal(sb.spec.backend, target.kind);
          const info = await edge.getSandbox(id);
          assert.ok((info.memoryBytes ?? 0) > 0, 'host memory is charged to the sandbox');
        });

        await t.test('exit codes, stdout and stderr, argv', async () => {
          const r = await edge.runCommand(id, { shell: 'echo hello; echo oops >&2; exit 3' });
          assert.equal(r.exitCode, 3);
          assert.equal(r.outcome, 'exited');
          assert.equal(r.stdout, 'hello\n');
          assert.equal(r.stderr, 'oops\n');
          const argv = await edge.runCommand(id, { argv: ['echo', 'a b', 'c'] });
          assert.equal(argv.stdout, 'a b c\n');
          await assert.rejects(edge.runCommand(id, { argv: ['/no/such/program'] }), (e) =>
            isDsecError(e, 'invalid_argument'),
          );
        });

        await t.test('signals, stdin, env, cwd, user, timeouts', async () => {
          const sig = await edge.runCommand(id, { shell: 'kill -TERM $$' });
          assert.equal(sig.outcome, 'signaled');
          assert.equal(sig.signal, 'SIGTERM');
          assert.equal(sig.exitCode, 143);
          const cat = await edge.runCommand(id, { argv: ['cat'], stdin: 'from stdin' });
          assert.equal(cat.stdout, 'from stdin');
          const env = await edge.runCommand(id, {
            shell: 'echo "$GREETING"; pwd; id -u',
            env: { GREETING: 'hi' },
            cwd: '/tmp',
            user: '1000',
          });
          assert.equal(env.stdout, 'hi\n/tmp\n1000\n');
          const slow = await edge.runCommand(id, { shell: 'sleep 30', timeoutMs: 500 });
          assert.equal(slow.outcome, 'timeout');
          // The timeout killed the whole tree: nothing of it is left.
          const ps = await edge.runCommand(id, {
            shell: 'ps -o args | grep -c "[s]leep 30" || true',
          });
          assert.equal(ps.stdout.trim(), '0');
        });

        await t.test('background commands: streamed stdin, signals, wait', async () => {
          const bg = await edge.io.startCommand(id, { argv: ['cat'], stdinOpen: true });
          await edge.io.writeStdin(id, bg.commandId, Buffer.from('streamed\n'), { eof: true });
          const done = await edge.io.waitCommand(id, bg.commandId, { timeoutMs: 30_000 });
          assert.equal(done.stdout, 'streamed\n');
          assert.equal(done.exitCode, 0);
          const sleeper = await edge.io.startCommand(id, { shell: 'sleep 60' });
          await edge.io.signalCommand(id, sleeper.commandId, 'SIGKILL');
          const killed = await edge.io.waitCommand(id, sleeper.commandId, { timeoutMs: 30_000 });
          assert.equal(killed.signal, 'SIGKILL');
        });

        await t.test('sessions keep cwd and environment between lines', async () => {
          await edge.io.runInSession(id, 's1', { line: 'cd /tmp && export KEPT=yes' });
          const r = await edge.io.runInSession(id, 's1', { line: 'echo "$PWD $KEPT"; false' });
          assert.equal(r.stdout, '/tmp yes\n');
          assert.equal(r.exitCode, 1);
          assert.deepEqual(
            (await edge.io.listSessions(id)).map((s) => s.name),
            ['s1'],
          );
          await edge.io.closeSession(id, 's1');
        });

        await t.test('files: write, read, stat, list, mkdir, rename, remove', async () => {
          await edge.io.mkdir(id, '/work/sub', { parents: true });
          const body = Buffer.from('x'.repeat(100_000) + 'end');
          const info = await edge.io.writeFile(id, '/work/sub/a.txt', body, { mode: 0o640 });
          assert.equal(info.size, body.length);
          const read = await streamToBuffer(await edge.io.readFile(id, '/work/sub/a.txt'));
          assert.ok(read.equals(body), 'read back what was written');
          assert.equal((await edge.io.statFile(id, '/work/sub/a.txt')).mode & 0o777, 0o640);
          await edge.io.rename(id, '/work/sub/a.txt', '/work/sub/b.txt');
          assert.deepEqual(
            (await edge.io.listDir(id, '/work/sub')).map((f) => f.name),
            ['b.txt'],
          );
          await edge.io.remove(id, '/work', { recursive: true });
          await assert.rejects(edge.io.statFile(id, '/work'), (e) => isDsecError(e));
        });

        await t.test('pty', async () => {
          const pty = await edge.io.openPty(id, { rows: 24, cols: 80 });
          let out = '';
          pty.onOutput((c) => (out += c.toString()));
          pty.write(Buffer.from('stty size; exit 7\n'));
          const exit = await pty.exited;
          assert.equal(exit.exitCode, 7);
          assert.match(out, /24 80/);
        });

        await t.test('adoption after an edge restart', async () => {
          await edge.runCommand(id, { shell: 'echo kept > /root/state' });
          await edge.close();
          edge = await target.openEdge();
          assert.equal((await edge.getSandbox(id)).state, 'running');
          assert.equal((await edge.runCommand(id, { shell: 'cat /root/state' })).stdout, 'kept\n');
        });

        await t.test('stop releases everything', async () => {
          await edge.stopSandbox(id);
          assert.equal((await edge.getSandbox(id)).state, 'stopped');
          await assert.rejects(edge.runCommand(id, { argv: ['true'] }), (e) =>
            isDsecError(e, 'sandbox_not_running'),
          );
          assert.deepEqual(await target.leftovers(), []);
        });
      } finally {
        await edge.stopSandbox(id).catch(() => undefined);
        await edge.close();
      }
    },
  );

  test(name('limits: disk, memory and processes'), { timeout: target.timeoutMs }, async () => {
    const edge = await target.openEdge();
    const id = randomId('sb');
    try {
      await edge.createSandbox({
        id,
        projectId: 'p1',
        spec: target.spec({ diskLimitMb: 32, memoryLimitMb: 192, pidsLimit: 32 }),
      });
      const fill = await edge.runCommand(id, {
        shell: 'dd if=/dev/zero of=/fill bs=1M count=64 2>&1; sync',
      });
      assert.match(fill.stdout, /No space left on device/);
      await edge.runCommand(id, { shell: 'rm -f /fill' });
      // More anonymous memory than the limit: the allocation, not the sandbox, dies.
      const hog = await edge.runCommand(id, {
        shell: 'head -c 400m /dev/zero | tail > /dev/null',
        timeoutMs: 60_000,
      });
      assert.notEqual(hog.exitCode, 0);
      assert.equal((await edge.runCommand(id, { shell: 'echo alive' })).stdout, 'alive\n');
      // 40 sleepers against a limit of 32: forks fail inside; the sandbox still serves.
      const forks = await edge.runCommand(id, {
        shell: 'i=0; while [ $i -lt 40 ]; do sleep 30 >/dev/null 2>&1 & i=$((i+1)); done; echo $i',
        timeoutMs: 60_000,
      });
      assert.match(forks.stdout + forks.stderr, /fork|Resource temporarily unavailable/i);
      assert.equal((await edge.runCommand(id, { shell: 'echo alive' })).stdout, 'alive\n');
    } finally {
      await edge.stopSandbox(id).catch(() => undefined);
      await edge.close();
    }
    assert.deepEqual(await target.leftovers(), []);
  });
}

async function streamToBuffer(stream: NodeJS.ReadableStream): Promise<Buffer> {
  const parts: Buffer[] = [];
  for await (const c of stream) parts.push(Buffer.isBuffer(c) ? c : Buffer.from(c));
  return Buffer.concat(parts);
}
