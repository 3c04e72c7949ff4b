/**
 * The Backend conformance suite (src/backends/testing/conformance.ts)
 * against the full-VM backend. Opt-in (DSEC_TEST_VM=all, with QEMU and the
 * VM image, `ensureVmImage`, in /var/cache/dsec/vm or DSEC_VM_IMAGE_DIR):
 * each of its two sandboxes boots a whole Debian with X, 1–2 minutes under
 * TCG. The suite's limits test asks for 192 MiB of memory, below what a
 * VM with X boots in: the VM gets 512 MiB there (its memory check then
 * only says that the hog, not the sandbox, died).
 */
import { after, test } from 'node:test';
import { join } from 'node:path';
import { readdir } from 'node:fs/promises';
import { DEFAULT_VM_IMAGE_DIR, findQemu, findVmImage, openContainerEdge } from '@dsec/edge';
import { backendConformance } from '../../src/backends/testing/conformance.js';
import { hostResources, killQemusUnder, makeStateDir, qemusUnder, spec } from './fixture.js';

const imageDir = process.env.DSEC_VM_IMAGE_DIR || DEFAULT_VM_IMAGE_DIR;
const MIN_VM_MEMORY_MB = 512;

if (process.env.DSEC_TEST_VM !== 'all' || !findQemu() || !findVmImage(imageDir)) {
  test('backend conformance against full VMs', { skip: 'set DSEC_TEST_VM=all' }, () => {});
} else {
  const state = await makeStateDir();
  after(async () => {
    await killQemusUnder(state.dir);
    await state.cleanup();
  });
  backendConformance({
    kind: 'vm',
    openEdge: () =>
      openContainerEdge({
        edgeId: 'node-1',
        stateDir: join(state.dir, 'edge'),
        store: state.store,
        cgroupParent: state.cgroupParent,
        microvm: false,
        fncall: false,
        vm: { imageDir },
      }),
    spec: (o) =>
      spec({
        backend: 'vm',
        ...o,
        memoryLimitMb: Math.max(o?.memoryLimitMb ?? MIN_VM_MEMORY_MB, MIN_VM_MEMORY_MB),
      }),
    timeoutMs: 900_000,
    async leftovers() {
      const r = await hostResources(state.dir);
      const vms = await readdir(join(state.dir, 'edge', 'fullvms')).catch(() => [] as string[]);
      const qemus = (await qemusUnder(state.dir)).map((p) => `qemu ${p}`);
      return [...r.cgroups, ...vms, ...qemus, ...r.mounts];
    },
  });
}
