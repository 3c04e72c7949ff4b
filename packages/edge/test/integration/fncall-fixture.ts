import { chmod, mkdtemp, readdir, rm, rmdir } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { DirImageStore } from '@dsec/images';
import {
  openContainerEdge,
  prepareFnCallImages,
  type Edge,
  type EdgeMetrics,
  type FnCallPoolsOptions,
} from '@dsec/edge';

/**
 * The FnCall runtime images live in a store kept between runs (building them
 * takes a minute or two the first time: debootstrap and nodejs from the
 * Debian mirror). DSEC_TEST_FNCALL_IMAGES moves it.
 */
const IMAGES_DIR = process.env['DSEC_TEST_FNCALL_IMAGES'] ?? '/var/tmp/dsec-fncall-it';

export async function fncallImages(): Promise<DirImageStore> {
  await rm(join(IMAGES_DIR, 'images', '.tmp'), { recursive: true, force: true }).catch(
    () => undefined,
  );
  const store = new DirImageStore(join(IMAGES_DIR, 'images'));
  await prepareFnCallImages(store, { cacheDir: join(IMAGES_DIR, 'cache') });
  return store;
}

/** An edge over the FnCall images in a private state dir and cgroup parent. */
export async function openFnCallEdge(
  fncall: FnCallPoolsOptions = {},
  metrics?: EdgeMetrics,
): Promise<{
  edge: Edge;
  stateDir: string;
  cgroupParent: string;
  close(): Promise<void>;
}> {
  const store = await fncallImages();
  const dir = await mkdtemp(join(tmpdir(), 'dsec-fncall-it-'));
  await chmod(dir, 0o711);
  const cgroupParent = `dsec-test-${basename(dir)}`;
  const stateDir = join(dir, 'edge');
  const edge = await openContainerEdge({
    edgeId: 'fn-edge',
    stateDir,
    store,
    cgroupParent,
    fncall,
    ...(metrics ? { metrics } : {}),
  });
  let closed = false;
  return {
    edge,
    stateDir: dir,
    cgroupParent,
    async close() {
      if (!closed) await edge.close();
      closed = true;
    },
  };
}

export async function removeStateDir(dir: string, cgroupParent: string): Promise<void> {
  await rm(dir, { recursive: true, force: true });
  for (const ctrl of await readdir('/sys/fs/cgroup'))
    await rmdir(`/sys/fs/cgroup/${ctrl}/${cgroupParent}`).catch(() => undefined);
}
