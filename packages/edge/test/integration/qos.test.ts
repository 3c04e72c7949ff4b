/**
 * QoS classes (paper 5.2, issue 9): a best-effort sandbox's cgroup has the
 * minimal CPU weight and is marked idle, and its init, its command daemon and
 * every command the platform runs in it are SCHED_IDLE; a latency-sensitive
 * sandbox (the default) keeps the normal weight and SCHED_OTHER.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { randomId } from '@dsec/core';
import { openContainerEdge } from '@dsec/edge';
import { hostResources, makeStateDir, spec } from './fixture.js';

const root = process.getuid?.() === 0;
const SCHED_OTHER = 0;
const SCHED_IDLE = 5;

/** The scheduling policy from /proc/PID/stat (field 41). */
function policyOf(stat: string): number {
  const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
  return Number(fields[41 - 3]);
}

test(
  'best-effort sandboxes run SCHED_IDLE in an idle, minimal-weight cgroup; latency-sensitive ones do not',
  { skip: root ? false : 'needs root', timeout: 120_000 },
  async () => {
    const { dir, store, cgroupParent, cleanup } = await makeStateDir();
    const edge = await openContainerEdge({
      edgeId: 'node-1',
      stateDir: join(dir, 'edge'),
      store,
      cgroupParent,
    });
    try {
      const before = await hostResources(dir);
      const cases = [
        { qosClass: 'best-effort' as const, policy: SCHED_IDLE, idle: '1', shares: '3' },
        { qosClass: 'latency-sensitive' as const, policy: SCHED_OTHER, idle: '0', shares: '1024' },
        { qosClass: undefined, policy: SCHED_OTHER, idle: '0', shares: '1024' },
      ];
      for (const c of cases) {
        const sb = await edge.createSandbox({
          id: randomId('sb'),
          projectId: 'p',
          spec: spec(c.qosClass ? { qosClass: c.qosClass } : {}),
        });
        const name = 'dsec-' + createHash('sha256').update(sb.id).digest('hex').slice(0, 20);
        const cg = join('/sys/fs/cgroup/cpu', cgroupParent, name);
        const read = async (f: string) => (await readFile(join(cg, f), 'utf8')).trim();
        // An idle group's weight reads 3 (the kernel's idle weight) whatever shares were set.
        assert.equal(await read('cpu.idle'), c.idle, `${c.qosClass}: cpu.idle`);
        assert.equal(await read('cpu.shares'), c.shares, `${c.qosClass}: cpu.shares`);

        // Every process of the sandbox so far: its init and the command daemon in its cgroup.
        const pids = (await read('cgroup.procs')).split('\n').filter(Boolean);
        assert.ok(pids.length >= 1, 'the sandbox has processes');
        for (const pid of pids) {
          const stat = await readFile(`/proc/${pid}/stat`, 'utf8');
          assert.equal(policyOf(stat), c.policy, `${c.qosClass}: policy of ${stat.slice(0, 40)}`);
        }
        // A command and its children inherit the policy.
        const r = await edge.runCommand(sb.id, {
          shell: 'cat /proc/self/stat; sh -c "cat /proc/self/stat"',
        });
        const lines = r.stdout.trim().split('\n');
        assert.equal(lines.length, 2, r.stderr);
        for (const line of lines) assert.equal(policyOf(line), c.policy, `${c.qosClass}: command`);
        await edge.stopSandbox(sb.id);
      }
      assert.deepEqual(await hostResources(dir), before);
    } finally {
      for (const sb of await edge.listSandboxes({}))
        await edge.stopSandbox(sb.id).catch(() => undefined);
      await edge.close();
      await cleanup();
    }
  },
);
