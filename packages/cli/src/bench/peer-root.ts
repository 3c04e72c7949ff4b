import { chown, mkdir } from 'node:fs/promises';
import { join } from 'node:path';
import { hostErofsMounter } from '@dsec/edge';
import { mountRootfs, unmount } from '@dsec/native';

// File-backed where the kernel has it (6.12+), else loop devices; probed once per process.
const layerMounter = hostErofsMounter();

/** A uid range far above any edge slot's, for the bare-runtime peers. */
export const PEER_HOST_ID = 100_000 + 60_000 * 65_536;
export const PEER_ID_COUNT = 65_536;

/**
 * The root a bare-runtime peer runs in: the same EROFS layer and idmapped
 * overlay a DSec sandbox gets, mounted once at `rootfs` (layer, upper and work
 * under `dir`). `unmount` takes it down again.
 */
export async function mountPeerRoot(
  dir: string,
  rootfs: string,
  image: string,
): Promise<{ unmount: () => Promise<void> }> {
  const layerDir = join(dir, 'layer');
  const upper = join(dir, 'upper');
  const work = join(dir, 'work');
  await Promise.all([layerDir, rootfs, upper, work].map((d) => mkdir(d, { recursive: true })));
  await Promise.all([upper, work].map((d) => chown(d, PEER_HOST_ID, PEER_HOST_ID)));
  await layerMounter.mountErofs(image, layerDir);
  await mountRootfs({
    target: rootfs,
    upper,
    work,
    lowers: [layerDir],
    idmap: { hostId: PEER_HOST_ID, size: PEER_ID_COUNT },
  });
  return {
    unmount: async () => {
      await unmount([rootfs], { detach: true });
      await unmount([layerDir], { detach: true });
    },
  };
}
