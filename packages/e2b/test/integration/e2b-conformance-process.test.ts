import { test } from 'node:test';
import assert from 'node:assert/strict';
import { CommandExitError, NotFoundError, Sandbox, SandboxError } from 'e2b';
import { useE2b, withE2bNode } from './e2b-node.js';

/**
 * envd's process behaviour as E2B's SDK suites check it: a sandbox killed
 * under a running command is an error, not a clean end; a terminal outlives
 * the stream that started it and `pty.connect(pid)` reattaches to it. Every
 * call names its user.
 */

const SANDBOX_MS = 300_000;
const ROOT = { user: 'root' } as const;

async function until(check: () => boolean, what: string, timeoutMs = 20_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!check()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 25));
  }
}

test('envd process conformance: a killed sandbox fails the run; terminals reconnect', async (t) => {
  await withE2bNode(async ({ url, adminKey }) => {
    useE2b(url, adminKey);

    await t.test('a sandbox killed during commands.run makes the run throw', async () => {
      const sbx = await Sandbox.create('base', { timeoutMs: SANDBOX_MS });
      let out = '';
      const run = sbx.commands.run('echo started; sleep 60; echo never', {
        ...ROOT,
        onStdout: (d) => void (out += d),
      });
      // Observe the outcome as soon as it settles (no unhandled rejection meanwhile).
      const settled = run.then(
        (r) => ({ ok: true as const, r }),
        (e: unknown) => ({ ok: false as const, e }),
      );
      await until(() => out.includes('started'), 'the command to start');
      assert.equal(await Sandbox.kill(sbx.sandboxId), true);
      const outcome = await settled;
      assert.equal(outcome.ok, false, 'a clean end hides that the sandbox is gone');
      if (!outcome.ok) {
        assert.ok(!(outcome.e instanceof CommandExitError), `not an exit: ${String(outcome.e)}`);
        assert.ok(outcome.e instanceof SandboxError, `an SDK error: ${String(outcome.e)}`);
      }
      assert.ok(!out.includes('never'));
    });

    await t.test('a sandbox killed under a background command makes wait() throw', async () => {
      const sbx = await Sandbox.create('base', { timeoutMs: SANDBOX_MS });
      const h = await sbx.commands.run('sleep 60', { ...ROOT, background: true });
      const settled = h.wait().then(
        (r) => ({ ok: true as const, r }),
        (e: unknown) => ({ ok: false as const, e }),
      );
      assert.equal(await Sandbox.kill(sbx.sandboxId), true);
      const outcome = await settled;
      assert.equal(outcome.ok, false);
      if (!outcome.ok) {
        assert.ok(!(outcome.e instanceof CommandExitError), `not an exit: ${String(outcome.e)}`);
        assert.ok(outcome.e instanceof SandboxError, `an SDK error: ${String(outcome.e)}`);
      }
    });

    await t.test('a command killed by the user still ends as an exit, not an error', async () => {
      const sbx = await Sandbox.create('base', { timeoutMs: SANDBOX_MS });
      try {
        const h = await sbx.commands.run('sleep 60', { ...ROOT, background: true });
        assert.equal(await sbx.commands.kill(h.pid), true);
        await assert.rejects(h.wait(), CommandExitError);
      } finally {
        await sbx.kill();
      }
    });

    await t.test(
      'pty: disconnect, then connect(pid) reattaches to the running terminal',
      async () => {
        const sbx = await Sandbox.create('base', { timeoutMs: SANDBOX_MS });
        try {
          const decoder = new TextDecoder();
          let first = '';
          const term = await sbx.pty.create({
            cols: 80,
            rows: 24,
            ...ROOT,
            onData: (d) => void (first += decoder.decode(d, { stream: true })),
          });
          await sbx.pty.sendInput(term.pid, new TextEncoder().encode('X=kept-$((40+2))\n'));
          await sbx.pty.sendInput(term.pid, new TextEncoder().encode('echo one-$X\n'));
          await until(() => first.includes('one-kept-42'), 'the first echo');
          await term.disconnect();
          // Detached, the terminal lives on: listed, and takes input.
          assert.ok((await sbx.commands.list()).some((p) => p.pid === term.pid));
          await sbx.pty.sendInput(term.pid, new TextEncoder().encode('echo while-away\n'));

          let second = '';
          const again = await sbx.pty.connect(term.pid, {
            onData: (d) => void (second += decoder.decode(d, { stream: true })),
          });
          assert.equal(again.pid, term.pid);
          // The shell's state survived: the variable set before the disconnect.
          await sbx.pty.sendInput(term.pid, new TextEncoder().encode('echo two-$X\n'));
          await until(() => second.includes('two-kept-42'), 'the echo after reconnecting');
          assert.ok(!first.includes('two-kept-42'), 'the detached stream gets nothing more');

          // Two followers at once both see the output.
          let third = '';
          const also = await sbx.pty.connect(term.pid, {
            onData: (d) => void (third += decoder.decode(d, { stream: true })),
          });
          await sbx.pty.sendInput(term.pid, new TextEncoder().encode('echo three-$X\n'));
          await until(
            () => second.includes('three-kept-42') && third.includes('three-kept-42'),
            'both followers',
          );
          await also.disconnect();

          assert.equal(await sbx.pty.kill(term.pid), true);
          await assert.rejects(again.wait(), CommandExitError);
          assert.ok(!(await sbx.commands.list()).some((p) => p.pid === term.pid));
          await assert.rejects(
            sbx.pty.connect(term.pid, { onData: () => undefined }),
            NotFoundError,
          );
          await assert.rejects(
            sbx.pty.connect(123_456_789, { onData: () => undefined }),
            NotFoundError,
          );
        } finally {
          await sbx.kill();
        }
      },
    );
  });
});
