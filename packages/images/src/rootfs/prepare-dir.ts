import { mkdir, readdir } from 'node:fs/promises';
import { DsecError } from '@dsec/core';

/** Creates `dir` or accepts it empty; refuses to build a rootfs over existing files. */
export async function prepareEmptyDir(dir: string): Promise<void> {
  await mkdir(dir, { recursive: true, mode: 0o755 });
  if ((await readdir(dir)).length > 0) {
    throw new DsecError('invalid_argument', `${dir} is not empty`, { field: 'dir' });
  }
}
