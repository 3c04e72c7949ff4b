/**
 * The Backend conformance suite (src/backends/testing/conformance.ts) against
 * the container backend and, where QEMU and the microVM kernel are on this
 * host, the microVM backend (skipped otherwise; `ensureMicrovmAssets`
 * builds them). Every QEMU this test starts is ended by its stop, or by the
 * leftover sweep at the end even when an assertion failed first.
 */
import { after } from 'node:test';
import { join } from 'node:path';
import { readdir } from 'node:fs/promises';
import {
  DEFAULT_MICROVM_ASSETS_DIR,
  findMicrovmAssets,
  findQemu,
  openContainerEdge,
} from '@dsec/edge';
import { backendConformance } from '../../src/backends/testing/conformance.js';
import { hostResources, killQemusUnder, makeStateDir, qemusUnder, spec } from './fixture.js';

const state = await makeStateDir();
after(async () => {
  await killQemusUnder(state.dir);
  await state.cleanup();
});

const open = (microvm: boolean) => () =>
  openContainerEdge({
    edgeId: 'node-1',
    stateDir: join(state.dir, 'edge'),
    store: state.store,
    cgroupParent: state.cgroupParent,
    ...(microvm ? {} : { microvm: false as const }),
  });

backendConformance({
  kind: 'container',
  openEdge: open(false),
  spec: (o) => spec(o),
  timeoutMs: 120_000,
  async leftovers() {
    const r = await hostResources(state.dir);
    return [...r.cgroups, ...r.containers, ...r.processes, ...r.sandboxDirs, ...r.mounts];
  },
});

if (findQemu() && findMicrovmAssets(DEFAULT_MICROVM_ASSETS_DIR)) {
  backendConformance({
    kind: 'microvm',
    openEdge: open(true),
    spec: (o) => spec({ backend: 'microvm', ...o }),
    // TCG boots take seconds; the whole file stays within ~2 minutes.
    timeoutMs: 150_000,
    async leftovers() {
      const r = await hostResources(state.dir);
      const vms = await readdir(join(state.dir, 'edge', 'vms')).catch(() => [] as string[]);
      const qemus = (await qemusUnder(state.dir)).map((p) => `qemu ${p}`);
      return [...r.cgroups, ...vms, ...qemus, ...r.mounts];
    },
  });
}
