/**
 * What the microVM backend adds to the conformance suite
 * (backend-conformance.test.ts): a guest kernel of its own, no network
 * device, and a jailed hypervisor (own uid, seccomp, the sandbox's cgroup
 * with its memory limit). Skipped where QEMU or the built kernel is absent.
 */
import assert from 'node:assert/strict';
import { after, test } from 'node:test';
import { readFile, readdir } from 'node:fs/promises';
import { release } from 'node:os';
import { join } from 'node:path';
import { randomId } from '@dsec/core';
import {
  DEFAULT_MICROVM_ASSETS_DIR,
  findMicrovmAssets,
  findQemu,
  openContainerEdge,
} from '@dsec/edge';
import { makeStateDir, spec } from './fixture.js';

const available = Boolean(findQemu() && findMicrovmAssets(DEFAULT_MICROVM_ASSETS_DIR));

test(
  'a microVM runs its own kernel, has no network, its QEMU is jailed, and streaming channels queue',
  { skip: !available, timeout: 120_000 },
  async () => {
    const state = await makeStateDir();
    const edge = await openContainerEdge({
      edgeId: 'node-1',
      stateDir: join(state.dir, 'edge'),
      store: state.store,
      cgroupParent: state.cgroupParent,
      fncall: false,
    });
    const id = randomId('sb');
    after(async () => {
      // Whatever failed above, no QEMU of this test outlives it.
      for (const e of await readdir('/proc')) {
        const cmd = await readFile(`/proc/${e}/cmdline`, 'utf8').catch(() => '');
        if (cmd.includes('qemu-system') && cmd.includes(state.dir))
          process.kill(Number(e), 'SIGKILL');
      }
      await state.cleanup();
    });
    try {
      assert.ok((await edge.status()).backends.includes('microvm'), 'the edge offers microvm');
      await edge.createSandbox({
        id,
        projectId: 'p1',
        spec: spec({ backend: 'microvm', memoryLimitMb: 200 }),
      });
      const uname = await edge.runCommand(id, { shell: 'uname -r; ls /sys/class/net' });
      const [kernel, ...nics] = uname.stdout.trim().split('\n');
      assert.notEqual(kernel, release(), 'the guest kernel is not the host kernel');
      assert.match(kernel ?? '', /cloud-amd64/);
      assert.deepEqual(nics, ['lo']);

      const qemu = (await readdir('/proc')).filter((e) => /^\d+$/.test(e));
      let pid: string | undefined;
      for (const e of qemu) {
        const cmd = await readFile(`/proc/${e}/cmdline`, 'utf8').catch(() => '');
        if (cmd.includes('qemu-system') && cmd.includes(state.dir)) pid = e;
      }
      assert.ok(pid, 'the sandbox has a QEMU process');
      const status = await readFile(`/proc/${pid}/status`, 'utf8');
      const uid = Number(/^Uid:\s+(\d+)/m.exec(status)?.[1]);
      assert.ok(uid >= 100_000, `QEMU runs as the sandbox's own uid, not ${uid}`);
      assert.match(status, /^Seccomp:\s+2$/m, 'QEMU runs under a seccomp filter');
      const cgroups = await readFile(`/proc/${pid}/cgroup`, 'utf8');
      assert.match(
        cgroups,
        new RegExp(`/${state.cgroupParent}/dsec-vm-`),
        'QEMU sits in the sandbox cgroup',
      );
      const memory = /:memory:(\S+)/.exec(cgroups)?.[1];
      if (memory) {
        const limit = Number(
          await readFile(`/sys/fs/cgroup/memory${memory}/memory.limit_in_bytes`, 'utf8'),
        );
        assert.ok(
          limit > 200 * 2 ** 20 && limit < 512 * 2 ** 20,
          `memory limit is guest RAM + overhead: ${limit}`,
        );
      }

      // Streaming channels (one virtio-serial port each, 7 of them): an 8th waits
      // for one to be freed instead of failing.
      const ptys = await Promise.all(Array.from({ length: 7 }, () => edge.io.openPty(id)));
      let eighthOpened = false;
      const eighth = edge.io.openPty(id).then((p) => ((eighthOpened = true), p));
      await new Promise((r) => setTimeout(r, 500));
      assert.equal(eighthOpened, false, 'the 8th terminal waits while 7 are open');
      ptys[0]!.kill();
      const last = await eighth;
      last.write(Buffer.from('exit 5\n'));
      assert.equal((await last.exited).exitCode, 5);
      for (const p of ptys.slice(1)) p.kill();
    } finally {
      await edge.stopSandbox(id).catch(() => undefined);
      await edge.close();
    }
  },
);
