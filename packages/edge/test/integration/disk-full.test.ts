/**
 * SECURITY.md E30, second half: the host disk under the edge's state fills up.
 * Creates and commands then fail with a clear error (not a crash, a hang or a
 * half-made sandbox), the state database stays intact, and everything works
 * again once space returns. The state dir is a small tmpfs the test mounts
 * (ext4 keeps a reserve for metadata, so it never fills to the last block),
 * so only that filesystem fills.
 */
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { mkdir, open, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { promisify } from 'node:util';
import Database from 'better-sqlite3';
import { isDsecError, randomId } from '@dsec/core';
import { openContainerEdge } from '@dsec/edge';
import { hostResources, makeStateDir, spec } from './fixture.js';

const run = promisify(execFile);
const root = process.getuid?.() === 0;

/** Writes zeros to `file` until the filesystem says ENOSPC. */
async function fill(file: string): Promise<void> {
  const fh = await open(file, 'w');
  const chunk = Buffer.alloc(1 << 20);
  try {
    for (;;) await fh.write(chunk);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'ENOSPC') throw err;
  } finally {
    await fh.close().catch(() => undefined);
  }
  // The last partial block, byte by byte in bigger steps: leave nothing free.
  const small = await open(`${file}.tail`, 'w');
  try {
    for (let size = 4096; size >= 1; size = Math.floor(size / 2)) {
      for (;;) {
        try {
          await small.write(Buffer.alloc(size));
        } catch {
          break;
        }
      }
    }
  } finally {
    await small.close().catch(() => undefined);
  }
}

test(
  'E30: a full state disk gives clear errors, keeps the database intact, and recovers',
  { skip: root ? false : 'needs root', timeout: 180_000 },
  async () => {
    const { dir, store, cgroupParent, cleanup } = await makeStateDir();
    const stateFs = join(dir, 'statefs');
    await mkdir(stateFs);
    await run('mount', ['-t', 'tmpfs', '-o', 'size=64m,mode=0711', 'dsec-test-state', stateFs]);
    const stateDir = join(stateFs, 'edge');
    let edge: Awaited<ReturnType<typeof openContainerEdge>> | undefined;
    try {
      // Admission's disk floor off: this test is about what a full disk does past admission.
      edge = await openContainerEdge({
        edgeId: 'node-1',
        stateDir,
        store,
        cgroupParent,
        admission: { minFreeDiskMb: 0 },
      });
      const before = await hostResources(dir);
      const a = await edge.createSandbox({ id: randomId('sb'), projectId: 'p', spec: spec() });
      assert.equal((await edge.runCommand(a.id, { shell: 'echo before' })).stdout, 'before\n');

      const filler = join(stateFs, 'filler');
      await fill(filler);

      // A create fails with a stable code, and leaves nothing half-made.

      await assert.rejects(
        edge.createSandbox({ id: randomId('sb'), projectId: 'p', spec: spec() }),
        (e) => isDsecError(e, 'unavailable') && /out of disk space/.test(e.message),
        'create on a full disk',
      );
      assert.deepEqual(
        (await edge.listSandboxes({})).map((s) => s.id),
        [a.id],
        'no half-made sandbox is listed',
      );
      // A command whose result cannot be logged is an error, not a crash.
      const cmd = await edge.runCommand(a.id, { shell: 'echo during' }).then(
        (r) => ({ ok: true as const, r }),
        (e: unknown) => ({ ok: false as const, e }),
      );
      if (!cmd.ok) assert.ok(isDsecError(cmd.e, 'unavailable'), `unavailable: ${String(cmd.e)}`);

      // Space returns: everything works again, and the database is intact.
      await rm(filler, { force: true });
      await rm(`${filler}.tail`, { force: true });
      assert.equal((await edge.runCommand(a.id, { shell: 'echo after' })).stdout, 'after\n');
      const b = await edge.createSandbox({ id: randomId('sb'), projectId: 'p', spec: spec() });
      assert.equal((await edge.runCommand(b.id, { shell: 'echo b' })).stdout, 'b\n');
      const db = new Database(join(stateDir, 'edge.db'), { readonly: true });
      try {
        assert.equal(db.pragma('integrity_check', { simple: true }), 'ok');
      } finally {
        db.close();
      }
      await edge.stopSandbox(a.id);
      await edge.stopSandbox(b.id);
      assert.deepEqual(await hostResources(dir), before);
    } finally {
      // Space first, so that stopping what is left can be recorded.
      await rm(join(stateFs, 'filler'), { force: true });
      await rm(join(stateFs, 'filler.tail'), { force: true });
      if (edge) {
        for (const sb of await edge.listSandboxes({}))
          await edge.stopSandbox(sb.id).catch(() => undefined);
        await edge.close();
      }
      await run('umount', [stateFs]).catch(() => run('umount', ['-l', stateFs]));
      await cleanup();
    }
  },
);
