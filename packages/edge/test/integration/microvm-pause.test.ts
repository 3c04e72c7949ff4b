/**
 * Pause and resume of microVMs (ADR 0017): the machine's state goes to a
 * file and QEMU exits; resume (asked for, or the next call's transparent
 * one) restores it with its processes, memory and disk. Skipped where QEMU
 * or the built kernel is absent.
 */
import assert from 'node:assert/strict';
import { after, test } from 'node:test';
import { join } from 'node:path';
import { DsecError, randomId } from '@dsec/core';
import {
  DEFAULT_MICROVM_ASSETS_DIR,
  findMicrovmAssets,
  findQemu,
  openContainerEdge,
} from '@dsec/edge';
import { makeStateDir, qemusUnder, spec } from './fixture.js';

const available = Boolean(findQemu() && findMicrovmAssets(DEFAULT_MICROVM_ASSETS_DIR));

async function setup(t: { after: typeof after }) {
  const state = await makeStateDir();
  const open = () =>
    openContainerEdge({
      edgeId: 'node-1',
      stateDir: join(state.dir, 'edge'),
      store: state.store,
      cgroupParent: state.cgroupParent,
      fncall: false,
    });
  t.after(async () => {
    for (const pid of await qemusUnder(state.dir)) process.kill(pid, 'SIGKILL');
    await state.cleanup();
  });
  return { state, open };
}

test(
  'pause saves a microVM to a file and ends QEMU; resume finds its process, memory and disk',
  { skip: !available, timeout: 240_000 },
  async () => {
    const { state, open } = await setup({ after });
    let edge = await open();
    const id = randomId('sb');
    try {
      await edge.createSandbox({
        id,
        projectId: 'p1',
        spec: spec({ backend: 'microvm', memoryLimitMb: 256 }),
      });
      // A counter the sandbox runs as a daemon of its own (its state is in
      // guest memory: /tmp is a tmpfs) and a file on the writable disk.
      // (Commands streaming to the edge end at a pause: their connection goes
      // with QEMU; they fail as paused, below. ADR 0017.)
      await edge.runCommand(id, {
        shell:
          "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done' </dev/null >/dev/null 2>&1 &",
      });
      await edge.runCommand(id, { shell: 'echo kept > /root/file; sync' });
      await new Promise((r) => setTimeout(r, 500));
      const [qemu] = await qemusUnder(state.dir);
      assert.ok(qemu, 'the sandbox has a QEMU process');
      const before = await edge.getSandbox(id);
      assert.ok(
        (before.memoryBytes ?? 0) > 16 * 2 ** 20,
        `a running VM uses memory: ${before.memoryBytes}`,
      );

      // A dedicated port hot-plugged before the pause: the restore must have it too.
      await edge.io.writeFile(id, '/root/before', Buffer.from('before pause'));
      const streaming = edge.runCommand(id, { shell: 'sleep 60' }).then(
        (r) => r,
        (err: unknown) => err,
      );
      await new Promise((r) => setTimeout(r, 300));

      const paused = await edge.pauseSandbox(id);
      assert.equal(paused.state, 'paused');
      const err = await streaming;
      assert.ok(err instanceof DsecError, `the streaming command failed: ${String(err)}`);
      assert.equal(err.code, 'sandbox_not_running');
      assert.deepEqual(err.details, { reason: 'paused' });
      assert.deepEqual(await qemusUnder(state.dir), [], 'no QEMU runs while paused');
      const info = await edge.getSandbox(id);
      assert.ok(
        (info.memoryBytes ?? 0) < 8 * 2 ** 20,
        `a paused VM's host memory is released: ${info.memoryBytes} (was ${before.memoryBytes})`,
      );

      // An edge restart adopts the paused VM (no process, a state file).
      await edge.close();
      edge = await open();
      assert.equal((await edge.getSandbox(id)).state, 'paused');

      const resumed = await edge.resumeSandbox(id);
      assert.equal(resumed.state, 'running');
      assert.equal((await qemusUnder(state.dir)).length, 1, 'one QEMU again');
      const c1 = Number((await edge.runCommand(id, { argv: ['cat', '/tmp/count'] })).stdout);
      await new Promise((r) => setTimeout(r, 600));
      const r = await edge.runCommand(id, { shell: 'cat /tmp/count; cat /root/file' });
      const [c2, file] = r.stdout.trim().split('\n');
      assert.ok(c1 > 0 && Number(c2) > c1, `the background counter runs on: ${c1} → ${c2}`);
      assert.equal(file, 'kept');
      // Dedicated channels (a file transfer) reconnect too.
      await edge.io.writeFile(id, '/root/after', Buffer.from('after resume'));
      const chunks: Buffer[] = [];
      for await (const c of await edge.io.readFile(id, '/root/after')) chunks.push(c as Buffer);
      assert.equal(Buffer.concat(chunks).toString(), 'after resume');
    } finally {
      await edge.stopSandbox(id).catch(() => undefined);
      await edge.close();
    }
    assert.deepEqual(await qemusUnder(state.dir), [], 'stop ends the QEMU');
  },
);

test(
  'the next exec resumes a paused microVM; a paused one stops cleanly',
  { skip: !available, timeout: 240_000 },
  async () => {
    const { state, open } = await setup({ after });
    const edge = await open();
    const a = randomId('sb');
    const b = randomId('sb');
    try {
      for (const id of [a, b])
        await edge.createSandbox({
          id,
          projectId: 'p1',
          spec: spec({ backend: 'microvm', memoryLimitMb: 256 }),
        });
      await edge.runCommand(a, { shell: 'echo 41 > /tmp/n' });
      await edge.pauseSandbox(a);
      await edge.pauseSandbox(b);
      assert.deepEqual(await qemusUnder(state.dir), []);
      const r = await edge.runCommand(a, { shell: 'echo $(( $(cat /tmp/n) + 1 ))' });
      assert.equal(r.stdout.trim(), '42');
      assert.equal((await edge.getSandbox(a)).state, 'running');
      // Stopping a paused VM removes its state without restoring it.
      await edge.stopSandbox(b);
      assert.equal((await qemusUnder(state.dir)).length, 1, 'only the resumed VM runs');
    } finally {
      await edge.stopSandbox(a).catch(() => undefined);
      await edge.stopSandbox(b).catch(() => undefined);
      await edge.close();
    }
    assert.deepEqual(await qemusUnder(state.dir), []);
  },
);
