/**
 * Snapshot timing, before and after a change to the snapshot path (not a
 * test: numbers for a report). A sandbox with 2000 small files and 64 MiB of
 * data in its writable layer is snapshotted N times without scrub (the direct
 * path: `mkfs.erofs` of the upper while frozen) and N times with a scrub list
 * that shadows a lower layer (the copy path: `cp -a` while frozen, scrub,
 * `mkfs.erofs`), alternating so host noise hits both; prints medians of the
 * freeze and of the whole call.
 *
 *   node --conditions=dsec-source --import tsx packages/edge/test/integration/snapshot-timing.ts [N]
 */
import { mkdir, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { randomId } from '@dsec/core';
import { openContainerEdge } from '@dsec/edge';
import { buildLayer } from '@dsec/images';
import { makeStateDir, spec } from './fixture.js';

const rounds = Number(process.argv[2] ?? 7);
const { dir, store, cgroupParent, cleanup } = await makeStateDir();
const edge = await openContainerEdge({
  edgeId: 'node-1',
  stateDir: join(dir, 'edge'),
  store,
  cgroupParent,
});
try {
  const tree = join(dir, 'hist-tree');
  await mkdir(join(tree, 'root'), { recursive: true });
  await writeFile(join(tree, 'root', '.bash_history'), 'image history\n');
  await buildLayer(store, { name: 'hist', kind: 'workspace', from: { dir: tree } });
  const sb = await edge.createSandbox({
    id: randomId('sb'),
    projectId: 'p1',
    spec: spec({ workspace: 'hist' }),
  });
  const r = await edge.runCommand(sb.id, {
    shell:
      'mkdir -p /data/small && cd /data/small && i=0; while [ $i -lt 2000 ]; do echo $i > f$i; i=$((i+1)); done; ' +
      'dd if=/dev/urandom of=/data/big bs=1M count=64 2>/dev/null; echo h >> /root/.bash_history',
  });
  if (r.exitCode !== 0) throw new Error(r.stderr);
  const plain = { freeze: [] as number[], total: [] as number[] };
  const scrub = { freeze: [] as number[], total: [] as number[] };
  for (let i = 0; i < rounds; i++) {
    const a = await edge.snapshotSandbox(sb.id, { name: `plain-${i}` });
    plain.freeze.push(a.freezeMs);
    plain.total.push(a.totalMs);
    const b = await edge.snapshotSandbox(sb.id, {
      name: `scrub-${i}`,
      scrub: ['/root/.bash_history', '/data/small/f1'],
    });
    scrub.freeze.push(b.freezeMs);
    scrub.total.push(b.totalMs);
  }
  const median = (xs: number[]): number => {
    const s = [...xs].sort((x, y) => x - y);
    return s[Math.floor(s.length / 2)]!;
  };
  for (const [name, s] of [
    ['no scrub', plain],
    ['scrub', scrub],
  ] as const) {
    console.log(
      `${name.padEnd(9)} freeze p50 ${median(s.freeze).toFixed(1)} ms  total p50 ${median(s.total).toFixed(1)} ms  (freeze ${s.freeze.map((x) => x.toFixed(0)).join(' ')}; total ${s.total.map((x) => x.toFixed(0)).join(' ')})`,
    );
  }
} finally {
  for (const sb of await edge.listSandboxes({}))
    await edge.stopSandbox(sb.id).catch(() => undefined);
  await edge.close();
  await cleanup();
}
