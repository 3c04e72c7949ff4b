import { open } from 'node:fs/promises';
import { runTool } from '../network/sys.js';

/**
 * A sparse ext4 image of `sizeMb` for a sandbox's writable layer (a
 * container's quota'd upper dir, a microVM's writable disk): its size is the
 * disk quota, its inode table (one per 16 KiB) the inode quota. No journal
 * (the layer is scratch space that dies with the sandbox) and no reserved
 * blocks; blocks are only allocated as the sandbox writes. `exclusive`
 * refuses an image that already exists.
 */
export async function makeScratchDisk(
  image: string,
  sizeMb: number,
  options: { exclusive: boolean },
): Promise<void> {
  const fh = await open(image, options.exclusive ? 'wx' : 'w', 0o600);
  try {
    await fh.truncate(sizeMb * 2 ** 20);
  } finally {
    await fh.close();
  }
  await runTool('mkfs.ext4', [
    '-q',
    '-F',
    '-O',
    '^has_journal',
    '-E',
    'lazy_itable_init=1,nodiscard',
    '-m',
    '0',
    '-i',
    '16384',
    image,
  ]);
}
