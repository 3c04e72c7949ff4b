/**
 * Stop latency (not a test: numbers for a report): N sandboxes with a few
 * hundred files in their writable layer are created and stopped one after
 * another; prints the median stop time (the sandbox directory's removal is
 * part of it).
 *
 *   node --conditions=dsec-source --import tsx packages/edge/test/integration/stop-timing.ts [N]
 */
import { join } from 'node:path';
import { randomId } from '@dsec/core';
import { openContainerEdge } from '@dsec/edge';
import { makeStateDir, spec } from './fixture.js';

const n = Number(process.argv[2] ?? 15);
const { dir, store, cgroupParent, cleanup } = await makeStateDir();
const edge = await openContainerEdge({
  edgeId: 'node-1',
  stateDir: join(dir, 'edge'),
  store,
  cgroupParent,
});
try {
  const stops: number[] = [];
  for (let i = 0; i < n; i++) {
    const sb = await edge.createSandbox({ id: randomId('sb'), projectId: 'p1', spec: spec({}) });
    const r = await edge.runCommand(sb.id, {
      shell:
        'mkdir -p /data && cd /data && i=0; while [ $i -lt 300 ]; do echo $i > f$i; i=$((i+1)); done',
    });
    if (r.exitCode !== 0) throw new Error(r.stderr);
    const t0 = performance.now();
    await edge.stopSandbox(sb.id);
    stops.push(performance.now() - t0);
  }
  const s = [...stops].sort((a, b) => a - b);
  console.log(
    `stop p50 ${s[Math.floor(s.length / 2)]!.toFixed(1)} ms  (${stops.map((x) => x.toFixed(0)).join(' ')})`,
  );
} finally {
  await edge.close();
  await cleanup();
}
