import { isAbsolute } from 'node:path';
import { DsecError, type ImageStore } from '@dsec/core';
import { DirImageStore } from './dir-store.js';

export interface OpenImageStoreOptions {
  /** Where remote stores keep whole-blob copies for `blobPath` (metadata images, pulls). */
  cacheDir?: string;
}

/**
 * Opens a store from its location (`ImageStore.location`): `dir:/abs/path`
 * or a bare absolute path for a POSIX store.
 */
export function openImageStore(location: string, options: OpenImageStoreOptions = {}): ImageStore {
  void options;
  const path = location.startsWith('dir:') ? location.slice('dir:'.length) : location;
  if (isAbsolute(path)) return new DirImageStore(path);
  throw new DsecError(
    'invalid_argument',
    `unknown image store ${JSON.stringify(location)}: use an absolute path, dir:/path or s3://bucket/prefix`,
    { field: 'store' },
  );
}
